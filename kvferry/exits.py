"""How a failed command or process reports and exits: one line on stderr for a typed failure, and the exit status.

Statuses: 2 for bad input (a :class:`~kvferry.errors.ConfigError` or a missing extra), 3 for any other typed
failure (:class:`~kvferry.errors.KvferryError`), 130 on Ctrl-C; an error that is neither typed nor an interruption
is a bug and is re-raised, so that its traceback shows. Used by the ``kvferry`` command line and by the processes
it starts (the context engine of ``kvferry demo``).
"""

from __future__ import annotations

import sys

from kvferry.errors import ConfigError, KvferryError, MissingExtraError

#: exit statuses
EXIT_USAGE = 2
EXIT_FAILURE = 3
EXIT_INTERRUPTED = 130


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
