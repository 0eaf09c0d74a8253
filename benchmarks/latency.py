"""Fixed costs between two processes: what a request that moves almost no bytes pays, against a bare TCP
round trip measured in the same run.

This process and a writer process it starts connect over ``--transport``; each figure is the median of
``--round-trips`` round trips, measured ``--repeat`` times (median and ``[min, max]`` of those medians), in
microseconds:

- ``tcp_rtt``: a 64-byte ping-pong over a plain anyio TCP stream: the ceiling, this machine's floor;
- ``message_rtt``: the same over the transport's control channel (``message_ratio``: ``tcp_rtt`` over it);
- ``write_notify_rtt``: a message to the writer, which writes ``--bytes`` into this process's buffer (by CUDA
  IPC with ``--device cuda``) with a notification, timed until the notification arrives;
- ``synchronize_cuda`` (``--device cuda``): recording an event and waiting for it in a worker thread, which
  every CUDA write does once.

``--fragments N`` cuts each write into N equal fragments, the source in order and the destination's fragments
permuted (``kvferry bench transfer``'s layout); ``--stages`` adds the writer's own median time per stage of its
writes (``writer_stages``, from ``_timeline.py``), which shows where a large fragmented write's host time goes
(``--device cuda --bytes 1G --fragments 1024 --stages``).

    python benchmarks/latency.py [--transport nixl] [--device cpu|cuda] [--bytes 4096] [--fragments 1]
        [--round-trips 200] [--repeat 3] [--stages] [--json benchmarks/results/<machine>/latency.json]

Flags ``--tcp-port`` (the TCP ping-pong's port, default 47231) and ``--profile FILE`` (cProfile the writer).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.abc
import numpy as np
import torch
from _provenance import median_spread, write_result
from _timeline import write_stages

from kvferry.transports import get_transport

METRICS = ("tcp_rtt", "message_rtt", "write_notify_rtt", "synchronize_cuda")


def _order(fragments: int) -> Any:
    """Where each source fragment lands (in fragments of the destination)."""
    return np.random.default_rng(0).permutation(fragments).astype(np.uint64)


async def writer(args: Any) -> None:
    """The child: echoes messages; on b"write <address>", writes its buffer there with a notification."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=args.tcp_port)
    async with get_transport(args.transport)() as transport:
        stages = write_stages(transport) if args.stages else None
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
        fragment = args.bytes // args.fragments
        starts = np.arange(args.fragments, dtype=np.uint64) * np.uint64(fragment)
        src = np.stack([buffer.data_ptr() + starts, np.full_like(starts, fragment)], axis=1)
        while True:
            message = await transport.receive_message(peer)
            if message == b"bye":
                report: dict[str, Any] = {}
                if stages is not None:
                    report["stages"] = stages.durations_us()
                    report["not_found"] = stages.missing
                await transport.send_message(peer, json.dumps(report).encode())
                return
            if message.startswith(b"write "):
                address = int(message.split()[1])
                dst = np.stack([address + _order(args.fragments) * np.uint64(fragment), src[:, 1]], axis=1)
                await transport.write(peer, src, dst, b"n")
            else:
                await transport.send_message(peer, message)


def _library_function(name: str) -> Any:
    """The loaded kvferry module's function ``name`` (a private one, such as the wait for a CUDA copy, which
    moves between modules); None when no loaded module defines it."""
    for module_name, module in list(sys.modules.items()):
        function = getattr(module, "__dict__", {}).get(name)
        if module_name.startswith("kvferry") and callable(function):
            return function
    return None


async def _round_trips(count: int, trip: Callable[[], Awaitable[Any]]) -> float:
    """The median of ``count`` timed round trips, in microseconds."""
    times = []
    for _ in range(count):
        began = time.perf_counter()
        await trip()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


async def measure(args: Any) -> dict[str, Any]:
    """Per metric, the median of ``--round-trips`` round trips, ``--repeat`` times."""
    samples: dict[str, list[float]] = {m: [] for m in METRICS}
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
            await transport.grant(peer, await transport.register(target))  # the writer writes into it
            assert await transport.receive_message(peer) == b"ready"
            stream = await anyio.connect_tcp("127.0.0.1", args.tcp_port)
            stream.extra(anyio.abc.SocketAttribute.raw_socket).setsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
            )

            async def tcp() -> None:
                await stream.send(b"x" * 64)
                await stream.receive()

            async def message() -> None:
                await transport.send_message(peer, b"x" * 64)
                await transport.receive_message(peer)

            async def write() -> None:
                await transport.send_message(peer, f"write {target.data_ptr()}".encode())
                await transport.receive_notification(peer)

            for _ in range(args.repeat):
                samples["tcp_rtt"].append(await _round_trips(args.round_trips, tcp))
            await stream.send(b"done")
            await write()  # the first write pays one-off setup (a mapping, a kernel's build)
            cuda = args.device.startswith("cuda")
            synchronize_cuda = _library_function("synchronize_cuda") if cuda else None
            for _ in range(args.repeat):
                samples["message_rtt"].append(await _round_trips(args.round_trips, message))
                samples["write_notify_rtt"].append(await _round_trips(args.round_trips, write))
                if synchronize_cuda is not None:
                    samples["synchronize_cuda"].append(await _round_trips(args.round_trips, synchronize_cuda))
            await transport.send_message(peer, b"bye")
            report = json.loads(await transport.receive_message(peer))
        finally:
            await anyio.to_thread.run_sync(child.wait)
    out: dict[str, Any] = {}
    for metric, values in samples.items():
        if values:
            out[metric], out[f"{metric}_spread"] = median_spread(values)
    out["message_ratio"] = out["tcp_rtt"] / out["message_rtt"]
    if report:
        out["writer_stages"] = report
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="nixl")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--fragments", type=int, default=1, help="fragments per write (see the docstring)")
    parser.add_argument("--round-trips", type=int, default=200, help="timed round trips per repetition")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions (median and spread)")
    parser.add_argument("--tcp-port", type=int, default=47231)
    parser.add_argument("--json", default=None, help="write the stamped result here")
    parser.add_argument("--profile", default="", help="cProfile the writer process into this file")
    parser.add_argument("--stages", action="store_true", help="time the writer's stages (see the docstring)")
    parser.add_argument("--role", default="measure", help=argparse.SUPPRESS)
    parser.add_argument("--address", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "writer":
        anyio.run(writer, args)
        return 0
    if args.repeat < 1 or args.round_trips < 1 or args.bytes % args.fragments:
        parser.error("--repeat and --round-trips must be at least 1 and --fragments must divide --bytes")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    config = {
        "transport": args.transport,
        "device": args.device,
        "bytes": args.bytes,
        "fragments": args.fragments,
        "round_trips": args.round_trips,
        "repeat": args.repeat,
        "statistic": "median microseconds of --round-trips round trips; the median and [min, max] over "
        "--repeat repetitions",
        "ceiling": "tcp_rtt: a bare TCP round trip between the same processes",
    }
    result = anyio.run(measure, args)
    print(json.dumps(result, indent=1))
    if args.json:
        write_result(args.json, "latency", {"config": config, "results": result}, args.device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
