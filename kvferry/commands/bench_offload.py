"""``kvferry bench offload``: offload and restore of a suspended request's cache, GB/s per request size against
a plain copy of the same bytes in the same run, and the event loop's longest wait while 1 GiB moves through the
async path; see :mod:`kvferry.tools.offload_bench` for what is measured and how.

Progress goes to stderr; stdout gets the table, or with ``--json`` one JSON object (``config``, ``rows`` with a
``*_ratio`` per move, ``loop``, ``goal_from_1MiB_reach_0.8_of_ceiling``). ``--device cuda`` needs a GPU (it
is refused in one line where torch sees none).

Exit status: 0 done, 1 a request's bytes differed after its moves, 2 bad arguments, 3 a typed runtime failure,
130 interrupted.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvferry.commands._common import byte_count, parse_bytes, positive_int, say, write_result
from kvferry.errors import ConfigError

__all__ = ["SIZES", "add_arguments", "run"]

#: the default request sizes, 64 KiB to 1 GiB in powers of 4 (:data:`kvferry.tools.offload_bench.SIZES`; not
#: imported from there: ``--help`` must not import torch)
SIZES = tuple(64 << (10 + 2 * i) for i in range(8))


def add_arguments(parser: argparse.ArgumentParser, *, json_path: bool = False) -> None:
    """The flags; with ``json_path`` (``benchmarks/offload.py``) ``--json PATH`` writes the stamped result there
    and there is no ``--output``."""
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the cache lives")
    parser.add_argument(
        "--sizes",
        type=byte_count,
        nargs="+",
        default=list(SIZES),
        metavar="BYTES",
        help="request sizes (default 64K to 1G in powers of 4)",
    )
    parser.add_argument(
        "--repeat",
        type=positive_int,
        default=3,
        help="timed runs per size (median and [min, max]; default 3)",
    )
    parser.add_argument(
        "--page-kib", type=positive_int, default=64, help="attention and draft page size in KiB (default 64)"
    )
    parser.add_argument(
        "--loop-bytes",
        type=parse_bytes,
        default=1 << 30,
        help="the request the event loop is watched over (default 1G; 0: not measured)",
    )
    if json_path:
        parser.add_argument("--json", metavar="PATH", help="write the stamped result here")
    else:
        parser.add_argument("--json", action="store_true", help="print the result as JSON")
        parser.add_argument("--output", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw GB/s against request size into this PNG")


def _check_memory(args: argparse.Namespace) -> None:
    """Refuse sizes that cannot be allocated: per request its arena (twice its bytes: the pages between its
    own), its host buffer and the ceiling's two buffers."""
    from kvferry.commands.bench import _available_memory

    largest = max([*args.sizes, args.loop_bytes])
    device_needs = 3 * largest if args.device == "cuda" else 0
    host_needs = 2 * largest if args.device == "cuda" else 5 * largest
    for where, needed in (("cuda", device_needs), ("cpu", host_needs)):
        available = _available_memory(where) if needed else None
        if available is not None and needed > available:
            raise ConfigError(
                f"a request of {largest >> 20} MiB needs about {needed >> 20} MiB of {where} memory "
                f"({available >> 20} MiB available): give smaller --sizes / --loop-bytes"
            )


def validate(args: argparse.Namespace) -> None:
    """Check everything that can be checked before the benchmark runs.

    :raises ~kvferry.errors.ConfigError: a device, a size or an output that cannot work
    :raises ~kvferry.errors.MissingExtraError: ``--plot`` without matplotlib
    """
    from kvferry.commands.bench import check_output, check_plot

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: CUDA is not available here (torch sees no GPU)")
    if args.page_kib > 1 << 20:
        raise ConfigError(f"--page-kib {args.page_kib}: pages of more than 1 GiB")
    check_output("--output", getattr(args, "output", None))
    check_plot(args.plot)
    _check_memory(args)


def run(args: argparse.Namespace) -> int:
    from kvferry._stdio import stdout_to_stderr
    from kvferry.tools.offload_bench import OffloadBenchConfig, run_offload_bench, table

    with stdout_to_stderr():
        validate(args)
        config = OffloadBenchConfig(
            device=args.device,
            sizes=tuple(args.sizes),
            repeat=args.repeat,
            page_kib=args.page_kib,
            loop_bytes=args.loop_bytes,
        )
        result = run_offload_bench(config, say)
    # the result first: a file that cannot be written after all (a full disk) must not lose the run
    print(json.dumps(result, indent=2) if args.json else table(result), flush=True)
    _write(args, result)
    failed = [r for r in result["rows"] if not r["verified"]]
    for r in failed:
        say(f"kvferry bench: the request of {r['bytes']} bytes differs after its offload and restore")
    return 1 if failed else 0


def _write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    def plotter() -> Any:
        from kvferry.tools.offload_bench import plot

        return plot

    write_result(result, args.output, args.plot, plotter)
