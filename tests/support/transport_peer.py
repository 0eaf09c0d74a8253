"""A peer process for the cross-process transport tests, driven by JSON lines on stdin/stdout.

Run as ``python tests/support/transport_peer.py NAME [--device cpu|cuda] [--compat HEX]``. It starts the transport,
prints ``{"address": ...}`` and then answers one command per line (see ``_COMMANDS``). Every connection that
reaches it is accepted in the background; commands act on the latest one. Offsets are relative to a named
buffer's start; addresses are absolute. A buffer it registers is granted whole to the latest peer (unless
``alloc`` says ``grant: false``); ``grant`` / ``revoke`` grant parts of it and revoke them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from typing import Any

import anyio
import numpy as np
import torch

from kvferry.transports import Grant, Peer, Registration, Transport, get_transport


class PeerServer:
    def __init__(self, transport: Transport, device: str) -> None:
        self.transport = transport
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}
        self.registrations: dict[str, Registration] = {}
        self.grants: dict[str, list[Grant]] = {}
        self.peer: Peer | None = None
        self.peer_ready = anyio.Event()

    async def accept_forever(self) -> None:
        while True:
            self.peer = await self.transport.accept()
            self.peer_ready.set()

    async def current_peer(self) -> Peer:
        await self.peer_ready.wait()
        assert self.peer is not None
        return self.peer

    async def register(self, name: str, length: int | None = None, *, grant: bool = True) -> dict[str, Any]:
        t = self.buffers[name] if length is None else self.buffers[name][:length]
        self.registrations[name] = await self.transport.register(t)
        if self.peer is not None:
            if grant:
                self.grants.setdefault(name, []).append(
                    await self.transport.grant(self.peer, self.registrations[name])
                )
            # The control channel is ordered: once this message arrives, the peer knows the region (and the
            # grant).
            await self.transport.send_message(self.peer, json.dumps({"registered": name}).encode())
        return {"address": t.data_ptr()}

    def digest(self, name: str, fragments: list[list[int]]) -> str:
        data = self.buffers[name].cpu().numpy()
        h = hashlib.sha256()
        for offset, length in fragments:
            h.update(data[offset : offset + length].data)
        return h.hexdigest()

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "alloc":
            generator = torch.Generator().manual_seed(cmd.get("seed", 0))
            # ``guard`` bytes on each side stay unregistered: no other buffer of this peer lies next to it
            guard = cmd.get("guard", 0)
            size = cmd["size"] + 2 * guard
            if cmd.get("fill") == "random":
                t = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
            else:
                t = torch.zeros(size, dtype=torch.uint8)
            t = t.to(self.device)[guard : guard + cmd["size"]]
            self.buffers[cmd["name"]] = t
            return await self.register(cmd["name"], grant=cmd.get("grant", True))
        if op == "grant":
            # ``fragments``: (offset, length) rows of the named buffer, granted to the latest peer
            base = self.buffers[cmd["name"]].data_ptr()
            rows = np.array([[base + o, n] for o, n in cmd["fragments"]], dtype=np.uint64).reshape(-1, 2)
            try:
                grant = await self.transport.grant(await self.current_peer(), rows)
            except Exception as exc:
                return {"error": type(exc).__name__, "message": str(exc)}
            self.grants.setdefault(cmd["name"], []).append(grant)
            # ordered after the grant: once this message arrives, the peer knows it
            await self.transport.send_message(self.peer, b"granted")  # type: ignore[arg-type]
            return {"ok": True}
        if op == "revoke":
            for grant in self.grants.pop(cmd["name"], []):
                await grant.revoke()
            await self.transport.send_message(self.peer, b"revoked")  # type: ignore[arg-type]
            return {"ok": True}
        if op == "deregister":
            await self.transport.deregister(self.registrations.pop(cmd["name"]))  # revokes its grants
            self.grants.pop(cmd["name"], None)
            if self.peer is not None:
                await self.transport.send_message(
                    self.peer, json.dumps({"deregistered": cmd["name"]}).encode()
                )
            return {"ok": True}
        if op == "reregister":
            # The same memory (same address) again, as after a free and a new allocation that reuses the
            # address; optionally only its first ``length`` bytes.
            return await self.register(cmd["name"], cmd.get("length"))
        if op == "digest":
            return {"sha": await anyio.to_thread.run_sync(self.digest, cmd["name"], cmd["fragments"])}
        if op == "wait_notify":
            peer = await self.current_peer()
            with anyio.fail_after(cmd.get("timeout", 30)):
                notify = await self.transport.receive_notification(peer)
            # The digest is taken the moment the notification arrives: the data must be there already.
            digest = await anyio.to_thread.run_sync(self.digest, cmd["name"], cmd["fragments"])
            return {"notify": notify.hex(), "sha": digest}
        if op == "write":
            peer = await self.current_peer()
            base = self.buffers[cmd["src"]].data_ptr()
            src = np.array([[base + o, n] for o, n in cmd["src_fragments"]], dtype=np.uint64).reshape(-1, 2)
            dst = np.array(cmd["dst_fragments"], dtype=np.uint64).reshape(-1, 2)
            notification = bytes.fromhex(cmd["notify"]) if cmd.get("notify") is not None else None
            try:
                with anyio.fail_after(cmd.get("timeout", 30)):
                    await self.transport.write(peer, src, dst, notification)
            except Exception as exc:
                return {"error": type(exc).__name__, "message": str(exc)}
            return {"ok": True}
        if op == "send":
            await self.transport.send_message(await self.current_peer(), bytes.fromhex(cmd["data"]))
            return {"ok": True}
        if op == "recv":
            peer = await self.current_peer()
            try:
                with anyio.fail_after(cmd.get("timeout", 30)):
                    data = await self.transport.receive_message(peer)
            except Exception as exc:
                return {"error": type(exc).__name__, "message": str(exc)}
            return {"data": data.hex()}
        if op == "send_raw":
            # Bypasses the sender's own limit check: the receiver's check is what is under test.
            from kvferry.transports import messages

            peer = await self.current_peer()
            await self.transport.control.send_frame(peer, messages.FrameKind.MESSAGE, bytes(cmd["size"]))  # type: ignore[attr-defined]
            return {"ok": True}
        if op == "stats":
            return {"stats": self.transport.statistics()._asdict(), "pid": os.getpid()}
        if op == "crash":
            os._exit(9)
        raise ValueError(f"unknown op {op!r}")


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("name")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--compat", default="")
    parser.add_argument("--max-message-bytes", type=int, default=16 << 20)
    args = parser.parse_args()
    factory = get_transport(args.name)
    options: dict[str, Any] = {
        "compat_hash": bytes.fromhex(args.compat),
        "max_message_bytes": args.max_message_bytes,
    }
    async with factory(**options) as transport, anyio.create_task_group() as tg:
        server = PeerServer(transport, args.device)
        tg.start_soon(server.accept_forever)
        print("@@" + json.dumps({"address": transport.address, "pid": os.getpid()}), flush=True)
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line or json.loads(line)["op"] == "exit":
                break
            try:
                reply = await server.handle(json.loads(line))
            except Exception as exc:
                reply = {"error": type(exc).__name__, "message": str(exc)}
            print("@@" + json.dumps(reply), flush=True)
        tg.cancel_scope.cancel()


def set_ucx_test_env() -> None:
    """Loopback-only UCX without warnings, reusable ports, blocking progress; variables already set are kept."""
    for key, value in {
        "UCX_NET_DEVICES": "lo",
        "UCX_WARN_UNUSED_ENV_VARS": "n",
        "UCX_CM_REUSEADDR": "y",
        "UCXPY_PROGRESS_MODE": "blocking",
    }.items():
        os.environ.setdefault(key, value)


if __name__ == "__main__":
    set_ucx_test_env()
    anyio.run(main)
