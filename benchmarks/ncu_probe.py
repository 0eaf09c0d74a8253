"""Launches of the span copy for Nsight Compute (``ncu``) to read counters from, one per case and piece size.

Each case (a fragment size in KiB or a mix of ``benchmarks/span_copy.py``, in ``kvferry bench transfer``'s
layout over ``--total-mib``) is launched once per ``--pieces-kib`` x shape... with its table read
from pinned host memory, as a transport write does. The launches are printed in order (ncu's report lists the
kernels in the same order):

    ncu --clock-control none -k regex:copy_ --section SpeedOfLight \\
        python benchmarks/ncu_probe.py --cases 1024 16384 disagg11 --pieces-kib 1024 4096
"""

from __future__ import annotations

import argparse
import itertools

import torch
from span_copy import spans_of  # benchmarks/span_copy.py

from kvferry.kernels import span_copy

MiB = 1 << 20


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--cases", nargs="*", default=["1024", "64"])
    parser.add_argument("--pieces-kib", type=int, nargs="*", default=[span_copy.PIECE_BYTES >> 10])
    parser.add_argument("--shapes", nargs="*", default=[f"{span_copy.BLOCK_WORDS}x{span_copy.NUM_WARPS}"])
    parser.add_argument("--rotate", type=int, nargs="*", default=[span_copy.ROTATE])
    parser.add_argument("--streaming", type=int, nargs="*", default=[int(span_copy.STREAMING)])
    args = parser.parse_args()
    total = args.total_mib * MiB
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(2 * total, dtype=torch.uint8, device="cuda")
    launch = 0
    for case in args.cases:
        s, d, lengths = spans_of(case, "transfer", src, dst, seed=1)
        for piece_kib, shape, rotate, streaming in itertools.product(
            args.pieces_kib, args.shapes, args.rotate, args.streaming
        ):
            block_words, num_warps = (int(x) for x in shape.split("x"))
            keep: list[object] = []
            torch.cuda.synchronize()
            pieces = span_copy.copy_spans(
                src.device,
                s,
                d,
                lengths,
                keep=keep,
                piece_bytes=piece_kib << 10,
                block_words=block_words,
                num_warps=num_warps,
                rotate=rotate,
                streaming=bool(streaming),
            )
            torch.cuda.synchronize()
            print(
                f"launch {launch}: case {case}, {int(lengths.sum())} bytes, pieces of {piece_kib} KiB: {pieces}, "
                f"block {block_words} x {num_warps} warps, rotate {rotate}, streaming {streaming}"
            )
            launch += 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
