"""``kvferry bench transfer``: transfer throughput between two processes against same-run ceilings."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["add_arguments", "run"]

MiB = 1 << 20


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    transfer = sub.add_parser("transfer", help="writes between two processes per transport and fragment size")
    transfer.add_argument("--transport", choices=["nixl", "ucx", "local", "all"], default="all")
    transfer.add_argument("--total-bytes", type=_size, default=64 * MiB, help="bytes per write (default 64M)")
    transfer.add_argument(
        "--fragment-bytes",
        type=_size,
        nargs="+",
        default=[4 << 10, 64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB],
        help="contiguous run sizes to measure",
    )
    transfer.add_argument(
        "--page-bytes", type=_size, default=64 << 10, help="one fragment per page passed to write"
    )
    transfer.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="memory at both ends")
    transfer.add_argument(
        "--processes", type=int, default=2, choices=[2], help="writer and receiver processes"
    )
    transfer.add_argument("--repeats", type=int, default=5, help="timed writes per point (median reported)")
    transfer.add_argument("--no-baselines", action="store_true", help="skip nixl-per-page and gloo")
    transfer.add_argument("--json", action="store_true", help="print the result as JSON")
    transfer.add_argument("--output", help="also write the JSON result to this file")
    transfer.add_argument("--plot", help="draw GB/s against fragment size into this PNG")


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"{'kind':<14}{'transport':<10}{'fragment':>10}{'page':>8}{'frags':>7}{'seconds':>10}{'GB/s':>8}{'vs contig':>10}{'vs memcpy':>10}"
    ]
    for r in result["rows"]:
        contiguous = r.get("ratio_contiguous")
        lines.append(
            f"{r['kind']:<14}{r['transport']:<10}{r['fragment_bytes'] >> 10:>9}K{r['page_bytes'] >> 10:>7}K{r['fragments']:>7}"
            f"{r['seconds']:>10.4f}{r['gbps']:>8.2f}{'-' if contiguous is None else f'{contiguous:.2f}':>10}"
            f"{r['ratio_memcpy'] or 0:>10.2f}" + ("" if r.get("verified", True) else "  NOT VERIFIED")
        )
    goal = result["goal_fragments_1MiB_reach_0.8_of_contiguous"]
    lines.append(
        "goal (fragments >= 1 MiB reach 0.8 of one contiguous write): "
        + ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in goal.items())
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import logging

    # NIXL logs INFO lines to stdout, which would corrupt --json output
    logging.getLogger("nixl").setLevel(logging.WARNING)
    import anyio

    from kvferry.transports.bench import plot, run_transfer_bench
    from kvferry.transports.registry import available_transports

    if args.transport == "all":
        names = [n for n, error in available_transports().items() if error is None]
    else:
        names = [args.transport]

    def bench(progress: Callable[[str], None]) -> dict[str, Any]:
        return anyio.run(
            lambda: run_transfer_bench(
                names,
                args.total_bytes,
                args.fragment_bytes,
                page_bytes=args.page_bytes,
                repeats=args.repeats,
                baselines=not args.no_baselines,
                progress=progress,
                device=args.device,
            )
        )

    try:
        from rich.console import Console

        console = Console(stderr=True)
        status = console.status("starting")

        def progress(message: str) -> None:
            status.update(message)
            console.log(message)

        with status:
            result = bench(progress)
    except ImportError:
        result = bench(lambda m: print(m, file=sys.stderr))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0 if all(r.get("verified", True) for r in result["rows"]) else 1
