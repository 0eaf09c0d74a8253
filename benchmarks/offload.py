"""Offload of a suspended request's cache to the host and its restore, GB/s per request size against one
contiguous copy of the same bytes in the same run (the ceiling), and the event loop's longest gap while a 1 GiB
request moves through the async path: ``kvferry bench offload``, stamped.

Per size (``--sizes``, default 64 KiB to 1 GiB in powers of 4): a request of about that many bytes (pages,
draft pages, state slot, replay row, ``num_accepted``; no two of its pages neighbours) moved through the two
phases (start, the copy, finish) ``--repeat`` times, and right before each move the ceiling: one contiguous
copy of the same bytes between device (CUDA) or host (CPU) memory and pinned (CUDA) or preallocated (CPU) host
memory. Per row: ``offload_gbps``, ``offload_ratio`` (the ceiling's seconds over the move's, per run),
``offload_copy_ratio`` (the copy alone) and the same for ``restore``: the median over the runs, ``_spread`` their
``[min, max]``. ``loop``: the longest gap and the 99th percentile between 1 ms ticks of a ticker task while the
request of ``--loop-bytes`` (Nemotron-H-8B, TP 1) is offloaded and restored by ``offload_request`` /
``restore_request``, and over as long idle right after. Goals: from 1 MiB 0.8 of the ceiling; no gap over 5 ms.
See :mod:`kvferry.tools.offload_bench`.

    python benchmarks/offload.py [--device cpu|cuda] [--sizes 64K 1M 1G] [--repeat 3] [--page-kib 64]
        [--loop-bytes 1G] [--json benchmarks/results/<machine>/offload.json] [--plot FILE.png]
"""

from __future__ import annotations

import argparse
import sys

from _provenance import write_result

from kvferry.commands import bench_offload
from kvferry.commands._common import say
from kvferry.commands.bench import check_output
from kvferry.tools.offload_bench import OffloadBenchConfig, plot, run_offload_bench, table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    bench_offload.add_arguments(parser, json_path=True)
    args = parser.parse_args()
    bench_offload.validate(args)
    check_output("--json", args.json)
    config = OffloadBenchConfig(
        device=args.device,
        sizes=tuple(args.sizes),
        repeat=args.repeat,
        page_kib=args.page_kib,
        loop_bytes=args.loop_bytes,
    )
    result = run_offload_bench(config, say)
    print(table(result))
    if args.json:
        body = {"config": result["config"], "results": result["rows"]}
        body.update((k, v) for k, v in result.items() if k not in ("config", "rows"))
        write_result(args.json, "offload", body, result["config"]["device"])
    if args.plot:
        plot(result, args.plot)
    return 0 if all(r["verified"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
