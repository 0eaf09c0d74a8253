"""The ``kvferry`` command line: demo | generate | layout | info | bench.

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
import sys
from collections.abc import Sequence

from kvferry.errors import ConfigError, KvferryError, MissingExtraError

#: subcommand -> (module under kvferry.commands, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "disaggregated serving of the reference model, checked against the aggregated run"),
    "generate": ("generate", "generate tokens with the reference model (or a local NemotronH checkpoint)"),
    "layout": ("layout", "show each rank's pool groups and layer groups for a model and TP size"),
    "info": ("info", "versions, loadable transports and the UCX transports they actually use"),
    "bench": ("bench", "benchmarks: bench transfer"),
}

#: exit statuses
EXIT_USAGE = 2
EXIT_FAILURE = 3
EXIT_INTERRUPTED = 130


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


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, in order; ``exc`` itself if it is none."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def one_line(exc: BaseException) -> str:
    """``MESSAGE (ErrorType)`` on one line."""
    text = " ".join(str(exc).split()) or "(no message)"
    return f"{text} ({type(exc).__name__})"


def exit_status(command: str, exc: BaseException) -> int:
    """Report ``exc`` (raised by a command) the way the CLI does and return the exit status; re-raise what is
    neither a typed error nor an interruption (a bug: its traceback is worth seeing)."""
    leaves = _leaves(exc)
    if any(isinstance(leaf, KeyboardInterrupt) for leaf in leaves):
        print(f"kvferry {command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if any(isinstance(leaf, BrokenPipeError) for leaf in leaves):
        # the reader (e.g. `| head`) went away: not an error of ours; silence the flush at exit too
        sys.stderr.close()
        return 0
    typed = [leaf for leaf in leaves if isinstance(leaf, KvferryError)]
    if not typed:
        raise exc
    # several typed failures (one per task): the first is the cause, the rest mostly its echoes
    error = typed[0]
    print(f"kvferry {command}: error: {one_line(error)}", file=sys.stderr)
    return EXIT_USAGE if isinstance(error, (ConfigError, MissingExtraError)) else EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args._run(args)
    except (Exception, KeyboardInterrupt, BaseExceptionGroup) as exc:
        return exit_status(args.command, exc)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
