"""Host time of the steps of a CUDA span copy's launch, each timed on its own (medians and minima over
``--rounds`` rounds, microseconds; every round after a short sleep, as a write after waiting for its peer).

The steps: the piece table of 1 GiB in 1 MiB spans built in ordinary or pinned memory, a pinned block, a device
allocation, the stream query, the table upload, the whole ``copy_spans`` in the grid and loop forms, and numpy's
writes and reads of pinned against ordinary memory.

    python benchmarks/copy_host_costs.py --json $OUT/copy_host_costs_h200.json
"""

# every lambda below is called where it is made (B023 does not apply)
# ruff: noqa: B023
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    total, span = 1 << 30, 1 << 20
    count = total // span
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros_like(src)
    order = np.random.default_rng(0).permutation(count)
    s_addr = (src.data_ptr() + np.arange(count) * span).astype(np.uint64)
    d_addr = (dst.data_ptr() + order * span).astype(np.uint64)
    lengths = np.full(count, span, dtype=np.uint64)
    device = src.device
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        began = time.perf_counter()
        result = fn()
        times.setdefault(name, []).append((time.perf_counter() - began) * 1e6)
        return result

    pinned = span_copy._pinned_table(count)
    ordinary = np.empty((count, 3), dtype=np.int64)
    column = np.arange(count, dtype=np.int64)
    pinned_ids = span_copy.pinned_ids(2 * count)
    ordinary_ids = np.zeros(2 * count, dtype=np.int64)
    limits = np.full(2 * count, 1 << 20, dtype=np.uint64)
    for round_ in range(args.rounds):
        time.sleep(0.0005 if round_ % 2 else 0.002)
        keep: list[Any] = []
        held: list[Any] = []
        table = timed(
            "piece_table into pinned",
            lambda: span_copy.piece_table(s_addr, d_addr, lengths, table_of=span_copy._pinned_table),
        )
        timed("piece_table ordinary", lambda: span_copy.piece_table(s_addr, d_addr, lengths))
        timed("pinned block", lambda: span_copy._pinned_table(count))
        empty = timed(
            "torch.empty on the device", lambda: torch.empty((count, 3), dtype=torch.int64, device=device)
        )
        stream = timed("current stream", lambda: span_copy._current_stream(0))
        timed("on_device", lambda: span_copy._on_device(0))
        timed(
            "cuMemcpyHtoDAsync 24 KiB",
            lambda: span_copy._upload_async(
                empty.data_ptr(), table.table.ctypes.data, table.table.nbytes, stream
            ),
        )
        timed("_upload_held", lambda: span_copy._upload_held(table.table, 0, stream, held))
        timed(
            "copy_spans grid (keep)", lambda: span_copy.copy_spans(device, s_addr, d_addr, lengths, keep=keep)
        )
        timed(
            "copy_spans loop (keep)",
            lambda: span_copy.copy_spans(device, s_addr, d_addr, lengths, keep=keep, grid=False),
        )
        torch.cuda.synchronize()
        timed("pinned strided write", lambda: pinned.__setitem__((slice(None), 0), column))
        timed("ordinary strided write", lambda: ordinary.__setitem__((slice(None), 0), column))
        timed("pinned contiguous copy", lambda: pinned.__setitem__(Ellipsis, ordinary))
        timed("pinned read (less, all)", lambda: np.less(pinned_ids.view(np.uint64), limits).all())
        timed("ordinary read (less, all)", lambda: np.less(ordinary_ids.view(np.uint64), limits).all())
        timed(
            "concatenate into pinned",
            lambda: np.concatenate([ordinary_ids[:count], ordinary_ids[count:]], out=pinned_ids),
        )
    rows = {k: {"median_us": statistics.median(v), "min_us": min(v)} for k, v in times.items()}
    for name, row in rows.items():
        print(f"{name:28s} median {row['median_us']:7.1f}  min {row['min_us']:7.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rounds": args.rounds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
