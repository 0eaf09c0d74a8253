"""A helper process for ``kvferry info`` and ``kvferry bench transfer``: the other end of a transfer.

``python -m kvferry.tools.peer NAME [--device cpu|cuda]`` starts the transport, prints one JSON line
prefixed with ``@@`` (``{"address": ...}``) and answers JSON commands read from stdin the same way. Libraries may
print their own lines to stdout, which points at stderr: only ``@@`` lines, on the original stdout, are ours.

It grants every buffer it allocates to every peer that connects (a benchmark's other end: whoever measures
may write into it): to the peers connected when it allocates (then it sends ``registered`` to the latest), and
to a peer that connects later (then it sends that peer ``granted``, after which its writes find the grants).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from typing import Any, TextIO

import anyio

from kvferry._stdio import reserve_stdout
from kvferry.transports.base import Peer, PeerState, Registration, Transport
from kvferry.transports.handshake import load_secret
from kvferry.transports.registry import get_transport

__all__ = ["main"]


#: our protocol lines (main() points it at the original stdout and fd 1 at stderr, where libraries log)
_out: TextIO = sys.stdout


def reply(obj: dict[str, Any]) -> None:
    _out.write("@@" + json.dumps(obj) + "\n")
    _out.flush()


class _Server:
    def __init__(self, transport: Transport, device: str) -> None:
        import torch

        self.torch = torch
        self.transport = transport
        self.device = device
        self.buffers: dict[str, Any] = {}
        self.peer: Peer | None = None
        self.peers: list[Peer] = []
        self.registrations: list[Registration] = []
        self.ready = anyio.Event()
        self.gloo_ready = False

    async def accept_forever(self) -> None:
        while True:
            peer = await self.transport.accept()
            for registration in self.registrations:
                await self.transport.grant(peer, registration)
            if self.registrations:
                await self.transport.send_message(peer, b"granted")
            self.peers.append(peer)
            self.peer = peer
            self.ready.set()

    async def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        torch = self.torch
        op = cmd["op"]
        if op == "gloo":
            return await anyio.to_thread.run_sync(self._gloo, cmd)
        await self.ready.wait()
        assert self.peer is not None
        if op == "alloc":
            tensor = torch.zeros(cmd["size"], dtype=torch.uint8, device=self.device)
            self.buffers[cmd["name"]] = tensor
            registration = await self.transport.register(tensor)
            self.registrations.append(registration)
            for peer in self.peers:
                if peer.state is PeerState.CONNECTED:
                    await self.transport.grant(peer, registration)
            await self.transport.send_message(self.peer, b"registered")
            return {"address": tensor.data_ptr()}
        if op == "notifications":
            with anyio.fail_after(cmd.get("timeout", 120)):
                for _ in range(cmd["count"]):
                    await self.transport.receive_notification(self.peer)
            return {"ok": True}
        if op == "digest":
            data = self.buffers[cmd["name"]]
            run = cmd["run_bytes"]

            def digest() -> str:
                host = data.cpu().numpy()
                h = hashlib.sha256()
                for r in cmd["runs"]:
                    h.update(host[r * run : (r + 1) * run].data)
                return h.hexdigest()

            return {"sha": await anyio.to_thread.run_sync(digest)}
        raise ValueError(f"unknown op {op!r}")

    def _gloo(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Receive the same bytes with torch.distributed (gloo) and scatter them, as a user would without us."""
        torch = self.torch
        import torch.distributed as dist

        if not self.gloo_ready:
            dist.init_process_group("gloo", init_method=cmd["init_method"], rank=1, world_size=2)
            self.gloo_ready = True
        total, run = cmd["bytes"], cmd["run_bytes"]
        dst = torch.zeros(total, dtype=torch.uint8)
        order = torch.tensor(cmd["runs"], dtype=torch.int64)
        staging = torch.empty(total, dtype=torch.uint8)
        ack = torch.zeros(1, dtype=torch.uint8)
        for _ in range(cmd["repeats"]):
            dist.recv(staging, src=0)
            dst.view(-1, run).index_copy_(0, order, staging.view(-1, run))
            dist.send(ack, dst=0)
        return {"ok": True}


async def _main(name: str, device: str) -> None:
    async with get_transport(name)(secret=load_secret()) as transport, anyio.create_task_group() as tg:
        server = _Server(transport, device)
        tg.start_soon(server.accept_forever)
        reply({"address": transport.address, "pid": os.getpid()})
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                break
            cmd = json.loads(line)
            if cmd["op"] == "exit":
                break
            try:
                reply(await server.handle(cmd))
            except Exception as exc:
                reply({"error": type(exc).__name__, "message": str(exc)})
        tg.cancel_scope.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m kvferry.tools.peer")
    parser.add_argument("name")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    global _out
    # the parent ends us by closing stdin: a Ctrl-C meant for it must not kill us with a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _out = reserve_stdout()
    anyio.run(_main, args.name, args.device)


if __name__ == "__main__":
    main()
