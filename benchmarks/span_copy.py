"""Scattered device copies in one process (CUDA): the batched span copy against ``copy_`` of the same bytes,
the ceiling, timed again right after every row (the kernels' times drift between rounds where ``copy_``'s do
not).

Each case (a fragment size in KiB over ``--total-mib``, or a mix of fragment lengths taken from one
disaggregated request's writer, :data:`MIXES`) is copied in each layout:

- ``transfer``: the source in order, the destination's runs permuted (what ``kvferry bench transfer`` writes);
- ``scattered``: both sides permuted, the destination over twice the bytes;
- ``contiguous``: both sides in order, one ``copy_``'s bytes cut into spans.

``--api spans`` times :func:`kvferry.kernels.span_copy.copy_spans` with every combination of the options given
(``--pieces-kib``, ``--shapes``, ``--programs-per-sm``, ``--streaming``, ``--rotate``, ``--grid``: the library's
defaults come from such a sweep; a row's ``launch`` says which form ran); ``--api fragments`` times
``copy_fragments`` over the same spans as a transport's paired rows (what the transports' CUDA writes launch).
Every setting's bytes are checked before it is timed.

Each row is the median over ``--repeat`` timed calls (``_spread``: their ``[min, max]``). Wall time includes
building and uploading the table and waiting for the stream (what a transport write pays); device time comes
from CUDA events around the call, which also counts the host's building, uploading and launching while the
device waits. ``--burst N`` puts N calls between the events (time per call = elapsed / N): the host's work
for the next calls overlaps the kernels already queued, so from about 5 on the kernels' own time dominates. ``--ncu`` launches each case and setting once, untimed, and prints the launches
in order for Nsight Compute to read counters from (``copy_spans``'s table read from pinned host memory, as
in a transport write)::

    python benchmarks/span_copy.py [--cases 1024 disagg11] [--layouts transfer] [--api spans fragments]
        [--burst 5] [--repeat 3] [--json benchmarks/results/<machine>/span_copy.json]
    ncu --clock-control none -k regex:copy_ --section SpeedOfLight python benchmarks/span_copy.py --ncu \\
        --cases 1024 16384 disagg11 --pieces-kib 256 4096
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from _provenance import median_spread, write_result

from kvferry.kernels import span_copy

MiB = 1 << 20

MIXES = {
    # the fragment lengths of one disaggregated request's writer (nemotron-h-8b, 8K tokens; see
    # benchmarks/disagg_2p.py): same TP (1-1) and mismatched TP (1-2), one large state run among pages
    "disagg11": [(256 << 10, 128), (512 << 10, 256), (1 * MiB, 1), (96 * MiB, 1)],
    "disagg12": [(2 << 10, 48), (16 << 10, 24), (32 << 10, 2048), (64 << 10, 256), (2 * MiB, 24)],
}


def timed(fn: Callable[[], Any], repeat: int, burst: int = 1) -> tuple[list[float], list[float]]:
    """Wall seconds (calls + synchronize) and device seconds (CUDA events) per call, ``repeat`` times after
    one warm-up, each over ``burst`` calls between the events. What ``fn`` returns is held until its copies
    ran (the tables a call asked its caller to keep)."""
    fn()
    torch.cuda.synchronize()
    walls, devices = [], []
    for _ in range(repeat):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        began = time.perf_counter()
        start.record()
        held = [fn() for _ in range(burst)]
        end.record()
        end.synchronize()
        walls.append((time.perf_counter() - began) / burst)
        devices.append(start.elapsed_time(end) / 1e3 / burst)
        del held
    return walls, devices


def spans_of(case: str, layout: str, src: torch.Tensor, dst: torch.Tensor, seed: int) -> tuple[Any, ...]:
    """Source addresses, destination addresses and lengths of ``case`` (a fragment size in KiB or a mix) in
    ``layout`` (see the module's docstring)."""
    rng = np.random.default_rng(seed)
    if case in MIXES:
        lengths = np.concatenate([np.full(n, size, dtype=np.int64) for size, n in MIXES[case]])
        if int(lengths.sum()) > src.numel():
            raise SystemExit(
                f"span_copy.py: error: the {case} mix moves {int(lengths.sum()) >> 20} MiB, more than "
                f"--total-mib {src.numel() >> 20}"
            )
    else:
        fragment = int(case) << 10
        lengths = np.full(src.numel() // fragment, fragment, dtype=np.int64)
    n = len(lengths)
    lengths = lengths[rng.permutation(n)]

    def packed(order: Any, lens: Any, gaps: Any) -> Any:
        offsets = np.zeros(n, dtype=np.int64)
        ordered = lens[order] + gaps
        offsets[order] = np.cumsum(ordered) - ordered
        return offsets

    none = np.zeros(n, dtype=np.int64)
    if layout == "contiguous":
        s_off = d_off = packed(np.arange(n), lengths, none)
    elif layout == "transfer":
        s_off = packed(np.arange(n), lengths, none)
        d_off = packed(rng.permutation(n), lengths, none)
    else:
        s_off = packed(rng.permutation(n), lengths, none)
        gaps = lengths * rng.integers(0, 2, n)  # about twice the bytes
        d_off = packed(rng.permutation(n), lengths, gaps)
    assert int((s_off + lengths).max()) <= src.numel() and int((d_off + lengths).max()) <= dst.numel()
    return src.data_ptr() + s_off, dst.data_ptr() + d_off, lengths


def settings(args: Any) -> list[dict[str, Any]]:
    """Every combination of the options given (``--api spans``), or the one way ``--api fragments`` runs."""
    out: list[dict[str, Any]] = []
    if "spans" in args.api:
        out += [
            {
                "api": "spans",
                "piece_bytes": piece << 10,
                "block_words": int(shape.split("x")[0]),
                "num_warps": int(shape.split("x")[1]),
                "programs_per_sm": per_sm,
                "streaming": bool(stream),
                "rotate": rotate,
                "grid": bool(form),
            }
            for piece, shape, per_sm, stream, rotate, form in itertools.product(
                args.pieces_kib, args.shapes, args.programs_per_sm, args.streaming, args.rotate, args.grid
            )
            if not (form and (per_sm or stream))  # the grid form has one program per block and no cache hints
        ]
    if "fragments" in args.api:
        out.append({"api": "fragments"})
    return out


def launcher(
    device: torch.device, spans: tuple[Any, ...], options: dict[str, Any], pinned: bool
) -> Callable[[], Any]:
    """One call of the library for ``spans`` with ``options``; returns what must be held until it ran.

    ``pinned``: ``copy_spans`` gets a ``keep`` list, so that its table goes through pinned host memory as in
    a transport write (the loop form reads it there); without, it is uploaded from torch's host allocator.
    ``copy_fragments`` always keeps its rows."""
    s_addr, d_addr, lengths = spans
    if options["api"] == "fragments":
        src = np.stack([s_addr, lengths], axis=1).astype(np.uint64)
        dst = np.stack([d_addr, lengths], axis=1).astype(np.uint64)
        longest, total = int(lengths.max()), int(lengths.sum())

        def fragments() -> Any:
            keep: list[Any] = []
            if span_copy.copy_fragments(device, src, dst, keep=keep, longest=longest, total=total) is None:
                raise RuntimeError("copy_fragments could not launch")
            return keep

        return fragments
    kwargs = {k: v for k, v in options.items() if k != "api"}

    def spans_call() -> Any:
        keep: list[Any] | None = [] if pinned else None
        if span_copy.copy_spans(device, s_addr, d_addr, lengths, keep=keep, **kwargs) is None:
            raise RuntimeError("copy_spans could not launch")
        return keep

    return spans_call


def launch_form(spans: tuple[Any, ...], options: dict[str, Any]) -> Any:
    """Which form of the kernel ``options`` launch: the grid's shape, ``"pieces"`` or ``"fragment rows"``."""
    if options["api"] == "fragments":
        return "fragment rows"
    s_addr, d_addr, lengths = spans
    table = span_copy.piece_table(s_addr, d_addr, lengths, options["piece_bytes"])
    grid = options["grid"] and span_copy.grid_of(
        len(table.table), table.longest, table.total, options["block_words"] * table.word
    )
    return list(grid) if grid else "pieces"


def check(src: torch.Tensor, dst: torch.Tensor, spans: tuple[Any, ...], seed: int, what: Any) -> None:
    """Eight random spans landed where they should."""
    s_addr, d_addr, lengths = spans
    for i in np.random.default_rng(seed).integers(0, len(lengths), 8).tolist():
        a, b, k = int(s_addr[i] - src.data_ptr()), int(d_addr[i] - dst.data_ptr()), int(lengths[i])
        assert torch.equal(src[a : a + k], dst[b : b + k]), f"span copy misplaced bytes: {what}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument(
        "--cases",
        nargs="*",
        default=["64", "256", "1024", "4096", "16384", "disagg11", "disagg12"],
        help="fragment sizes in KiB, or mixes: " + ", ".join(MIXES),
    )
    parser.add_argument("--layouts", nargs="*", default=["transfer", "scattered"])
    parser.add_argument("--api", nargs="*", default=["spans"], choices=["spans", "fragments"])
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per row (median and spread)")
    parser.add_argument("--burst", type=int, default=1, help="calls between the CUDA events (5: kernel time)")
    parser.add_argument("--pieces-kib", type=int, nargs="*", default=[span_copy.PIECE_BYTES >> 10])
    parser.add_argument(
        "--shapes",
        nargs="*",
        default=[f"{span_copy.BLOCK_WORDS}x{span_copy.NUM_WARPS}"],
        help="words x warps",
    )
    parser.add_argument("--programs-per-sm", type=int, nargs="*", default=[span_copy.PROGRAMS_PER_SM])
    parser.add_argument("--streaming", type=int, nargs="*", default=[int(span_copy.STREAMING)])
    parser.add_argument("--rotate", type=int, nargs="*", default=[span_copy.ROTATE])
    parser.add_argument(
        "--grid",
        type=int,
        nargs="*",
        default=[0, 1],
        help="0: one program per piece, 1: the grid form (one per block of a shape) where the pieces allow it",
    )
    parser.add_argument(
        "--ncu", action="store_true", help="launch each case once, untimed (for Nsight Compute)"
    )
    parser.add_argument("--json", default=None, help="write the stamped result here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("span_copy.py: error: needs CUDA (torch sees no GPU)", file=sys.stderr)
        return 2
    if args.repeat < 1 or args.burst < 1:
        parser.error("--repeat and --burst must be at least 1")
    total = args.total_mib * MiB
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(2 * total, dtype=torch.uint8, device="cuda")
    rows: list[dict[str, Any]] = []
    launches = 0

    def ceiling_of(nbytes: int) -> tuple[list[float], list[float]]:
        # timed again for every row, right after it: a ceiling from the start of the run would not see what
        # the GPU's clocks did since
        return timed(lambda: dst[:nbytes].copy_(src[:nbytes]), args.repeat, args.burst)

    for layout in args.layouts:
        for seed, case in enumerate(args.cases):
            spans = spans_of(case, layout, src, dst, seed)
            nbytes, n = int(spans[2].sum()), len(spans[2])
            for options in settings(args):
                call = launcher(src.device, spans, options, pinned=args.ncu)
                dst.zero_()
                held = call()
                torch.cuda.synchronize()
                del held
                check(src, dst, spans, seed, options)
                if args.ncu:
                    print(
                        f"launch {launches}: case {case}, layout {layout}, {nbytes} bytes, {options}",
                        flush=True,
                    )
                    launches += 1
                    continue
                walls, devices = timed(call, args.repeat, args.burst)
                copy_walls, copy_devices = ceiling_of(nbytes)
                wall, wall_spread = median_spread(walls)
                dev, dev_spread = median_spread(devices)
                copy_wall, copy_dev = median_spread(copy_walls)[0], median_spread(copy_devices)[0]
                row = {
                    "case": case,
                    "layout": layout,
                    "fragments": n,
                    "bytes": nbytes,
                    **options,
                    "launch": launch_form(spans, options),
                    "wall_s": wall,
                    "wall_s_spread": wall_spread,
                    "device_s": dev,
                    "device_s_spread": dev_spread,
                    "device_gbps": nbytes / dev / 1e9,
                    "copy_wall_s": copy_wall,
                    "copy_device_s": copy_dev,
                    "ratio_wall": copy_wall / wall,
                    "ratio_device": copy_dev / dev,
                    # the ratio at either end of the call's spread, against the ceiling's median
                    "ratio_device_spread": [copy_dev / dev_spread[1], copy_dev / dev_spread[0]],
                }
                rows.append(row)
                print(
                    f"{options['api']:>9} {case:>9} {layout:>10}: wall {wall * 1e3:.3f} ms ({row['ratio_wall']:.2f}), "
                    f"device {dev * 1e3:.3f} ms ({row['ratio_device']:.2f} of copy_), {options}",
                    flush=True,
                )
    if args.ncu:
        return 0
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["case"], r["layout"])
        if key not in best or r["device_s"] < best[key]["device_s"]:
            best[key] = r
    for (case, layout), r in best.items():
        options = {k: r[k] for k in ("api", "piece_bytes", "block_words", "num_warps", "grid") if k in r}
        print(f"best {case} {layout}: {options}: {r['ratio_device']:.2f} of copy_ (device)")
    config = {
        "total_bytes": total,
        "cases": args.cases,
        "layouts": args.layouts,
        "api": args.api,
        "repeat": args.repeat,
        "burst": args.burst,
        "defaults": {k: getattr(span_copy, k.upper()) for k in ("piece_bytes", "block_words", "num_warps")},
        "statistic": "median seconds per call over --repeat timed calls ([min, max] in _spread); ratio: the "
        "median of copy_ of the same bytes, timed right after the row, over the row's",
        "ceiling": "copy_ of the same number of contiguous bytes on the same device",
    }
    if args.json:
        write_result(args.json, "span_copy", {"config": config, "results": rows}, "cuda")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
