"""The ``kvferry`` command line: demo | generate | layout | info | bench.

Each subcommand lives in its own module under :mod:`kvferry.commands` with two functions,
``add_arguments(parser)`` and ``run(args) -> int``; it is imported only when it runs, so ``kvferry layout``
never imports torch's heavier corners, nixl or ucxx.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvferry.errors import KvferryError

#: subcommand -> (module under kvferry.commands, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("demo", "disaggregated serving of the reference model, checked against the aggregated run"),
    "generate": ("generate", "generate tokens with the reference model (or a local NemotronH checkpoint)"),
    "layout": ("layout", "show each rank's pool groups and layer groups for a model and TP size"),
    "info": ("info", "versions, loadable transports and the UCX transports they actually use"),
    "bench": ("bench", "benchmarks: bench transfer"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvferry", description=__doc__.splitlines()[0] if __doc__ else None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f"kvferry.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"kvferry.commands.{module_name}":
                raise
            continue  # not built yet
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(command_parser)
        command_parser.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args._run(args)
    except KvferryError as exc:
        print(f"kvferry {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader (e.g. `| head`) went away: not an error of ours; silence the flush at exit too
        sys.stderr.close()
        return 0
    return result


if __name__ == "__main__":
    raise SystemExit(main())
