"""Where the host time of one CUDA write goes: each stage of the copy path timed on its own (one process).

The stages are those a ``nixl`` write by CUDA IPC (and a ``local`` write on CUDA) runs, on the bench layout: one
fragment per 64 KiB page, pages in runs of ``--fragment-kib`` that are contiguous on both sides, runs permuted.
Printed in microseconds (median of ``--repeat``), next to one ``copy_`` of the same bytes.

    python benchmarks/write_overhead.py
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
from kvferry.transports._memory import CopyPlan, RegionTable, region_infos
from kvferry.transports.base import as_fragments, check_pairing, coalesce, page_fragments

MiB = 1 << 20


def median_us(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times) * 1e6


def stages(
    src: torch.Tensor,
    dst: torch.Tensor,
    own: RegionTable,
    peer: RegionTable,
    kib: int,
    page: int,
    repeat: int,
) -> dict[str, Any]:
    """Each stage of one write of runs of ``kib`` KiB, in microseconds."""
    total = src.numel()
    per = (kib << 10) // page
    runs = total // (kib << 10)
    order = np.random.default_rng(kib).permutation(runs)
    src_f = page_fragments(src.data_ptr(), page, np.arange(total // page))
    dst_f = page_fragments(dst.data_ptr(), page, (order[:, None] * per + np.arange(per)).reshape(-1))
    merged_s, merged_d = coalesce(src_f, dst_f)
    s_index = own.locate(merged_s, "s")
    d_index = peer.locate(merged_d, "d")
    plan = CopyPlan(merged_s, own, merged_d, peer, src_index=s_index, dst_index=d_index)
    rows = np.arange(len(merged_s))
    table = span_copy.piece_table(merged_s[:, 0], merged_d[:, 0], merged_s[:, 1])[0]

    def launch() -> None:
        span_copy.copy_spans(src.device, merged_s[:, 0], merged_d[:, 0], merged_s[:, 1])

    def launch_sync() -> None:
        launch()
        torch.cuda.synchronize()

    def device_rows_sync() -> None:
        plan._device_rows(rows)
        torch.cuda.synchronize()

    timed: dict[str, Callable[[], Any]] = {
        "as_fragments x2": lambda: (as_fragments(src_f), as_fragments(dst_f)),
        "check_pairing": lambda: check_pairing(src_f, dst_f),
        "coalesce": lambda: coalesce(src_f, dst_f),
        "locate merged x2": lambda: (own.locate(merged_s, "s"), peer.locate(merged_d, "d")),
        "CopyPlan()": lambda: CopyPlan(merged_s, own, merged_d, peer, src_index=s_index, dst_index=d_index),
        "piece_table": lambda: span_copy.piece_table(merged_s[:, 0], merged_d[:, 0], merged_s[:, 1]),
        "table upload": lambda: torch.from_numpy(table).to(src.device, non_blocking=True),
        "copy_spans (queue only)": launch,
        "copy_spans + synchronize": launch_sync,
        "_device_rows + synchronize": device_rows_sync,
    }
    row: dict[str, Any] = {"fragment_kib": kib, "fragments_in": len(src_f), "merged": len(merged_s)}
    for name, fn in timed.items():
        row[name] = median_us(fn, repeat)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--fragment-kib", type=int, nargs="*", default=[1024, 16384])
    parser.add_argument("--repeat", type=int, default=21)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    total, page = args.total_mib * MiB, 64 << 10
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(total, dtype=torch.uint8, device="cuda")
    own, peer = RegionTable(region_infos([src])), RegionTable(region_infos([dst]))
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "rows": []}

    def sync_copy() -> None:
        dst.copy_(src)
        torch.cuda.synchronize()

    copy_us = median_us(sync_copy, args.repeat)
    print(f"copy_ of {args.total_mib} MiB + synchronize: {copy_us:.0f} us")
    for kib in args.fragment_kib:
        row = stages(src, dst, own, peer, kib, page, args.repeat)
        row["copy_ + synchronize"] = copy_us
        out["rows"].append(row)
        print(json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
