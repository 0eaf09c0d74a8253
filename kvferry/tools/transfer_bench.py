"""``kvferry bench transfer``: writes between two processes, per transport and fragment size, against ceilings
measured in the same run on the same bytes.

Layout. The source is ``total_bytes`` of random data cut into pages of ``page_bytes``, passed to ``write`` one
fragment per page, as an engine passes one per KV block. Pages come in runs of ``fragment_bytes`` that are
contiguous on both sides; the runs land at permuted places, so the transport can merge the pages of a run and
nothing more (a "fragment" is such a run). Every configuration is verified once (sha256 at the receiver).

Rows (``kind``):

- ``write``: the transport, coalescing on;
- ``contiguous``: the same transport, one fragment of ``total_bytes`` (the ceiling the goal is measured against).
  Each fragment size is timed alternately with the contiguous write (``contiguous_seconds`` of its row), and its
  ratio is taken against that paired time, so that load from other processes hits both alike;
- ``memcpy``: a copy of the same bytes inside this process (:class:`~kvferry.tools.ceiling.CopyCeiling`: libc's
  memcpy on the host, a device copy on CUDA). It is timed alternately with every point too
  (``memcpy_seconds`` of its row), and each row's ``ratio_memcpy`` (``ratio_device_copy`` on CUDA) is taken
  against that paired time;
- ``nixl-per-page``: NIXL with one descriptor per page, coalescing off (what a user without kvferry writes);
- ``nixl-alone`` / ``nixl-alone-contiguous``: the nixl transport with its same-host paths off (CUDA IPC,
  process_vm_writev; every byte through NIXL descriptors), coalescing on;
- ``gloo``: torch.distributed (gloo) send/recv of the same bytes, scattered after (always host memory: gloo
  has no CUDA path).

``--device cuda`` puts both ends in CUDA memory (the memcpy row is then a device copy).
"""

from __future__ import annotations

import hashlib
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import anyio
import numpy as np

from kvferry.tools.ceiling import CopyCeiling, ratio_key
from kvferry.tools.peer_process import PeerProcess
from kvferry.transports.base import page_fragments
from kvferry.transports.handshake import SECRET_ENV, new_secret
from kvferry.transports.registry import get_transport

__all__ = ["plot", "run_transfer_bench"]

Progress = Callable[[str], None]


def _layout(total: int, run: int, page: int, seed: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Page ids at the source (in order) and at the destination (runs permuted)."""
    runs = total // run
    per_run = run // page
    order = np.random.default_rng(seed).permutation(runs)
    src_pages = np.arange(runs * per_run)
    dst_pages = (order[:, None] * per_run + np.arange(per_run)[None, :]).reshape(-1)
    return src_pages, dst_pages


async def _timed(repeats: int, action: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        await action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _row(
    kind: str, transport: str, fragment: int, page: int, nbytes: int, fragments: int, seconds: float
) -> dict[str, Any]:
    return {
        "kind": kind,
        "transport": transport,
        "fragment_bytes": fragment,
        "page_bytes": page,
        "bytes": nbytes,
        "fragments": fragments,
        "seconds": seconds,
        "gbps": nbytes / seconds / 1e9,
    }


async def _bench_transport(
    name: str,
    total: int,
    fragment_sizes: Sequence[int],
    page_bytes: int,
    repeats: int,
    progress: Progress,
    baselines: bool,
    device: str = "cpu",
) -> list[dict[str, Any]]:
    import torch

    secret = new_secret()  # both ends authenticate, as engines do
    rows: list[dict[str, Any]] = []
    src = torch.randint(0, 256, (total,), dtype=torch.uint8).to(device)
    ceiling = CopyCeiling(total, device, src)

    async def memcpy() -> None:
        ceiling.run()  # on the loop's thread: no hand-off to a worker thread inside the timed region

    proc: PeerProcess | None = None
    try:
        async with AsyncExitStack() as stack:
            if name == "local":
                # entered first, left last: task groups nest
                local_peer = await stack.enter_async_context(get_transport("local")(secret=secret))
            transport = await stack.enter_async_context(get_transport(name)(secret=secret))
            if name == "local":
                peer = await transport.connect(local_peer.address)
                remote = await local_peer.accept()
                dst_tensor = torch.zeros(total, dtype=torch.uint8, device=device)
                await local_peer.grant(remote, await local_peer.register(dst_tensor))
                await local_peer.send_message(remote, b"registered")
                dst = dst_tensor.data_ptr()

                async def digest(order: list[int], run: int) -> str:
                    data = dst_tensor.cpu().numpy()
                    h = hashlib.sha256()
                    for r in order:
                        h.update(data[r * run : (r + 1) * run].data)
                    return h.hexdigest()

            else:
                proc = await anyio.to_thread.run_sync(
                    partial(PeerProcess, name, device=device, env={SECRET_ENV: secret.decode()})
                )
                peer = await transport.connect(proc.address)
                dst = (await proc.call(op="alloc", name="dst", size=total))["address"]
                process = proc

                async def digest(order: list[int], run: int) -> str:
                    reply = await process.call(op="digest", name="dst", runs=order, run_bytes=run)
                    sha: str = reply["sha"]
                    return sha

            await transport.receive_message(peer)
            if baselines and name == "nixl":
                # NIXL alone first, before the main transport maps the peer's CUDA memory by IPC
                rows += await _nixl_baselines(
                    proc, src, dst, total, fragment_sizes, page_bytes, repeats, progress, secret
                )
            await transport.register(src)
            progress(f"{name}: ceilings")
            whole = np.array([[src.data_ptr(), total]], dtype=np.uint64)
            whole_dst = np.array([[dst, total]], dtype=np.uint64)
            await transport.write(peer, whole, whole_dst)  # warm up: connection, first touch of the pages
            memcpy_s, contiguous = await _paired(
                repeats, memcpy, partial(transport.write, peer, whole, whole_dst)
            )
            rows.append(_row("memcpy", name, total, total, total, 1, memcpy_s))
            rows.append(_row("contiguous", name, total, total, total, 1, contiguous))
            for fragment in fragment_sizes:
                page = min(page_bytes, fragment)
                progress(f"{name}: {fragment >> 10} KiB fragments of {page >> 10} KiB pages")
                src_pages, dst_pages = _layout(total, fragment, page, seed=fragment)
                src_f = page_fragments(src.data_ptr(), page, src_pages)
                dst_f = page_fragments(dst, page, dst_pages)
                await transport.write(peer, src_f, dst_f)
                # source run r landed at destination run runs[r]: hashing them in that order gives the source
                runs = [int(r) for r in dst_pages[:: fragment // page] // (fragment // page)]
                expected_sha = hashlib.sha256(src.cpu().numpy().data).hexdigest()
                verified = await digest(runs, fragment) == expected_sha
                paired_memcpy, paired, seconds = await _paired(
                    repeats,
                    memcpy,
                    partial(transport.write, peer, whole, whole_dst),
                    partial(transport.write, peer, src_f, dst_f),
                )
                row = _row("write", name, fragment, page, total, total // fragment, seconds)
                row["verified"] = verified
                row["contiguous_seconds"] = paired
                row["memcpy_seconds"] = paired_memcpy
                rows.append(row)
    finally:
        if proc is not None:
            await anyio.to_thread.run_sync(proc.close)
    for row in rows:
        if row["transport"] != name:
            continue
        row.setdefault("contiguous_seconds", contiguous)
        row.setdefault("memcpy_seconds", memcpy_s)
        row["ratio_contiguous"] = row["seconds"] and row["contiguous_seconds"] / row["seconds"]
        row[ratio_key(device)] = row["seconds"] and row["memcpy_seconds"] / row["seconds"]
    return rows


async def _paired(repeats: int, *actions: Callable[[], Any]) -> list[float]:
    """Median seconds of each action, timed alternately (one of each in turn) so that all see the same load."""
    times: list[list[float]] = [[] for _ in actions]
    for _ in range(repeats):
        for action, seconds in zip(actions, times, strict=True):
            seconds.append(await _timed(1, action))
    return [statistics.median(seconds) for seconds in times]


async def _nixl_baselines(
    proc: PeerProcess | None,
    src: Any,
    dst: int,
    total: int,
    fragment_sizes: Sequence[int],
    page_bytes: int,
    repeats: int,
    progress: Progress,
    secret: bytes,
) -> list[dict[str, Any]]:
    """What NIXL alone does (no CUDA IPC path): coalesced descriptors, and one descriptor per page."""
    assert proc is not None
    rows = []
    whole = np.array([[src.data_ptr(), total]], dtype=np.uint64)
    whole_dst = np.array([[dst, total]], dtype=np.uint64)
    async with (
        get_transport("nixl")(cuda_ipc=False, host_cma=False, secret=secret) as plain,
        get_transport("nixl")(coalesce=False, cuda_ipc=False, host_cma=False, secret=secret) as naive,
    ):
        plain_peer = await plain.connect(proc.address)
        naive_peer = await naive.connect(proc.address)
        # the peer grants them its buffer as they connect, then says so (the control channel is ordered)
        await plain.receive_message(plain_peer)
        await naive.receive_message(naive_peer)
        await plain.register(src)
        await naive.register(src)
        progress("nixl alone: contiguous")
        await plain.write(plain_peer, whole, whole_dst)
        contiguous = await _timed(repeats, partial(plain.write, plain_peer, whole, whole_dst))
        rows.append(_row("nixl-alone-contiguous", "nixl", total, total, total, 1, contiguous))
        rows[-1]["contiguous_seconds"] = contiguous
        alone = (
            src.device.type != "cpu"
        )  # on host memory nixl always goes through NIXL: its write rows are this
        for fragment in fragment_sizes:
            page = min(page_bytes, fragment)
            progress(f"nixl alone: {fragment >> 10} KiB fragments")
            src_pages, dst_pages = _layout(total, fragment, page, seed=fragment)
            src_f = page_fragments(src.data_ptr(), page, src_pages)
            dst_f = page_fragments(dst, page, dst_pages)
            if alone:
                await plain.write(plain_peer, src_f, dst_f)
                paired, seconds = await _paired(
                    repeats,
                    partial(plain.write, plain_peer, whole, whole_dst),
                    partial(plain.write, plain_peer, src_f, dst_f),
                )
                row = _row("nixl-alone", "nixl", fragment, page, total, total // fragment, seconds)
                row["contiguous_seconds"] = paired
                rows.append(row)
            await naive.write(naive_peer, src_f, dst_f)
            seconds = await _timed(repeats, partial(naive.write, naive_peer, src_f, dst_f))
            row = _row("nixl-per-page", "nixl", fragment, page, total, len(src_f), seconds)
            row["contiguous_seconds"] = contiguous
            rows.append(row)
    return rows


def _gloo_sender(total: int, fragment: int, page: int, repeats: int, init_method: str, first: bool) -> float:
    import torch
    import torch.distributed as dist

    if first:
        dist.init_process_group("gloo", init_method=init_method, rank=0, world_size=2)
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        # the source is one contiguous run here; the receiver scatters the runs to their permuted places
        dist.send(src, dst=1)
        dist.recv(ack, src=1)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def _bench_gloo(
    total: int, fragment_sizes: Sequence[int], repeats: int, progress: Progress
) -> list[dict[str, Any]]:
    import socket

    rows = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_method = f"tcp://127.0.0.1:{port}"
    proc = await anyio.to_thread.run_sync(PeerProcess, "local")
    try:
        for i, fragment in enumerate(fragment_sizes):
            progress(f"gloo: {fragment >> 10} KiB fragments")
            _, dst_pages = _layout(total, fragment, fragment, seed=fragment)
            runs = [int(p) for p in dst_pages]
            async with anyio.create_task_group() as tg:
                receive = partial(
                    proc.call,
                    op="gloo",
                    init_method=init_method,
                    bytes=total,
                    run_bytes=fragment,
                    runs=runs,
                    repeats=repeats + 1,
                )
                tg.start_soon(receive)
                seconds = await anyio.to_thread.run_sync(
                    _gloo_sender, total, fragment, fragment, repeats + 1, init_method, i == 0
                )
            rows.append(_row("gloo", "gloo", fragment, fragment, total, total // fragment, seconds))
    finally:
        await anyio.to_thread.run_sync(proc.close)
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return rows


async def run_transfer_bench(
    transports: Sequence[str],
    total_bytes: int,
    fragment_sizes: Sequence[int],
    *,
    page_bytes: int = 64 << 10,
    repeats: int = 5,
    baselines: bool = True,
    progress: Progress | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Run the benchmark and return ``{"config": {...}, "rows": [...], "goal": {...}}`` (the ``--json`` output)."""
    say = progress or (lambda message: None)
    for key, value in {"UCX_WARN_UNUSED_ENV_VARS": "n"}.items():
        os.environ.setdefault(key, value)
    rows: list[dict[str, Any]] = []
    for name in transports:
        rows += await _bench_transport(
            name, total_bytes, fragment_sizes, page_bytes, repeats, say, baselines, device
        )
    if baselines:
        gloo = await _bench_gloo(total_bytes, fragment_sizes, repeats, say)
        for row in gloo:
            ceiling = next((r for r in rows if r["kind"] == "memcpy"), None)
            # gloo moves host memory: against the host memcpy only
            row["ratio_memcpy"] = ceiling["seconds"] / row["seconds"] if ceiling and device == "cpu" else None
            row["ratio_contiguous"] = None
        rows += gloo
    goal = {
        name: all(
            r["ratio_contiguous"] >= 0.8
            for r in rows
            if r["kind"] == "write" and r["transport"] == name and r["fragment_bytes"] >= 1 << 20
        )
        for name in transports
        if name != "local"
    }
    import platform

    import torch

    config = {
        "total_bytes": total_bytes,
        "fragment_bytes": list(fragment_sizes),
        "page_bytes": page_bytes,
        "repeats": repeats,
        "device": device,
        "gloo_device": "cpu",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "statistic": "median seconds per write",
    }
    return {"config": config, "rows": rows, "goal_fragments_1MiB_reach_0.8_of_contiguous": goal}


def plot(result: dict[str, Any], path: str) -> None:
    """GB/s against fragment size, one line per transport and baseline; ceilings as dashed lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    rows = result["rows"]
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r["kind"] in ("write", "nixl-per-page", "nixl-alone", "gloo"):
            label = r["transport"] if r["kind"] == "write" else r["kind"]
            series.setdefault(label, []).append((r["fragment_bytes"], r["gbps"]))
    for label, points in series.items():
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    colors = {}
    for line in ax.get_lines():
        colors[line.get_label()] = line.get_color()
    for r in rows:
        if r["kind"] == "contiguous":
            ax.axhline(r["gbps"], linestyle="--", color=colors.get(r["transport"], "gray"), alpha=0.6)
        if r["kind"] == "memcpy" and r["transport"] == rows[0]["transport"]:
            ax.axhline(r["gbps"], linestyle=":", color="black", alpha=0.6, label="memcpy")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("fragment bytes (contiguous run on both sides)")
    ax.set_ylabel("GB/s")
    cfg = result["config"]
    ax.set_title(
        f"{cfg['total_bytes'] >> 20} MiB per write between two processes (dashed: one contiguous write)"
    )
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
