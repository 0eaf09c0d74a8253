"""Whether the GPU's clocks explain the span copy's ratio to ``copy_``: the SM clock (NVML, through nvidia-smi)
sampled while the span copy and ``copy_`` of 1 GiB in 1 MiB spans (both sides in order) are timed, once from
idle and once right after a second of sustained load. (The answer was no; the gap it chased was mostly the host's
table building and launch, which CUDA events around one call count as device time:
``benchmarks/grid_kernel_probe.py``.)

    python benchmarks/clock_probe.py --json $OUT/clock_probe_h200.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from span_copy import timed

from kvferry.kernels import span_copy


def sm_clock() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=False,
    )
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    total, span = 1 << 30, 1 << 20
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    offsets = np.arange(total // span, dtype=np.int64) * span
    lengths = np.full(len(offsets), span, dtype=np.int64)
    s_addr, d_addr = src.data_ptr() + offsets, dst.data_ptr() + offsets
    a = torch.randn(8192, 8192, device="cuda")
    rows: list[dict[str, Any]] = []
    kinds = {
        "copy_": lambda: dst.copy_(src),
        "grid": lambda: span_copy.copy_spans(src.device, s_addr, d_addr, lengths, grid=True),
        "pieces": lambda: span_copy.copy_spans(src.device, s_addr, d_addr, lengths, grid=False),
    }
    for phase in ("idle", "loaded", "idle", "loaded"):
        if phase == "loaded":
            end = time.perf_counter() + 1.0
            while time.perf_counter() < end:
                a @ a
            torch.cuda.synchronize()
        else:
            time.sleep(2.0)
        for kind, fn in kinds.items():
            before = sm_clock()
            wall, device = timed(fn, args.repeat)
            rows.append(
                {
                    "phase": phase,
                    "kind": kind,
                    "device_s": device,
                    "wall_s": wall,
                    "sm_mhz_before": before,
                    "sm_mhz_after": sm_clock(),
                }
            )
            print(rows[-1], flush=True)
    assert torch.equal(src, dst)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
