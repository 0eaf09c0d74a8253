"""Scattered device copies in one process (CUDA): the batched span copy against ``copy_`` of the same bytes.

Each case (a fragment size in KiB over ``--total-mib``, or a mix of fragment lengths taken from one
disaggregated request's writer, see :data:`MIXES`) is copied in each layout (``transfer``: the source in order
and the destination's runs permuted, as ``kvferry bench transfer`` writes; ``scattered``: both sides permuted,
the destination over twice the bytes; ``contiguous``: both sides in order, one ``copy_``'s bytes cut into spans)
and timed against one contiguous ``copy_`` of the same number of bytes, timed again right after each row (the
kernels' times drift between rounds where ``copy_``'s do not). ``--grid 0 1`` tries the loop form (a program per
piece) and the grid form (a program per block, where the pieces allow it; the row's ``launch`` says which ran).
The batched copy is tried with every combination of the options given, so the defaults of
:mod:`kvferry.kernels.span_copy` come from a measurement; each setting's bytes are checked before it is timed. Wall
time includes building and uploading the piece table and waiting for the stream (what a transport write pays);
device time is from CUDA events around the call, so it also counts what the host spends building, uploading
and launching while the device waits (the kernel alone, five launches between the events:
``benchmarks/grid_kernel_probe.py --library --burst 5``).

    python benchmarks/span_copy.py --json benchmarks/results/span_copy_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvferry.kernels import span_copy

MiB = 1 << 20


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """Median wall seconds (call + synchronize) and median device seconds (events), after one warm-up."""
    fn()
    torch.cuda.synchronize()
    walls, devices = [], []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began = time.perf_counter()
        start.record()
        fn()
        end.record()
        end.synchronize()
        walls.append(time.perf_counter() - began)
        devices.append(start.elapsed_time(end) / 1e3)
    return statistics.median(walls), statistics.median(devices)


MIXES = {
    # the fragment lengths of one disaggregated request's writer (nemotron-h-8b, 8K tokens; see
    # benchmarks/disagg_2p.py): same TP (1-1) and mismatched TP (1-2), one large state run among pages
    "disagg11": [(256 << 10, 128), (512 << 10, 256), (1 * MiB, 1), (96 * MiB, 1)],
    "disagg12": [(2 << 10, 48), (16 << 10, 24), (32 << 10, 2048), (64 << 10, 256), (2 * MiB, 24)],
}


def spans_of(case: str, layout: str, src: torch.Tensor, dst: torch.Tensor, seed: int) -> tuple[Any, ...]:
    """Source addresses, destination addresses and lengths of ``case`` (a fragment size in KiB or a mix).

    ``transfer``: the source in order, the destination runs permuted (``kvferry bench transfer``'s layout);
    ``scattered``: the source runs permuted and the destination runs permuted over twice the bytes."""
    rng = np.random.default_rng(seed)
    if case in MIXES:
        lengths = np.concatenate([np.full(n, size, dtype=np.int64) for size, n in MIXES[case]])
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
    if layout == "contiguous":  # both sides in order: one copy_'s bytes, cut into spans
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
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--pieces-kib", type=int, nargs="*", default=[4096])
    parser.add_argument("--shapes", nargs="*", default=["2048x8"], help="block words x warps")
    parser.add_argument("--programs-per-sm", type=int, nargs="*", default=[0])
    parser.add_argument("--streaming", type=int, nargs="*", default=[0])
    parser.add_argument("--rotate", type=int, nargs="*", default=[7])
    parser.add_argument(
        "--grid",
        type=int,
        nargs="*",
        default=[0, 1],
        help="0: one program per piece, 1: the grid form (one per block of a shape) where the pieces allow it",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    total = args.total_mib * MiB
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(2 * total, dtype=torch.uint8, device="cuda")
    rows: list[dict[str, Any]] = []

    def ceiling_of(nbytes: int) -> tuple[float, float]:
        # timed again for every row, right after it: a ceiling from the start of the run would not see what
        # the GPU's clocks did since
        ceiling = timed(lambda: dst[:nbytes].copy_(src[:nbytes]), args.repeat)
        rows.append({"kind": "copy_", "bytes": nbytes, "wall_s": ceiling[0], "device_s": ceiling[1]})
        return ceiling

    def row(
        kind: str, case: str, layout: str, nbytes: int, n: int, wall: float, dev: float, **extra: Any
    ) -> None:
        ceiling = ceiling_of(nbytes)
        rows.append(
            {
                "kind": kind,
                "case": case,
                "layout": layout,
                "fragments": n,
                "bytes": nbytes,
                "wall_s": wall,
                "device_s": dev,
                "device_gbps": nbytes / dev / 1e9,
                "ratio_wall": ceiling[0] / wall,
                "ratio_device": ceiling[1] / dev,
                **extra,
            }
        )
        print(
            f"{kind:>6} {case:>9} {layout:>9} {extra or ''}: wall {wall * 1e3:.3f} ms "
            f"({ceiling[0] / wall:.2f}), device {dev * 1e3:.3f} ms ({ceiling[1] / dev:.2f})",
            flush=True,
        )

    grid = [
        {
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
    for layout in args.layouts:
        for seed, case in enumerate(args.cases):
            s_addr, d_addr, lengths = spans_of(case, layout, src, dst, seed)
            nbytes, n = int(lengths.sum()), len(lengths)
            for options in grid:
                # the bytes land where they should (checked once per case and setting, before it is timed)
                dst.zero_()
                span_copy.copy_spans(src.device, s_addr, d_addr, lengths, **options)
                torch.cuda.synchronize()
                for i in np.random.default_rng(seed).integers(0, n, 8).tolist():
                    a = int(s_addr[i] - src.data_ptr())
                    b = int(d_addr[i] - dst.data_ptr())
                    k = int(lengths[i])
                    assert torch.equal(src[a : a + k], dst[b : b + k]), (
                        f"span copy misplaced bytes: {options}"
                    )

                def batched(
                    options: dict[str, Any] = options, spans: Any = (s_addr, d_addr, lengths)
                ) -> None:
                    span_copy.copy_spans(src.device, *spans, **options)

                pieces = span_copy.copy_spans(src.device, s_addr, d_addr, lengths, **options)
                table = span_copy.piece_table(s_addr, d_addr, lengths, options["piece_bytes"])
                launch = options["grid"] and span_copy.grid_of(
                    len(table.table), table.longest, table.total, options["block_words"] * table.word
                )
                row(
                    "spans",
                    case,
                    layout,
                    nbytes,
                    n,
                    *timed(batched, args.repeat),
                    pieces=pieces,
                    launch=list(launch) if launch else "pieces",
                    **options,
                )
    keys = ("piece_bytes", "block_words", "num_warps", "programs_per_sm", "streaming", "rotate", "grid")
    best: dict[tuple[str, str], dict[str, Any]] = {}
    settings: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        if r["kind"] != "spans":
            continue
        key = (r["case"], r["layout"])
        if key not in best or r["device_s"] < best[key]["device_s"]:
            best[key] = r
        settings.setdefault(tuple(r.get(k) for k in keys), []).append(r["ratio_device"])
    for (case, layout), r in best.items():
        print(f"best {case} {layout}: {[r.get(k) for k in keys]}: {r['ratio_device']:.2f} device")
    # the settings best over every case (the library's defaults should be one of them)
    for key, ratios in sorted(settings.items(), key=lambda kv: -min(kv[1]))[:12]:
        print(
            "overall",
            key,
            "min",
            round(min(ratios), 3),
            "mean",
            round(sum(ratios) / len(ratios), 3),
            [round(x, 2) for x in ratios],
        )
    out = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "repeat": args.repeat,
        "defaults": {
            k: getattr(span_copy, k.upper(), None) for k in ("piece_bytes", "block_words", "num_warps")
        },
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
