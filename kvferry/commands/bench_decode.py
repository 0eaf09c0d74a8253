"""``kvferry bench decode``: decode tokens/s and ms per step of the real engine per batch size, against the memory
roofline measured in the same run and transformers' ``generate`` on the same weights, and one long prompt's
prefill against the matmul ceiling; see :mod:`kvferry.tools.decode_bench` for what is measured and how.

Progress goes to stderr; stdout gets the table. ``--json PATH`` writes the result (``config``, ``hardware``,
``torch``, ``commit``, ``ceilings``, ``rows`` per batch size with ``roofline_ratio`` and ``vs_transformers``,
``prefill``), ``--plot PATH`` tokens/s against batch size (needs matplotlib). ``--device cuda`` needs a GPU (it
is refused in one line where torch sees none).

Exit status: 0 done, 2 bad arguments, 3 a typed runtime failure, 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib.util
from typing import Any

from kvferry.commands._common import (
    DTYPES,
    check_device,
    check_model,
    non_negative_int,
    positive_int,
    say,
    seed_int,
    write_result,
)
from kvferry.errors import MissingExtraError

__all__ = ["add_arguments", "config_of", "run", "validate"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--model",
        default="tiny",
        help="a preset (tiny, nemotron-h-1b, nemotron-h-8b: seeded weights) or a NemotronH checkpoint directory",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="weights and cache")
    parser.add_argument(
        "--batch", type=positive_int, nargs="+", default=[1, 32, 128], metavar="N", help="batch sizes"
    )
    parser.add_argument("--prompt-tokens", type=positive_int, default=128, metavar="N", help="prompt length")
    parser.add_argument("--new-tokens", type=positive_int, default=64, metavar="N", help="tokens per request")
    parser.add_argument(
        "--repeat", type=positive_int, default=3, help="runs per point (median and [min, max])"
    )
    parser.add_argument(
        "--prefill-tokens",
        type=non_negative_int,
        default=8192,
        metavar="N",
        help="the prompt of the prefill measurement (0: not measured)",
    )
    parser.add_argument(
        "--max-prefill-chunk", type=positive_int, default=512, metavar="N", help="prompt tokens per step"
    )
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' generate")
    parser.add_argument("--weights-seed", type=seed_int, default=0, metavar="S", help="seed of the weights")
    parser.add_argument(
        "--preset-scale",
        type=positive_int,
        default=1,
        metavar="N",
        help="divide a NemotronH preset's widths by N (1: its real proportions)",
    )
    parser.add_argument(
        "--decode-graphs",
        choices=["auto", "on", "off"],
        default="auto",
        help="decode rows through the decode path (auto: on CUDA; on the CPU it runs eagerly)",
    )
    parser.add_argument(
        "--launch-on-loop",
        choices=["auto", "on", "off"],
        default="auto",
        help="plain decode steps launched from the event loop, not a worker thread (auto: on CUDA)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the result as JSON here")
    parser.add_argument("--plot", metavar="PATH", help="draw tokens/s against batch size into this PNG")


def validate(args: argparse.Namespace) -> None:
    """Check everything that can be checked before the benchmark runs.

    :raises ~kvferry.errors.ConfigError: a device, model or output that cannot work
    :raises ~kvferry.errors.MissingExtraError: ``--plot`` without matplotlib, transformers missing for the peer
    """
    from kvferry.commands.bench import check_output, check_plot

    check_device(args.device)
    check_model(args.model)
    check_output("--json", args.json)
    check_plot(args.plot)
    if not args.no_transformers and importlib.util.find_spec("transformers") is None:
        raise MissingExtraError("transformers (for the peer; or --no-transformers)", "model")


def config_of(args: argparse.Namespace) -> Any:
    from kvferry.tools.decode_bench import DecodeBenchConfig

    return DecodeBenchConfig(
        device=args.device,
        model=args.model,
        dtype=args.dtype,
        batches=tuple(args.batch),
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens,
        repeat=args.repeat,
        prefill_tokens=args.prefill_tokens,
        max_prefill_chunk=args.max_prefill_chunk,
        transformers=not args.no_transformers,
        seed=args.weights_seed,
        preset_scale=args.preset_scale,
        decode_graphs=_switch(args.decode_graphs),
        launch_on_loop=_switch(args.launch_on_loop),
    )


def _switch(value: str) -> bool | None:
    return None if value == "auto" else value == "on"


def run(args: argparse.Namespace) -> int:
    from kvferry._stdio import stdout_to_stderr
    from kvferry.tools.decode_bench import run_decode_bench, table

    with stdout_to_stderr():
        validate(args)
        result = run_decode_bench(config_of(args), say)
    # the result first: a file that cannot be written after all (a full disk) must not lose the run
    print(table(result), flush=True)

    def plotter() -> Any:
        from kvferry.tools.decode_bench import plot

        return plot

    write_result(result, args.json, args.plot, plotter, output_flag="--json")
    return 0
