"""``kvferry bench offload``: how fast a suspended request's cache moves to the host and back, against a plain
copy of the same bytes in the same run, and how long the event loop waits while it moves.

**Throughput.** Per size (``--sizes``, 64 KiB to 1 GiB by default), one request of about that many bytes (its
pages, draft pages, state slot, replay row and ``num_accepted``: the move's own byte count is reported) in a
manager of its own, its pages interleaved with another request's so that no two of its pages are neighbours
(the copy cannot merge them: the hardest layout), every byte random. Each run times an offload and a restore
through the two phases (``start_offload`` / ``start_restore``, the copy run in this thread, ``finish``: the
bookkeeping at both ends is counted) and, right before each, the **ceiling**: one contiguous copy of the same
number of bytes between a preallocated device (CUDA) or host (CPU) buffer and a pinned (CUDA) or preallocated
(CPU) host buffer. The first offload and restore are a warm-up (``cold_*``: the host buffer is allocated and,
on CUDA, pinned then; later moves reuse it). Figures are the median over ``--repeat`` runs with ``[min, max]``
as ``_spread``; a ratio is the ceiling's seconds over the move's, per run. ``copy_ratio`` is the same for the
copy alone (without the bookkeeping). After the last restore the request's bytes are checked against the
first offload's (``verified``). Goal: from 1 MiB on, 0.8 of the ceiling.

**The loop.** A request of ``--loop-bytes`` (1 GiB) of the Nemotron-H-8B preset at TP 1 (512 KiB pages, a
96 MiB state slot; pages interleaved the same way) is offloaded and restored through
:func:`~kvferry.engine.host_moves.offload_request` / :func:`~kvferry.engine.host_moves.restore_request` while
a ticker task on the same anyio loop sleeps ``TICK_S`` and records the gap between its ticks; the longest gap
during each move, against the longest during as long an idle stretch right before (the machine's own noise).
Goal: no gap over 5 ms while a move runs.

The model of the throughput rows is ``tiny``'s shapes with ``--page-kib`` KiB attention and draft pages
(``tokens_per_block`` set so), so that requests from 64 KiB fit.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np
import torch
from attrs import frozen

from kvferry.errors import ConfigError
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.manager import CacheManager
from kvferry.pools.spec import ModelSpec, preset

__all__ = [
    "GOAL_FROM_BYTES",
    "GOAL_GAP_MS",
    "GOAL_RATIO",
    "SIZES",
    "TICK_S",
    "OffloadBenchConfig",
    "bench_spec",
    "plot",
    "run_offload_bench",
    "table",
]

#: the default request sizes: 64 KiB to 1 GiB in powers of 4
SIZES = tuple(64 << (10 + 2 * i) for i in range(8))
#: the goal: from this size on, a move reaches GOAL_RATIO of the ceiling
GOAL_FROM_BYTES = 1 << 20
GOAL_RATIO = 0.8
#: the goal of the loop: no gap between ticks longer than this while a move runs
GOAL_GAP_MS = 5.0
#: the ticker's sleep between ticks
TICK_S = 0.001
#: replay tokens per slot of the benchmark's arenas
MAX_REPLAY_TOKENS = 4
#: the two requests of a benchmark's manager: the one moved, and the one whose pages sit between its pages
MOVED, FILLER = 1, 2


@frozen
class OffloadBenchConfig:
    device: str = "cpu"
    sizes: tuple[int, ...] = SIZES
    repeat: int = 3
    page_kib: int = 64
    #: the loop measurement's request (0: not measured)
    loop_bytes: int = 1 << 30


def bench_spec(page_kib: int) -> ModelSpec:
    """``tiny``'s shapes with ``page_kib`` KiB attention and draft pages (1 KiB and 512 B per token)."""
    tiny = preset("tiny")
    assert tiny.drafter is not None
    drafter = attrs.evolve(tiny.drafter, tokens_per_block=2 * page_kib)
    return attrs.evolve(tiny, name=f"tiny-{page_kib}k", tokens_per_block=page_kib, drafter=drafter)


def _fixed_bytes(layout: CacheLayout) -> int:
    return layout.state_bytes_per_slot + layout.replay.slot_stride + 8


def _tokens_for(spec: ModelSpec, nbytes: int) -> int:
    """Tokens of a request of about ``nbytes`` (whole attention blocks, at least one)."""
    layout = CacheLayout.build(
        spec.shard(1, 0), num_pages=2, num_slots=2, num_draft_pages=2, max_replay_tokens=MAX_REPLAY_TOKENS
    )
    per_token = layout.bytes_per_token("attention") + layout.bytes_per_token("draft")
    blocks = max(1, round((nbytes - _fixed_bytes(layout)) / per_token / spec.tokens_per_block))
    return blocks * spec.tokens_per_block


def _manager(spec: ModelSpec, tokens: int, device: torch.device) -> CacheManager:
    """A manager whose MOVED request holds ``tokens`` tokens of pages, every other page (and draft page) of the
    arena, FILLER the pages between; every byte random; both suspended."""
    assert spec.drafter is not None
    blocks = -(-tokens // spec.tokens_per_block)
    draft_blocks = -(-tokens // spec.drafter.tokens_per_block)
    layout = CacheLayout.build(
        spec.shard(1, 0),
        num_pages=2 * blocks + 1,
        num_slots=3,
        num_draft_pages=2 * draft_blocks + 1,
        max_replay_tokens=MAX_REPLAY_TOKENS,
    )
    arena = CacheArena(layout, device)
    generator = torch.Generator(device=device).manual_seed(0)
    for tensor in (*arena.pool_tensors().values(), arena.replay_tensor):
        tensor.random_(0, 256, generator=generator)
    m = CacheManager.for_arena(arena, max_batch_size=2, enable_reuse=False)
    tpb = spec.tokens_per_block
    for rid in (MOVED, FILLER):
        m.create(rid, [1])
        m.resume(rid, capacity=tpb)
    for capacity in range(2 * tpb, blocks * tpb + 1, tpb):
        m.grow_many(((MOVED, capacity), (FILLER, capacity)))  # one page each, in turn
    m.set_num_accepted(MOVED, 3)
    m.suspend(MOVED)
    m.suspend(FILLER)
    return m


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Ceiling:
    """One contiguous copy of ``nbytes`` between device (or host) memory and pinned (or plain) host memory."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8).to(device)
        # touched once: a preallocated buffer, its pages faulted in before any copy is timed
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def _timed(self, copy: Callable[[], object]) -> float:
        _sync(self.device)
        began = time.perf_counter()
        copy()
        _sync(self.device)
        return time.perf_counter() - began

    def to_host(self) -> float:
        if self.device.type == "cpu":
            source, host = self.source.numpy(), self.host.numpy()
            return self._timed(lambda: np.copyto(host, source))
        return self._timed(lambda: self.host.copy_(self.source, non_blocking=True))

    def from_host(self) -> float:
        if self.device.type == "cpu":
            source, host = self.source.numpy(), self.host.numpy()
            return self._timed(lambda: np.copyto(source, host))
        return self._timed(lambda: self.source.copy_(self.host, non_blocking=True))


def _request_bytes(m: CacheManager) -> list[torch.Tensor]:
    arena = m.arena
    assert arena is not None
    slot = m.slot_id(MOVED)
    assert slot is not None
    saved = arena.save_slots([slot])
    assert saved.replay is not None and saved.num_accepted is not None
    return [
        *arena.save_pages("attention", list(m.block_table(MOVED))).blocks,
        *arena.save_pages("draft", list(m.draft_block_table(MOVED))).blocks,
        *saved.blocks,
        saved.replay,
        saved.num_accepted,
    ]


def _move(m: CacheManager, offload: bool) -> tuple[float, float, int]:
    """Seconds of a whole two-phase move (bookkeeping included) and of its copy alone, and its bytes."""
    device = m.arena.device if m.arena is not None else torch.device("cpu")
    _sync(device)
    began = time.perf_counter()
    move = m.start_offload(MOVED) if offload else m.start_restore(MOVED)
    copy_began = time.perf_counter()
    move.run()
    copied = time.perf_counter()
    if not m.finish(move):
        raise ConfigError(f"the benchmark's {'offload' if offload else 'restore'} did not commit: {move!r}")
    _sync(device)
    return time.perf_counter() - began, copied - copy_began, move.nbytes


def _summary(values: Sequence[float]) -> tuple[float, list[float]]:
    return statistics.median(values), [min(values), max(values)]


def _put(row: dict[str, Any], name: str, values: Sequence[float]) -> None:
    row[name], row[f"{name}_spread"] = _summary(values)


def measure_size(spec: ModelSpec, target: int, device: torch.device, repeat: int) -> dict[str, Any]:
    """One row: offload and restore of a request of about ``target`` bytes against the ceiling."""
    m = _manager(spec, _tokens_for(spec, target), device)
    expected = _request_bytes(m)
    cold_offload, _, nbytes = _move(m, True)
    cold_restore, _, _ = _move(m, False)
    ceiling = _Ceiling(nbytes, device)
    runs: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        runs.setdefault(name, []).append(seconds)

    for _ in range(repeat):
        for kind, offload in (("offload", True), ("restore", False)):
            add(f"ceiling_{kind}_s", ceiling.to_host() if offload else ceiling.from_host())
            whole, copy, _ = _move(m, offload)
            add(f"{kind}_s", whole)
            add(f"{kind}_copy_s", copy)
    verified = all(torch.equal(a, b) for a, b in zip(expected, _request_bytes(m), strict=True))
    stats = m.statistics()
    row: dict[str, Any] = {
        "target_bytes": target,
        "bytes": nbytes,
        "pages": len(m.block_table(MOVED)),
        "draft_pages": len(m.draft_block_table(MOVED)),
        "runs": repeat,
        "cold_offload_s": cold_offload,
        "cold_restore_s": cold_restore,
        "host_bytes": stats.host_bytes,
        "verified": verified,
    }
    for name, values in runs.items():
        _put(row, name, values)
        _put(row, name.replace("_s", "_gbps"), [nbytes / s / 1e9 for s in values])
    for kind in ("offload", "restore"):
        ceilings = runs[f"ceiling_{kind}_s"]
        _put(row, f"{kind}_ratio", [c / s for c, s in zip(ceilings, runs[f"{kind}_s"], strict=True)])
        _put(
            row, f"{kind}_copy_ratio", [c / s for c, s in zip(ceilings, runs[f"{kind}_copy_s"], strict=True)]
        )
    return row


async def _loop_run(m: CacheManager) -> dict[str, float]:
    """One offload and restore through the async path with a ticker on the loop, then as long idle: per stretch
    the longest gap between ticks, the 99th percentile and the gaps over the goal (ms, ms, count)."""
    import anyio

    from kvferry.engine.host_moves import offload_request, restore_request

    ticks: list[tuple[float, float]] = []  # (when, gap since the last tick)
    done = anyio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await anyio.sleep(TICK_S)
            now = time.perf_counter()
            ticks.append((now, now - last))
            last = now

    marks: dict[str, float] = {}
    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.05)
        marks["offload"] = time.perf_counter()
        assert await offload_request(m, MOVED)
        marks["restore"] = time.perf_counter()
        assert await restore_request(m, MOVED)
        marks["idle"] = time.perf_counter()
        # as long idle: the machine's own gaps over the same time
        await anyio.sleep(max(0.3, marks["idle"] - marks["offload"]))
        marks["end"] = time.perf_counter()
        done.set()

    out = {"offload_s": marks["restore"] - marks["offload"], "restore_s": marks["idle"] - marks["restore"]}
    for name, start, end in (
        ("offload", marks["offload"], marks["restore"]),
        ("restore", marks["restore"], marks["idle"]),
        ("idle", marks["idle"], marks["end"]),
    ):
        # a gap belongs to the stretch it ends in, and the tick just after a stretch to it too
        gaps = sorted(g for t, g in ticks if start < t <= end + 2 * TICK_S)
        out[f"{name}_max_gap_ms"] = 1e3 * (gaps[-1] if gaps else 0.0)
        out[f"{name}_p99_gap_ms"] = 1e3 * (gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0)
        out[f"{name}_gaps_over_goal"] = float(sum(g * 1e3 > GOAL_GAP_MS for g in gaps))
    return out


def measure_loop(nbytes: int, device: torch.device, repeat: int) -> dict[str, Any]:
    """The loop's longest gaps while a request of about ``nbytes`` of Nemotron-H-8B moves, ``repeat`` times."""
    import anyio

    spec = preset("nemotron-h-8b")
    m = _manager(spec, _tokens_for(spec, nbytes), device)
    # cold: the first offload allocates (and on CUDA pins) its host buffer, in the copy's thread
    m.trim_host_memory()
    cold = anyio.run(_loop_run, m)
    _, _, moved = _move(m, True)
    _move(m, False)
    # warm: the buffer is reused, as in a running engine
    runs = [anyio.run(_loop_run, m) for _ in range(repeat)]
    out: dict[str, Any] = {
        "preset": spec.name,
        "bytes": moved,
        "pages": len(m.block_table(MOVED)),
        "draft_pages": len(m.draft_block_table(MOVED)),
        "tick_ms": TICK_S * 1e3,
        "runs": repeat,
    }
    for name in runs[0]:
        _put(out, name, [r[name] for r in runs])
    out["cold"] = cold
    worst = max(max(r["offload_max_gap_ms"], r["restore_max_gap_ms"]) for r in runs)
    out["worst_gap_ms"] = worst
    out["worst_idle_gap_ms"] = max(r["idle_max_gap_ms"] for r in runs)
    out[f"goal_gaps_under_{GOAL_GAP_MS:g}ms"] = worst <= GOAL_GAP_MS
    return out


def _device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: CUDA is not available here (torch sees no GPU)")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def run_offload_bench(config: OffloadBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every size's row and the loop's figures, as one JSON-ready result."""
    device = _device(config.device)
    spec = bench_spec(config.page_kib)
    rows = []
    for size in config.sizes:
        progress(f"offload of {_human(size)}")
        row = measure_size(spec, size, device, config.repeat)
        rows.append(row)
        progress(
            f"  {_human(row['bytes'])}: offload {row['offload_gbps']:.2f} GB/s ({row['offload_ratio']:.2f} of "
            f"{row['ceiling_offload_gbps']:.2f}), restore {row['restore_gbps']:.2f} GB/s "
            f"({row['restore_ratio']:.2f} of {row['ceiling_restore_gbps']:.2f})"
        )
    loop = None
    if config.loop_bytes:
        progress(f"the event loop while {_human(config.loop_bytes)} moves")
        loop = measure_loop(config.loop_bytes, device, config.repeat)
    judged = [r for r in rows if r["target_bytes"] >= GOAL_FROM_BYTES]
    return {
        "config": {
            "device": str(device),
            "sizes": list(config.sizes),
            "repeat": config.repeat,
            "page_kib": config.page_kib,
            "model": spec.name,
            "loop_bytes": config.loop_bytes,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "statistic": "median over --repeat runs, [min, max] in _spread; a ratio is the ceiling's seconds over "
            "the move's, per run",
            "ceiling": "one contiguous copy of the same bytes between a device (CUDA) or host (CPU) buffer and a "
            "pinned (CUDA) or preallocated (CPU) host buffer, timed right before each move",
        },
        "rows": rows,
        "loop": loop,
        "goal_from_1MiB_reach_0.8_of_ceiling": {
            kind: (all(r[f"{kind}_ratio"] >= GOAL_RATIO for r in judged) if judged else None)
            for kind in ("offload", "restore")
        },
    }


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            value = n / scale
            return (
                f"{value:.0f} {unit}"
                if math.isclose(value, round(value), rel_tol=0.02)
                else f"{value:.1f} {unit}"
            )
    return f"{n} B"


def table(result: dict[str, Any]) -> str:
    """The rows and the loop's figures as a text table."""
    lines = [
        f"{'request':>10}{'pages':>8}{'offload GB/s':>14}{'ratio':>7}{'copy':>6}{'ceiling':>9}"
        f"{'restore GB/s':>14}{'ratio':>7}{'copy':>6}{'ceiling':>9}"
    ]
    lines.extend(
        f"{_human(r['bytes']):>10}{r['pages'] + r['draft_pages']:>8}"
        f"{r['offload_gbps']:>14.2f}{r['offload_ratio']:>7.2f}{r['offload_copy_ratio']:>6.2f}"
        f"{r['ceiling_offload_gbps']:>9.2f}"
        f"{r['restore_gbps']:>14.2f}{r['restore_ratio']:>7.2f}{r['restore_copy_ratio']:>6.2f}"
        f"{r['ceiling_restore_gbps']:>9.2f}" + ("" if r["verified"] else "  NOT VERIFIED")
        for r in result["rows"]
    )
    goal = result["goal_from_1MiB_reach_0.8_of_ceiling"]
    lines.append(
        f"goal (from 1 MiB, {GOAL_RATIO} of the ceiling): "
        + ", ".join(
            f"{k}: {'not judged' if v is None else 'met' if v else 'MISSED'}" for k, v in goal.items()
        )
    )
    loop = result.get("loop")
    if loop:
        lines.append(
            f"event loop while {_human(loop['bytes'])} moves ({loop['preset']}, {loop['pages']} pages; ticks of "
            f"{loop['tick_ms']:g} ms), longest gap / 99th percentile, median of {loop['runs']} runs:"
        )
        lines.extend(
            f"  {name:<8}{loop[f'{name}_max_gap_ms']:>7.2f} ms /{loop[f'{name}_p99_gap_ms']:>6.2f} ms"
            + (f"  ({loop[f'{name}_s']:.3f} s)" if name != "idle" else "  (as long, nothing moving)")
            for name in ("offload", "restore", "idle")
        )
        cold = loop["cold"]
        lines.append(
            f"  cold (the host buffer allocated{' and pinned' if 'cuda' in result['config']['device'] else ''} "
            f"in the copy's thread): {cold['offload_max_gap_ms']:.2f} ms / {cold['offload_p99_gap_ms']:.2f} ms  "
            f"({cold['offload_s']:.3f} s)"
        )
        lines.append(
            f"  worst gap while moving {loop['worst_gap_ms']:.2f} ms (idle: {loop['worst_idle_gap_ms']:.2f} ms): "
            + ("met" if loop[f"goal_gaps_under_{GOAL_GAP_MS:g}ms"] else "MISSED")
            + f" (goal {GOAL_GAP_MS:g} ms)"
        )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """GB/s of offload and restore against request size, with their ceilings dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    rows = result["rows"]
    sizes = [r["bytes"] for r in rows]
    for kind, color in (("offload", "tab:blue"), ("restore", "tab:orange")):
        ax.plot(sizes, [r[f"{kind}_gbps"] for r in rows], marker="o", color=color, label=kind)
        ax.plot(
            sizes,
            [r[f"ceiling_{kind}_gbps"] for r in rows],
            linestyle="--",
            color=color,
            alpha=0.6,
            label=f"{kind} ceiling",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("request bytes")
    ax.set_ylabel("GB/s")
    cfg = result["config"]
    ax.set_title(f"offload and restore on {cfg['device']} ({cfg['page_kib']} KiB pages, interleaved)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
