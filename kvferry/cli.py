"""The ``kvferry`` command line: demo | generate | layout | info | bench | serve.

Each subcommand lives in its own module under :mod:`kvferry.commands` with two functions,
``add_arguments(parser)`` and ``run(args) -> int``; its heavy imports (torch, nixl, ucxx) happen only when it
runs, so ``kvferry --help`` and ``kvferry layout`` stay quick.

Exit status: what the command returns (0 success; ``demo``: 1 when the tokens differ), 2 for bad input (a usage
error, a :class:`~kvferry.errors.ConfigError` or a missing extra), 3 for any other typed failure
(:class:`~kvferry.errors.KvferryError`), 130 on Ctrl-C. A typed failure prints one line on stderr,
``kvferry COMMAND: error: MESSAGE (ErrorType)``, also when it arrives wrapped in an exception group.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

from kvferry._glibc import reexec_tuned
from kvferry.exits import EXIT_FAILURE as EXIT_FAILURE
from kvferry.exits import EXIT_INTERRUPTED as EXIT_INTERRUPTED
from kvferry.exits import EXIT_USAGE as EXIT_USAGE
from kvferry.exits import exit_status as exit_status
from kvferry.exits import one_line as one_line

#: subcommand -> (module under kvferry.commands, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "disaggregated serving of the reference model, checked against the aggregated run"),
    "generate": ("generate", "generate tokens with the reference model (or a local NemotronH checkpoint)"),
    "layout": ("layout", "show each rank's pool groups and layer groups for a model and TP size"),
    "info": ("info", "versions, loadable transports and the UCX transports they actually use"),
    "bench": ("bench", "benchmarks: bench transfer | bench serve | bench offload | bench decode"),
    "serve": ("serve", "an OpenAI-compatible HTTP server (/v1/completions) over one engine or disaggregated"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvferry",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog="exit status: 0 ok, 1 demo's tokens differ, 2 bad input, 3 a runtime failure, 130 interrupted",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"kvferry.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvferry.commands.{module_name}":
                raise
            continue  # a subcommand whose module is absent is left out
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None:  # the command itself (not a call from Python): host copies of fragments near a memcpy
        reexec_tuned()
    try:
        result: int = args._run(args)
    except (Exception, KeyboardInterrupt, BaseExceptionGroup) as exc:
        return exit_status(args.command, exc)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
