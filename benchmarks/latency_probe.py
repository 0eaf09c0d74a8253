"""Fixed costs between two processes: what a request that moves almost no bytes pays.

Medians over ``--repeat`` round trips, in microseconds:

- ``tcp_rtt``: a 64-byte ping-pong over a plain anyio TCP stream (the floor of this machine);
- ``message_rtt``: the same over the transport's control channel;
- ``write_notify_rtt``: a message to the writer, which writes ``--bytes`` (CUDA by IPC with ``--device cuda``)
  with a notification; timed until the notification arrives (what the disagg benchmark's contiguous write is);
- ``synchronize_cuda``: recording an event and waiting for it in a worker thread (once per CUDA write);
- ``writer_stages`` (``--stages``): the writer's own time per stage of its writes (medians, microseconds), and
  with ``--device cuda`` micro-timings of the copy path in the writer (launch, table upload, synchronisation,
  to its own memory and to the peer's memory mapped by CUDA IPC), to find where a small write's time goes.

``--fragments N`` cuts each write into N equal fragments: the source in order, the destination's fragments
permuted (``kvferry bench transfer``'s layout), so a large fragmented write's stages can be compared with the
contiguous one's (``--fragments 1``); the micro-timings then copy the same fragments, with device times from
CUDA events.

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


class _Stages:
    """Wall time per call of chosen functions (patched on their owners), in microseconds."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        import inspect

        inner = getattr(owner, name)
        times = self.times.setdefault(label, [])
        if inspect.iscoroutinefunction(inner):

            async def timed_async(*a: Any, **k: Any) -> Any:
                began = time.perf_counter()
                try:
                    return await inner(*a, **k)
                finally:
                    times.append((time.perf_counter() - began) * 1e6)

            setattr(owner, name, timed_async)
        else:

            def timed(*a: Any, **k: Any) -> Any:
                began = time.perf_counter()
                try:
                    return inner(*a, **k)
                finally:
                    times.append((time.perf_counter() - began) * 1e6)

            setattr(owner, name, timed)

    def medians(self) -> dict[str, float]:
        return {k: statistics.median(v[1:] or v) for k, v in self.times.items() if v}


def _patch_stages(transport: Any) -> _Stages:
    from kvferry.kernels import span_copy
    from kvferry.transports import _memory
    from kvferry.transports.control import ControlChannel
    from kvferry.transports.writes import WritePipeline

    stages = _Stages()
    cls = type(transport)
    path = type(transport.data_path)
    stages.wrap(cls, "write", "write (whole)")
    stages.wrap(WritePipeline, "checked", "checked (pairing, coalesce, locate)")
    stages.wrap(path, "write", "data path write (route + copy + notify)")
    if hasattr(path, "_ipc_route"):
        stages.wrap(path, "_ipc_route", "ipc route")
    stages.wrap(_memory.CopyPlan, "run", "CopyPlan.run (queue + sync)")
    stages.wrap(_memory.CopyPlan, "_device_rows", "device rows (queue)")
    stages.wrap(span_copy, "piece_table", "piece table")
    stages.wrap(span_copy, "copy_spans", "copy_spans (table + upload + launch)")
    stages.wrap(span_copy, "copy_fragments", "copy_fragments (rows + upload + launch)")
    stages.wrap(span_copy, "_upload", "table upload")
    stages.wrap(span_copy, "_pinned_table", "pinned table")
    stages.wrap(span_copy, "_upload_held", "table upload (grid)")
    stages.wrap(_memory, "wait_event", "wait_event")
    stages.wrap(span_copy._Launcher, "launch", "launch")
    stages.wrap(_memory, "synchronize_cuda", "synchronize_cuda")
    stages.wrap(ControlChannel, "send_frame", "send_frame")
    return stages


def _micro(args: Any, transport: Any, peer: Any, buffer: Any, address: int) -> dict[str, float]:
    """Micro-timings of the CUDA copy path in this process (medians, microseconds)."""
    from kvferry.kernels import span_copy

    own = torch.zeros_like(buffer)
    ipc = transport.data_path._ipc.get(transport.control.peer(peer))
    mapped = None
    if ipc is not None and len(ipc.local):
        index = ipc.table.locate(np.array([[address, args.bytes]], dtype=np.uint64), "d")
        mapped = int(address - int(ipc.starts[index[0]]) + int(ipc.local[index[0]]))
    n = args.bytes
    fragment = n // args.fragments
    order = _order(args)
    table = np.array([[0, 0, n // 8]], dtype=np.int64)
    pinned = torch.from_numpy(table).pin_memory()
    device = buffer.device

    def med(fn: Any) -> float:
        fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.repeat):
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
        torch.cuda.synchronize()
        return statistics.median(times) * 1e6

    from span_copy import timed  # benchmarks/span_copy.py: wall and device (CUDA events) medians

    def med_device(fn: Any) -> float:
        return timed(fn, min(args.repeat, 50))[1] * 1e6

    def spans(dst: int) -> Any:
        s_addr = buffer.data_ptr() + np.arange(args.fragments, dtype=np.int64) * fragment
        d_addr = dst + order * fragment
        lengths = np.full(args.fragments, fragment, dtype=np.int64)
        return lambda: span_copy.copy_spans(device, s_addr, d_addr, lengths)

    def synced(fn: Any) -> Any:
        def run() -> None:
            fn()
            torch.cuda.synchronize()

        return run

    def event_sync() -> None:
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        event.synchronize()

    out = {
        "upload pageable": med(lambda: torch.from_numpy(table).to(device, non_blocking=True)),
        "upload pinned": med(lambda: pinned.to(device, non_blocking=True)),
        "copy_spans own (queue)": med(spans(own.data_ptr())),
        "copy_spans own + sync": med(synced(spans(own.data_ptr()))),
        "copy_ own + sync": med(synced(lambda: own.copy_(buffer))),
        "event record + synchronize (idle)": med(event_sync),
        "empty device synchronize": med(torch.cuda.synchronize),
    }
    if mapped is not None:
        target = torch.as_tensor(_memory_view(mapped, n), device=device)
        out["copy_spans ipc (queue)"] = med(spans(mapped))
        out["copy_spans ipc + sync"] = med(synced(spans(mapped)))
        out["copy_ ipc + sync"] = med(synced(lambda: target.copy_(buffer)))
        out["device: copy_spans ipc"] = med_device(spans(mapped))
        out["device: copy_ ipc"] = med_device(lambda: target.copy_(buffer))
        out["device: copy_spans own"] = med_device(spans(own.data_ptr()))
        out["device: copy_ own"] = med_device(lambda: own.copy_(buffer))
    return out


def _order(args: Any) -> Any:
    """Where each source fragment lands (in fragments of the destination)."""
    return np.random.default_rng(0).permutation(args.fragments).astype(np.int64)


def _memory_view(address: int, n: int) -> Any:
    from kvferry.transports._memory import _CudaArray

    return _CudaArray(address, n)


async def writer(args: Any) -> None:
    """The child: echoes messages; on b"write <address>", writes its buffer there with a notification."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=args.tcp_port)
    async with get_transport(args.transport)() as transport:
        stages = _patch_stages(transport) if args.stages else None
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
        address = 0
        while True:
            message = await transport.receive_message(peer)
            if message == b"bye":
                report: dict[str, Any] = {}
                if stages is not None:
                    report["stages"] = stages.medians()
                    if args.device.startswith("cuda") and address:
                        report["micro"] = _micro(args, transport, peer, buffer, address)
                await transport.send_message(peer, json.dumps(report).encode())
                return
            if message.startswith(b"write "):
                address = int(message.split()[1])
                fragment = args.bytes // args.fragments
                starts = np.arange(args.fragments, dtype=np.uint64) * np.uint64(fragment)
                src = np.stack([buffer.data_ptr() + starts, np.full_like(starts, fragment)], axis=1)
                dst = np.stack(
                    [address + _order(args).astype(np.uint64) * np.uint64(fragment), src[:, 1]], axis=1
                )
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
            await transport.grant(peer, await transport.register(target))  # the writer writes into it
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
            report = json.loads(await transport.receive_message(peer))
            if report:
                out["writer_stages"] = report
        finally:
            await anyio.to_thread.run_sync(child.wait)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transport", default="nixl")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bytes", type=int, default=4096)
    parser.add_argument("--fragments", type=int, default=1, help="fragments per write (see the docstring)")
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--tcp-port", type=int, default=47231)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile", default="", help="cProfile the writer process into this file")
    parser.add_argument("--stages", action="store_true", help="time the writer's stages (see the docstring)")
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
        "fragments": args.fragments,
        **anyio.run(measure, args),
    }
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
