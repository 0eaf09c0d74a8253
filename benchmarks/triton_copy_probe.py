"""How fast a Triton copy kernel can be on this GPU: one contiguous 1 GiB copy, ``copy_`` against the simplest
Triton copies (no table, no spans), in the same run.

- ``flat``: one program per block of ``BLOCK`` words (a plain copy's shape), with default, ``evict_first``
  and ``.cg``/``.cs`` cache hints;
- ``loop``: one program per ``PER`` consecutive blocks;
- ``stride``: ``per_sm`` programs per multiprocessor, each looping over blocks ``pid, pid + G, ...``.

On the H200 (``benchmarks/results/triton_copy_probe_h200.json``) ``flat`` with 4 KiB blocks matched ``copy_``
(0.99-1.0); larger blocks, loops and persistent programs reached 0.84-0.93. The span copy's kernels, which
must look up each piece's addresses, reached 0.7-0.85 of ``copy_`` in ``benchmarks/span_copy.py``.

    python benchmarks/triton_copy_probe.py --json $OUT/triton_copy_probe_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from span_copy import timed


@triton.jit  # type: ignore[untyped-decorator,misc]
def copy_flat(src, dst, BLOCK: tl.constexpr, EVICT: tl.constexpr, MOD: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if MOD == 1:
        tl.store(dst + offs, tl.load(src + offs, cache_modifier=".cg"), cache_modifier=".cs")
    elif EVICT == 1:
        tl.store(
            dst + offs, tl.load(src + offs, eviction_policy="evict_first"), eviction_policy="evict_first"
        )
    else:
        tl.store(dst + offs, tl.load(src + offs))


@triton.jit  # type: ignore[untyped-decorator,misc]
def copy_loop(src, dst, BLOCK: tl.constexpr, PER: tl.constexpr):  # type: ignore[no-untyped-def]
    first = tl.program_id(0).to(tl.int64) * PER
    for i in range(PER):
        offs = (first + i) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))


@triton.jit  # type: ignore[untyped-decorator,misc]
def copy_stride(src, dst, n_blocks, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    for b in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        offs = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    n = args.mib << 20
    src8 = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst8 = torch.zeros(n, dtype=torch.uint8, device="cuda")
    src, dst = src8.view(torch.int64), dst8.view(torch.int64)
    words = n // 8
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    runs: list[tuple[str, str, Callable[[], Any]]] = [("copy_", "", lambda: dst8.copy_(src8))]
    for block, warps, evict, mod in (
        (b, w, e, m) for b in (512, 1024, 2048, 4096) for w in (4, 8) for e, m in ((0, 0), (1, 0), (0, 1))
    ):
        runs.append(
            (
                "flat",
                f"block {block} warps {warps} evict_first {evict} cg/cs {mod}",
                lambda b=block, w=warps, e=evict, m=mod: copy_flat[(words // b,)](
                    src, dst, BLOCK=b, EVICT=e, MOD=m, num_warps=w
                ),
            )
        )
    for block, per, warps in ((b, p, w) for b in (1024, 2048) for p in (4, 16, 64) for w in (4, 8)):
        runs.append(
            (
                "loop",
                f"block {block} per {per} warps {warps}",
                lambda b=block, p=per, w=warps: copy_loop[(words // b // p,)](
                    src, dst, BLOCK=b, PER=p, num_warps=w
                ),
            )
        )
    for block, per_sm, warps in ((b, s, w) for b in (1024, 2048) for s in (2, 4, 8, 16, 32) for w in (4, 8)):
        runs.append(
            (
                "stride",
                f"block {block} per_sm {per_sm} warps {warps}",
                lambda b=block, s=per_sm, w=warps: copy_stride[(sms * s,)](
                    src, dst, words // b, BLOCK=b, num_warps=w
                ),
            )
        )
    rows = []
    ceiling = 0.0
    for kind, config, fn in runs:
        seconds = timed(fn, args.repeat)[1]  # device time
        ceiling = ceiling or seconds
        rows.append({"kind": kind, "config": config, "seconds": seconds, "gbps": n / seconds / 1e9})
        rows[-1]["ratio"] = ceiling / seconds
        print(
            f"{kind:>7} {config:<40} {seconds * 1e6:8.1f} us {n / seconds / 1e9:7.0f} GB/s {ceiling / seconds:.3f}"
        )
    assert torch.equal(src8, dst8), "a probe kernel misplaced bytes"
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "bytes": n, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
