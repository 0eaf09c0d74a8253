"""Fixed costs between two processes: what a request that moves almost no bytes pays.

Medians over ``--repeat`` round trips, in microseconds:

- ``tcp_rtt``: a 64-byte ping-pong over a plain anyio TCP stream (the floor of this machine);
- ``message_rtt``: the same over the transport's control channel;
- ``write_notify_rtt``: a message to the writer, which writes ``--bytes`` (CUDA by IPC with ``--device cuda``)
  with a notification; timed until the notification arrives (what the disagg benchmark's contiguous write is);
- ``synchronize_cuda``: recording an event and waiting for it in a worker thread (once per CUDA write).

    python benchmarks/latency_probe.py --device cuda --json $OUT/latency_h200.json
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import anyio
import anyio.abc
import numpy as np
import torch

from kvferry.transports import get_transport
from kvferry.transports._memory import synchronize_cuda


async def writer(args: Any) -> None:
    """The child: echoes messages; on b"write <address>", writes its buffer there with a notification."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=args.tcp_port)
    async with get_transport(args.transport)() as transport:
        peer = await transport.connect(args.address)
        buffer = torch.randint(0, 256, (args.bytes,), dtype=torch.uint8, device=args.device)
        await transport.register(buffer)
        await transport.send_message(peer, b"ready")
        async with listener:
            stream = await listener.listeners[0].accept()  # type: ignore[attr-defined]
            stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
            while (data := await stream.receive()) != b"done":
                await stream.send(data)
        while True:
            message = await transport.receive_message(peer)
            if message == b"bye":
                return
            if message.startswith(b"write "):
                address = int(message.split()[1])
                src = np.array([[buffer.data_ptr(), args.bytes]], dtype=np.uint64)
                dst = np.array([[address, args.bytes]], dtype=np.uint64)
                await transport.write(peer, src, dst, b"n")
            else:
                await transport.send_message(peer, message)


async def measure(args: Any) -> dict[str, Any]:
    async with get_transport(args.transport)() as transport:
        profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        child = subprocess.Popen(  # noqa: ASYNC220 (once, before anything is timed)
            [
                sys.executable,
                *profile,
                __file__,
                "--role",
                "writer",
                "--address",
                transport.address,
                *sys.argv[1:],
            ]
        )
        try:
            peer = await transport.accept()
            target = torch.zeros(args.bytes, dtype=torch.uint8, device=args.device)
            await transport.register(target)
            assert await transport.receive_message(peer) == b"ready"
            out: dict[str, Any] = {}
            stream = await anyio.connect_tcp("127.0.0.1", args.tcp_port)
            stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )
            times = []
            for _ in range(args.repeat):
                began = time.perf_counter()
                await stream.send(b"x" * 64)
                await stream.receive()
                times.append(time.perf_counter() - began)
            out["tcp_rtt"] = statistics.median(times) * 1e6
            await stream.send(b"done")
            times = []
            for _ in range(args.repeat):
                began = time.perf_counter()
                await transport.send_message(peer, b"x" * 64)
                await transport.receive_message(peer)
                times.append(time.perf_counter() - began)
            out["message_rtt"] = statistics.median(times) * 1e6
            times = []
            for _ in range(args.repeat + 1):
                began = time.perf_counter()
                await transport.send_message(peer, f"write {target.data_ptr()}".encode())
                await transport.receive_notification(peer)
                times.append(time.perf_counter() - began)
            out["write_notify_rtt"] = statistics.median(times[1:]) * 1e6
            if args.device.startswith("cuda"):
                times = []
                for _ in range(args.repeat):
                    began = time.perf_counter()
                    await synchronize_cuda()
                    times.append(time.perf_counter() - began)
                out["synchronize_cuda"] = statistics.median(times) * 1e6
            await transport.send_message(peer, b"bye")
        finally:
            await anyio.to_thread.run_sync(child.wait)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="nixl")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--tcp-port", type=int, default=47231)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default="", help="cProfile the writer process into this file")
    parser.add_argument("--role", default="measure")
    parser.add_argument("--address", default="")
    args = parser.parse_args()
    if args.role == "writer":
        anyio.run(writer, args)
        return 0
    out = {
        "transport": args.transport,
        "device": args.device,
        "bytes": args.bytes,
        **anyio.run(measure, args),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
