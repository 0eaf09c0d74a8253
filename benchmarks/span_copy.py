"""Scattered device copies in one process (CUDA): the batched span copy against ``copy_`` of the same bytes.

For each fragment size, ``--total-mib`` of fragments are copied from a shuffled order in one buffer to random
slots of another (twice the size), and timed against one contiguous ``copy_`` of the same bytes and a loop of
``copy_`` per fragment, in the same run. The batched copy is tried with several piece sizes, block sizes and
warp counts so the defaults of :mod:`kvferry.span_copy` come from a measurement. Wall time includes building
and uploading the piece table and waiting for the stream (what a transport write pays); device time is from CUDA
events around the launch.

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

from kvferry import span_copy

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--fragment-kib", type=int, nargs="*", default=[64, 256, 1024, 4096, 16384, 65536])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--pieces-kib", type=int, nargs="*", default=[256, 1024, 4096])
    parser.add_argument("--blocks", type=int, nargs="*", default=[1024, 2048])
    parser.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    parser.add_argument("--programs-per-sm", type=int, nargs="*", default=[0, 8])
    parser.add_argument("--streaming", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--rotate", type=int, nargs="*", default=[0, 1, 7])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    total = args.total_mib * MiB
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(2 * total, dtype=torch.uint8, device="cuda")
    rows: list[dict[str, Any]] = []

    def row(
        kind: str, fragment: int, wall: float, dev: float, ceiling: tuple[float, float], **extra: Any
    ) -> None:
        rows.append(
            {
                "kind": kind,
                "fragment_bytes": fragment,
                "bytes": total,
                "wall_s": wall,
                "device_s": dev,
                "wall_gbps": total / wall / 1e9,
                "ratio_wall": ceiling[0] / wall,
                "ratio_device": ceiling[1] / dev,
                **extra,
            }
        )
        print(
            f"{kind:>10} {fragment >> 10:>7} KiB {extra or ''}: wall {wall * 1e3:.3f} ms "
            f"({ceiling[0] / wall:.2f}), device {dev * 1e3:.3f} ms ({ceiling[1] / dev:.2f})",
            flush=True,
        )

    ceiling = timed(lambda: dst[:total].copy_(src), args.repeat)
    row("copy_", total, *ceiling, ceiling)
    for kib in args.fragment_kib:
        fragment = kib << 10
        n = total // fragment
        rng = np.random.default_rng(kib)
        s_addr = src.data_ptr() + rng.permutation(n).astype(np.int64) * fragment
        d_addr = dst.data_ptr() + np.sort(rng.permutation(2 * n)[:n]).astype(np.int64) * fragment
        d_addr = d_addr[rng.permutation(n)]
        lengths = np.full(n, fragment, dtype=np.int64)
        # the bytes land where they should (checked once per size)
        dst.zero_()
        span_copy.copy_spans(src.device, s_addr, d_addr, lengths)
        torch.cuda.synchronize()
        probe = rng.integers(0, n, 8)
        for i in probe.tolist():
            a, b = int(s_addr[i] - src.data_ptr()), int(d_addr[i] - dst.data_ptr())
            assert torch.equal(src[a : a + fragment], dst[b : b + fragment]), "span copy misplaced bytes"
        if n <= 4096:
            s_off = (s_addr - src.data_ptr()).tolist()
            d_off = (d_addr - dst.data_ptr()).tolist()

            def loop(s_off: list[int] = s_off, d_off: list[int] = d_off, fragment: int = fragment) -> None:
                for a, b in zip(s_off, d_off, strict=True):
                    dst[b : b + fragment].copy_(src[a : a + fragment])

            row("loop", fragment, *timed(loop, args.repeat), ceiling)
        grid = itertools.product(
            args.pieces_kib, args.blocks, args.warps, args.programs_per_sm, args.streaming, args.rotate
        )
        for piece, block, warps, per_sm, stream, rotate in grid:
            options = {
                "piece_bytes": piece << 10,
                "block_words": block,
                "num_warps": warps,
                "programs_per_sm": per_sm,
                "streaming": bool(stream),
                "rotate": rotate,
            }

            def batched(options: dict[str, Any] = options, spans: Any = (s_addr, d_addr, lengths)) -> None:
                span_copy.copy_spans(src.device, *spans, **options)

            row("spans", fragment, *timed(batched, args.repeat), ceiling, **options)
    keys = ("piece_bytes", "block_words", "num_warps", "programs_per_sm", "streaming", "rotate")
    best: dict[int, dict[str, Any]] = {}
    for r in rows:
        if r["kind"] == "spans" and (
            r["fragment_bytes"] not in best or r["device_s"] < best[r["fragment_bytes"]]["device_s"]
        ):
            best[r["fragment_bytes"]] = r
    for fragment, r in sorted(best.items()):
        print(f"best {fragment >> 10} KiB: {[r[k] for k in keys]}: {r['ratio_device']:.2f} device")
    # the settings best over every fragment size (the library's defaults should be one of them)
    settings: dict[tuple[Any, ...], list[float]] = {}
    for r in rows:
        if r["kind"] == "spans":
            settings.setdefault(tuple(r[k] for k in keys), []).append(r["ratio_device"])
    for key, ratios in sorted(settings.items(), key=lambda kv: -min(kv[1]))[:10]:
        print("overall", key, "min", round(min(ratios), 3), [round(x, 2) for x in ratios])
    out = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "repeat": args.repeat,
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
