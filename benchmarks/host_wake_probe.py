"""Does host work cost more right after the thread slept? One call of each operation, timed three ways:

- ``hot``: back to back (what a micro-benchmark loop measures);
- ``after_sleep``: right after ``time.sleep(--idle-us)`` (what a writer pays after waiting for a request: the
  event loop sleeps in epoll between messages);
- ``after_spin``: right after spinning for the same time (the thread stayed on its core).

Operations: numpy (the span copy's piece table for 1024 rows, a search over 1024 ranges), and with CUDA a pinned
upload of a 24 KiB table and a tiny kernel launch. On the H200's host a write's stages cost 2-10x their
micro-benchmark times (``benchmarks/results/latency_1g_1024_h200.json``); if ``after_sleep`` is much above
``after_spin``, waking up is the cost, not the code.

    python benchmarks/host_wake_probe.py --json $OUT/host_wake_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvferry.kernels import span_copy


def timed_once(fn: Callable[[], Any]) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--idle-us", type=float, nargs="*", default=[100.0, 1000.0, 10000.0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n, fragment = 1024, 1 << 20
    src = (1 << 40) + np.arange(n, dtype=np.int64) * fragment
    dst = (1 << 41) + rng.permutation(n).astype(np.int64) * fragment
    lengths = np.full(n, fragment, dtype=np.int64)
    starts = np.sort(rng.integers(0, 1 << 40, n))
    ops: dict[str, Callable[[], Any]] = {
        "piece_table 1024 rows": lambda: span_copy.piece_table(src, dst, lengths),
        "searchsorted 1024 in 1024": lambda: np.searchsorted(starts, dst, side="right"),
    }
    if torch.cuda.is_available():
        table = span_copy.piece_table(src, dst, lengths)[0]
        x = torch.zeros(16, device="cuda")

        def upload() -> None:
            host = torch.empty(table.shape, dtype=torch.int64, pin_memory=True)
            host.numpy()[...] = table
            host.to("cuda", non_blocking=True)

        ops["pinned upload 24 KiB"] = upload
        ops["tiny kernel launch"] = lambda: x.add_(1)
    out: dict[str, Any] = {"cpu_count": __import__("os").cpu_count(), "ops": {}}
    for name, fn in ops.items():
        for _ in range(20):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        row: dict[str, float] = {
            "hot_us": 1e6 * statistics.median(timed_once(fn) for _ in range(args.repeat))
        }
        for idle in args.idle_us:
            slept, spun = [], []
            for _ in range(args.repeat):
                time.sleep(idle * 1e-6)
                slept.append(timed_once(fn))
                spin(idle * 1e-6)
                spun.append(timed_once(fn))
            row[f"after_sleep_{idle:g}us_us"] = 1e6 * statistics.median(slept)
            row[f"after_spin_{idle:g}us_us"] = 1e6 * statistics.median(spun)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out["ops"][name] = row
        print(name, {k: round(v, 1) for k, v in row.items()}, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
