"""``kvferry bench transfer``: transfer throughput between two processes against same-run ceilings;
``kvferry bench serve``: load on the serving API or a running server (:mod:`kvferry.commands.bench_serve`);
``kvferry bench offload``: a suspended request's offload to the host and restore, and the event loop meanwhile
(:mod:`kvferry.commands.bench_offload`); ``kvferry bench decode``: decode and prefill throughput of the engine
against same-run ceilings (:mod:`kvferry.commands.bench_decode`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from kvferry.commands._common import byte_count, positive_int, say, write_result
from kvferry.errors import ConfigError, MissingExtraError

__all__ = ["add_arguments", "run"]

MiB = 1 << 20


def _bytes(n: int) -> str:
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    transfer = sub.add_parser("transfer", help="writes between two processes per transport and fragment size")
    transfer.add_argument("--transport", choices=["nixl", "ucx", "local", "all"], default="all")
    transfer.add_argument(
        "--total-bytes", type=byte_count, default=64 * MiB, help="bytes per write (default 64M)"
    )
    transfer.add_argument(
        "--fragment-bytes",
        type=byte_count,
        nargs="+",
        default=[4 << 10, 64 << 10, 256 << 10, MiB, 4 * MiB, 16 * MiB],
        help="contiguous run sizes to measure",
    )
    transfer.add_argument(
        "--page-bytes", type=byte_count, default=64 << 10, help="one fragment per page passed to write"
    )
    transfer.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="memory at both ends")
    transfer.add_argument(
        "--processes", type=int, default=2, choices=[2], help="writer and receiver processes"
    )
    transfer.add_argument(
        "--repeats", type=positive_int, default=5, help="timed writes per point (median reported)"
    )
    transfer.add_argument("--no-baselines", action="store_true", help="skip nixl-per-page and gloo")
    transfer.add_argument("--json", action="store_true", help="print the result as JSON")
    transfer.add_argument("--output", help="also write the JSON result to this file")
    transfer.add_argument("--plot", help="draw GB/s against fragment size into this PNG")
    from kvferry.commands import bench_serve

    serve = sub.add_parser(
        "serve",
        help="load on the serving API (in-process, aggregated or disaggregated) or on a running server",
        description=bench_serve.__doc__.split("\n\n")[0] if bench_serve.__doc__ else None,
    )
    bench_serve.add_arguments(serve)
    from kvferry.commands import bench_offload

    offload = sub.add_parser(
        "offload",
        help="offload and restore of a suspended request (GB/s per size) and the event loop meanwhile",
        description=bench_offload.__doc__.split("\n\n")[0] if bench_offload.__doc__ else None,
    )
    bench_offload.add_arguments(offload)
    from kvferry.commands import bench_decode

    decode = sub.add_parser(
        "decode",
        help="decode tokens/s per batch size against the memory roofline and transformers; prefill vs matmul",
        description=bench_decode.__doc__.split("\n\n")[0] if bench_decode.__doc__ else None,
    )
    bench_decode.add_arguments(decode)


def _table(result: dict[str, Any]) -> str:
    lines = [
        f"{'kind':<14}{'transport':<10}{'fragment':>10}{'page':>8}{'frags':>7}{'seconds':>10}{'GB/s':>8}{'vs contig':>10}{'vs copy':>10}"
    ]
    for r in result["rows"]:
        contiguous = r.get("ratio_contiguous")
        lines.append(
            f"{r['kind']:<14}{r['transport']:<10}{_bytes(r['fragment_bytes']):>10}{_bytes(r['page_bytes']):>8}{r['fragments']:>7}"
            f"{r['seconds']:>10.4f}{r['gbps']:>8.2f}{'-' if contiguous is None else f'{contiguous:.2f}':>10}"
            f"{r.get('ratio_memcpy', r.get('ratio_device_copy')) or 0:>10.2f}"
            + ("" if r.get("verified", True) else "  NOT VERIFIED")
        )
    goal = result["goal_fragments_1MiB_reach_0.8_of_contiguous"]
    lines.append(
        "goal (fragments >= 1 MiB reach 0.8 of one contiguous write): "
        + (
            ", ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in goal.items())
            or "not judged (no fragment size of 1 MiB or more was run)"
        )
    )
    return "\n".join(lines)


def check_output(flag: str, path: str | None) -> None:
    """Refuse an output path whose directory is missing or not writable, or that is a directory."""
    if path is None:
        return
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(f"{flag} {path}: the directory {directory} does not exist")
    if not os.access(directory, os.W_OK):
        raise ConfigError(f"{flag} {path}: the directory {directory} is not writable")
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a directory")


def _available_memory(device: str) -> int | None:
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


#: fragments in one benchmark write: past this a write request is larger than a peer accepts, and the
#: per-fragment work dominates whatever the transport does
MAX_FRAGMENTS = 1 << 16


def _check_memory(total: int, device: str) -> None:
    """Refuse a write size that cannot be allocated: the source, its memcpy copy and the destination."""
    needed = 3 * total
    available = _available_memory(device)
    if available is not None and needed > available:
        raise ConfigError(
            f"--total-bytes {_bytes(total)} needs about {_bytes(needed)} of {device} memory (source, copy and "
            f"destination); {available >> 20} MiB are available"
        )


def check_plot(path: str | None) -> None:
    """Refuse a ``--plot`` path that cannot be written, or without matplotlib, or of a format it cannot write.

    :raises ~kvferry.errors.ConfigError: the path or its format
    :raises ~kvferry.errors.MissingExtraError: matplotlib is not installed
    """
    if path is None:
        return
    check_output("--plot", path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingExtraError("matplotlib (for --plot)", "bench") from None
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix and suffix not in formats:
        raise ConfigError(f"--plot {path}: matplotlib cannot write .{suffix} files (try .png, .svg or .pdf)")


def validate(args: argparse.Namespace) -> list[str]:
    """Check everything that can be checked before the benchmark runs; return the transports to run.

    :raises ~kvferry.errors.ConfigError: sizes that do not tile, a device or an output that cannot work
    :raises ~kvferry.errors.MissingExtraError: a transport or ``--plot`` whose library is not installed
    """
    total = args.total_bytes
    for fragment in args.fragment_bytes:
        if fragment > total:
            raise ConfigError(
                f"--fragment-bytes {_bytes(fragment)} exceeds --total-bytes {_bytes(total)}: "
                "a fragment is a run of pages within one write"
            )
        if total % fragment:
            raise ConfigError(
                f"--fragment-bytes {_bytes(fragment)} does not divide --total-bytes {_bytes(total)}: "
                "every write is cut into whole fragments"
            )
        if total // fragment > MAX_FRAGMENTS:
            raise ConfigError(
                f"--fragment-bytes {_bytes(fragment)} cuts --total-bytes {_bytes(total)} into {total // fragment} "
                f"fragments; at most {MAX_FRAGMENTS} fit one write (use --fragment-bytes "
                f"{_bytes(-(-total // MAX_FRAGMENTS))} or more)"
            )
        if args.page_bytes < fragment and fragment % args.page_bytes:
            raise ConfigError(
                f"--page-bytes {_bytes(args.page_bytes)} does not divide --fragment-bytes {_bytes(fragment)}: "
                "a fragment is a run of whole pages"
            )
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: CUDA is not available here (torch sees no GPU)")
    _check_memory(total, args.device)
    check_output("--output", args.output)
    check_plot(args.plot)
    from kvferry.transports.registry import available_transports, get_transport

    if args.transport != "all":
        get_transport(args.transport)  # MissingExtraError names the extra
        return [args.transport]
    return [n for n, error in available_transports().items() if error is None]


def run(args: argparse.Namespace) -> int:
    if args.benchmark == "serve":
        from kvferry.commands import bench_serve

        return bench_serve.run(args)
    if args.benchmark == "offload":
        from kvferry.commands import bench_offload

        return bench_offload.run(args)
    if args.benchmark == "decode":
        from kvferry.commands import bench_decode

        return bench_decode.run(args)
    from kvferry._stdio import quiet_library_env, stdout_to_stderr

    quiet_library_env()  # before nixl or ucxx loads; the peer processes inherit it
    # the libraries print to file descriptor 1 (from their import on): it points at stderr until the result
    with stdout_to_stderr():
        names = validate(args)
        result = _bench(args, names)
    # the result first: a file that cannot be written after all (a full disk) must not lose the run
    print(json.dumps(result, indent=2) if args.json else _table(result), flush=True)

    def plotter() -> Any:
        from kvferry.tools.transfer_bench import plot

        return plot

    write_result(result, args.output, args.plot, plotter)
    failed = [r for r in result["rows"] if not r.get("verified", True)]
    for r in failed:
        say(
            f"kvferry bench: {r['transport']} {r['kind']} of {_bytes(r['fragment_bytes'])} fragments: "
            "the receiver's sha256 differs from the source's (bytes were lost or misplaced)"
        )
    return 1 if failed else 0


def _bench(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    import anyio

    from kvferry.tools.transfer_bench import run_transfer_bench

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

    status = _rich_status()
    if status is None:
        return bench(say)

    def update(message: str) -> None:
        status.update(message)
        status.console.log(message)

    with status:
        return bench(update)


def _rich_status() -> Any:
    """A rich status line on a terminal (with the bench extra), else None (plain lines)."""
    if not sys.stderr.isatty():
        return None
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(stderr=True).status("starting")
