"""``kvferry bench serve``: load on the serving API (in this process) or on a running ``kvferry serve``
(``--url``), measured per request; see :mod:`kvferry.tools.serve_bench` for what is measured and how.

In this process (the default) the service is built from ``--model --tp --spec-k --num-pages --max-running``;
with ``--disagg`` (``--transport --ctx-tp --gen-tp``) the same requests run through an aggregated service and
then the disaggregated one, and the handoff latency (TTFT disaggregated - aggregated, per request) is judged
against the goal "median within one model step plus 2 ms". ``--check`` compares every request's tokens with
offline greedy generation of the same model (``--model --dtype --weights-seed``, also with ``--url``: start the
server with the same ones).

Progress goes to stderr; stdout gets the table, or with ``--json`` one JSON object: the keys of
:data:`~kvferry.tools.serve_bench.JSON_KEYS`, each pass's figures with the keys of
:data:`~kvferry.tools.serve_bench.PASS_KEYS`.

Exit status: 0 done, 1 ``--check`` found a request whose tokens differ from offline or that did not complete,
2 bad arguments, 3 a typed runtime failure, 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from typing import TYPE_CHECKING, Any

from kvferry.commands._common import (
    check_model,
    check_tp,
    non_negative_int,
    positive_int,
    progress,
    resolve_transport,
    say,
    seed_int,
)
from kvferry.errors import ConfigError, MissingExtraError

if TYPE_CHECKING:
    from kvferry.tools.serve_bench import LengthRange, ServeBenchConfig

__all__ = ["add_arguments", "run"]

#: the transports --disagg may use (auto: nixl, else ucx, else local in this process)
TRANSPORTS = ("auto", "nixl", "ucx", "local")
#: closed-loop requests in flight when neither --concurrency nor --rate is given
DEFAULT_CONCURRENCY = 16
#: in-process flags: (attribute, flag, default)
_ENGINE_FLAGS = (
    ("tp", "--tp", 1),
    ("spec_k", "--spec-k", 0),
    ("num_pages", "--num-pages", 512),
    ("max_running", "--max-running", 16),
    ("max_queued", "--max-queued", 1024),
)
_DISAGG_FLAGS = (("transport", "--transport"), ("ctx_tp", "--ctx-tp"), ("gen_tp", "--gen-tp"))


def _length_range(text: str) -> LengthRange:
    from kvferry.tools.serve_bench import LengthRange

    try:
        return LengthRange.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    load = parser.add_argument_group("load")
    load.add_argument(
        "--requests", type=positive_int, default=100, metavar="N", help="requests (default 100)"
    )
    loop = load.add_mutually_exclusive_group()
    loop.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        metavar="C",
        help=f"closed loop: C requests in flight (default {DEFAULT_CONCURRENCY})",
    )
    loop.add_argument(
        "--rate", type=_positive_float, default=None, metavar="R", help="open loop: R requests/s, Poisson"
    )
    load.add_argument(
        "--prompt-len",
        type=_length_range,
        default="16:128",
        metavar="LOW:HIGH",
        help="prompt tokens: a uniform range or one length (default 16:128)",
    )
    load.add_argument(
        "--output-len",
        type=_length_range,
        default="16:64",
        metavar="LOW:HIGH",
        help="generated tokens per request: a uniform range or one length (default 16:64)",
    )
    load.add_argument(
        "--seed", type=seed_int, default=0, metavar="S", help="prompts, lengths and arrivals (default 0)"
    )
    load.add_argument(
        "--timeout",
        type=_positive_float,
        default=300.0,
        metavar="SECONDS",
        help="each request's deadline; past it the request is cancelled and counted as an error (default 300)",
    )
    load.add_argument(
        "--warmup",
        type=non_negative_int,
        default=2,
        metavar="N",
        help="requests (other prompts) sent before each pass and not measured (default 2)",
    )
    target = parser.add_argument_group("target")
    target.add_argument(
        "--url", default=None, help="a running kvferry serve (http://HOST:PORT) instead of in-process"
    )
    target.add_argument(
        "--model",
        default="tiny",
        help="'tiny' or a checkpoint directory (with --url: the server's model, for its vocabulary and --check)",
    )
    target.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    target.add_argument(
        "--weights-seed", type=seed_int, default=0, metavar="S", help="seed of the tiny model's weights"
    )
    engine = parser.add_argument_group("in-process engine")
    engine.add_argument(
        "--tp", type=positive_int, default=None, metavar="N", help="simulated TP ranks (default 1)"
    )
    engine.add_argument(
        "--spec-k", type=non_negative_int, default=None, metavar="K", help="draft tokens per step (default 0)"
    )
    engine.add_argument(
        "--num-pages",
        type=positive_int,
        default=None,
        metavar="N",
        help="attention pages per rank (default 512)",
    )
    engine.add_argument(
        "--max-running",
        type=positive_int,
        default=None,
        metavar="N",
        help="requests decoded together (default 16)",
    )
    engine.add_argument(
        "--max-queued",
        type=positive_int,
        default=None,
        metavar="N",
        help="requests waiting for admission past which submit refuses (default 1024)",
    )
    disagg = parser.add_argument_group("disaggregated (in-process)")
    disagg.add_argument(
        "--disagg",
        action="store_true",
        help="also run the requests disaggregated and judge the handoff latency against the aggregated pass",
    )
    disagg.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=None,
        help="auto (default): nixl, else ucx; without either the context engine runs in this process over local",
    )
    disagg.add_argument(
        "--ctx-tp", type=positive_int, default=None, metavar="N", help="context TP (default 1)"
    )
    disagg.add_argument(
        "--gen-tp", type=positive_int, default=None, metavar="M", help="generation TP (default 1)"
    )
    engine.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        metavar="N",
        help="torch intra-op threads in this process and a context process it starts (default: torch's choice)",
    )
    out = parser.add_argument_group("output")
    out.add_argument(
        "--check", action="store_true", help="compare every request's tokens with offline greedy"
    )
    out.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    out.add_argument("--output", default=None, metavar="PATH", help="also write the JSON object to this file")
    out.add_argument(
        "--plot", default=None, metavar="FILE.png", help="draw latency CDFs and tokens/s over time"
    )


def config_from_args(args: argparse.Namespace) -> ServeBenchConfig:
    """The run the arguments describe, checked before anything starts.

    :raises ~kvferry.errors.ConfigError: contradictory or impossible flags.
    """
    from kvferry.engine.runner import EngineOptions
    from kvferry.serving import DisaggOptions
    from kvferry.tools.serve_bench import ServeBenchConfig

    check_model(args.model)
    engine_given = [flag for attr, flag, _ in _ENGINE_FLAGS if getattr(args, attr) is not None]
    disagg_given = [flag for attr, flag in _DISAGG_FLAGS if getattr(args, attr) is not None]
    if args.url is not None:
        if not args.url.startswith(("http://", "https://")):
            raise ConfigError(f"--url {args.url}: give http://HOST:PORT")
        given = engine_given + disagg_given + (["--disagg"] if args.disagg else [])
        if given:
            raise ConfigError(
                f"{', '.join(given)} apply in-process only: the server's own flags decide with --url"
            )
    if not args.disagg and disagg_given:
        raise ConfigError(f"{', '.join(disagg_given)} only apply with --disagg")
    if args.disagg and args.tp is not None:
        raise ConfigError("with --disagg give --gen-tp (and --ctx-tp) instead of --tp")
    value = {
        attr: default if getattr(args, attr) is None else getattr(args, attr)
        for attr, _, default in _ENGINE_FLAGS
    }
    tp = (args.gen_tp or 1) if args.disagg else value["tp"]
    check_tp(args.model, "--gen-tp" if args.disagg else "--tp", tp)
    if args.disagg:
        check_tp(args.model, "--ctx-tp", args.ctx_tp or 1)
    engine = EngineOptions(
        tp=tp,
        dtype=args.dtype,
        seed=args.weights_seed,
        num_pages=value["num_pages"],
        max_running=value["max_running"],
        max_spec_k=value["spec_k"],
    )
    disagg = None
    if args.disagg:
        transport, separate = resolve_transport(args.transport or "auto")
        disagg = DisaggOptions(transport=transport, ctx_tp=args.ctx_tp or 1, separate_process=separate)
    concurrency = args.concurrency
    if concurrency is None and args.rate is None:
        concurrency = DEFAULT_CONCURRENCY
    return ServeBenchConfig(
        requests=args.requests,
        concurrency=concurrency,
        rate=args.rate,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
        timeout=args.timeout,
        model=args.model,
        engine=engine,
        disagg=disagg,
        max_queued=value["max_queued"],
        url=args.url,
        check=args.check,
        warmup=args.warmup,
    )


def _check_extras(args: argparse.Namespace) -> None:
    if args.url is not None:
        try:
            import httpx  # noqa: F401
        except ImportError:
            raise MissingExtraError("httpx (for --url)", "bench") from None


def run(args: argparse.Namespace) -> int:
    import anyio

    from kvferry._stdio import quiet_library_env, stdout_to_stderr
    from kvferry.commands.bench import check_output, check_plot
    from kvferry.tools.serve_bench import run_serve_bench

    check_output("--output", args.output)
    check_plot(args.plot)
    _check_extras(args)
    quiet_library_env()  # before nixl or ucxx loads; a context process inherits it
    if args.threads is not None:
        _set_threads(args.threads)
    # the libraries print to file descriptor 1 (from their import on): it points at stderr until the result
    with stdout_to_stderr():
        config = config_from_args(args)
        bench = anyio.run(partial(run_serve_bench, config, say=say, progress=progress))
    result = bench.result
    # the result first: a file that cannot be written after all (a full disk) must not lose the run
    print(json.dumps(result, indent=2) if args.json else _table(result), flush=True)
    _write(args, bench)
    check = result["check"]
    return 1 if check is not None and not check["passed"] else 0


def _set_threads(threads: int) -> None:
    import os

    import torch

    # a context process reads it when it starts
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def _table(result: dict[str, Any]) -> str:
    from kvferry.tools.serve_bench_report import table

    return table(result)


def _write(args: argparse.Namespace, bench: Any) -> None:
    try:
        if args.output:
            with open(args.output, "w") as f:
                json.dump(bench.result, f, indent=2)
    except OSError as exc:
        raise ConfigError(f"--output {args.output}: {exc.strerror or exc}") from None
    try:
        if args.plot:
            from kvferry.tools.serve_bench_report import plot

            plot(bench.passes, bench.result, args.plot)
    except OSError as exc:
        raise ConfigError(f"--plot {args.plot}: {exc.strerror or exc}") from None
