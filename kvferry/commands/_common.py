"""What the commands share: progress on stderr, and checks of their arguments."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvferry.errors import ConfigError

__all__ = ["DTYPES", "PRESETS", "Progress", "check_device", "positive_int", "progress", "say", "seed_int"]


def say(text: str) -> None:
    """One line of progress on stderr."""
    print(text, file=sys.stderr, flush=True)


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1 (argparse names the flag in its error)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an int >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def seed_int(text: str) -> int:
    """An argparse type, the one rule of ``demo`` and ``generate``: a seed is an int in [0, 2**62)."""
    value = _int(text)
    if not 0 <= value < 2**62:
        raise argparse.ArgumentTypeError(f"a seed is an int in [0, 2**62), got {value}")
    return value


class Progress:
    """Counts finished units of a long piece of work and shows it on stderr: a rich progress bar on a terminal
    (with the ``bench`` extra), else plain lines: at every tenth of the total and at most every ``interval``
    seconds in between, and at the end."""

    def __init__(self, label: str, total: int, *, interval: float = 5.0, bar: Any = None) -> None:
        self.label = label
        self.total = max(total, 1)
        self.done = 0
        self.interval = interval
        self._bar = bar
        self._task: Any = None
        self._last_tenth = 0
        self._last_time = time.monotonic()
        if bar is not None:
            self._task = bar.add_task(label, total=total)

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            return
        tenth = self.done * 10 // self.total
        now = time.monotonic()
        if tenth != self._last_tenth or now - self._last_time >= self.interval or self.done == self.total:
            self._last_tenth, self._last_time = tenth, now
            say(f"  {self.label}: {self.done}/{self.total}")


def _rich_bar() -> Any:
    if not sys.stderr.isatty():
        return None
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return None
    return Progress(
        TextColumn("  {task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    )


@contextmanager
def progress(label: str, total: int) -> Iterator[Progress]:
    """A :class:`Progress` for the block (its bar, when there is one, ends with the block)."""
    bar = _rich_bar()
    if bar is None:
        yield Progress(label, total)
        return
    with bar:
        yield Progress(label, total, bar=bar)


#: byte-count units: SI (KB = 1000) and binary (KiB = 1024); a bare K/M/G/T is the binary shorthand
BYTE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "t": 1 << 40,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
}


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920, the one rule of every command: plain bytes or ``B``; ``KiB``..``TiB`` and the
    shorthand ``K``..``T`` in powers of 1024; ``KB``..``TB`` in powers of 1000 (case does not matter)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in BYTE_UNITS:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (try 4096, 64K, 512MB or 80GiB)")
    number, unit = match.groups()
    scale = BYTE_UNITS[unit.lower()]
    return int(number) * scale if "." not in number else int(float(number) * scale)


def byte_count(text: str) -> int:
    """An argparse type: :func:`parse_bytes` of at least 1 byte."""
    value = parse_bytes(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


#: the presets of kvferry.pools.spec (listed here so that parsing imports no torch; tests check they agree)
PRESETS = ("tiny", "tiny-kimi", "nemotron-h-1b", "nemotron-h-8b")
#: the dtypes a command's ``--dtype`` offers (weights and cache)
DTYPES = ("float32", "float64", "bfloat16", "float16")


def check_model(model: str) -> None:
    """Refuse an empty ``--model`` or one that is neither a preset nor a directory, in one line."""
    presets = ", ".join(PRESETS)
    if not model.strip():
        # Path("") is the current directory: an empty value must not load whatever lies there
        raise ConfigError(f"--model is empty (give a preset: {presets}; or a checkpoint directory)")
    if model in PRESETS:
        return
    if not Path(model).exists():
        raise ConfigError(f"--model {model}: no such preset or directory (presets: {presets})")
    if not Path(model).is_dir():
        raise ConfigError(f"--model {model}: not a directory (presets: {presets})")


def check_device(device: str, flag: str = "--device") -> None:
    """Refuse a ``--device`` (or ``flag``) torch cannot use here (``cuda`` without a GPU), in one line (imports
    torch)."""
    from kvferry.model.device import resolve_device

    resolve_device(device, flag=flag)


def resolve_transport(name: str) -> tuple[str, bool]:
    """(transport, whether the context engine runs in another process). Missing extras fail here, in one line."""
    from kvferry.errors import MissingExtraError
    from kvferry.transports.registry import get_transport

    if name == "local":
        return "local", False
    if name != "auto":
        get_transport(name)  # MissingExtraError names the extra
        return name, True
    for candidate in ("nixl", "ucx"):
        try:
            get_transport(candidate)
        except MissingExtraError:
            continue
        return candidate, True
    say(
        "no cross-process transport is installed (pip install 'kvferry[nixl]' or 'kvferry[ucx]'): "
        "the context engine runs in this process, over local"
    )
    return "local", False


def check_tp(model: str, flag: str, tp: int) -> None:
    """Refuse a TP size a preset's heads do not split over before anything runs (a checkpoint's is checked
    when its engine is built)."""
    if model not in PRESETS:
        return
    from kvferry.pools.spec import preset

    spec = preset(model)
    try:
        for rank in range(tp):
            spec.shard(tp, rank)
    except ConfigError as exc:
        raise ConfigError(f"{flag} {tp}: {exc}") from None


def write_result(
    result: dict[str, Any],
    output: str | None,
    plot_path: str | None,
    plot: Callable[[], Callable[..., None]],
    *,
    output_flag: str = "--output",
) -> None:
    """Write a benchmark's JSON to ``output`` and its plot to ``plot_path`` (``plot()`` imports the plotter:
    matplotlib only when a plot is asked for).

    :raises ~kvferry.errors.ConfigError: a file cannot be written (the message names the option,
        ``output_flag`` for the JSON).
    """
    try:
        if output:
            with open(output, "w") as f:
                json.dump(result, f, indent=2)
    except OSError as exc:
        raise ConfigError(f"{output_flag} {output}: {exc.strerror or exc}") from None
    try:
        if plot_path:
            plot()(result, plot_path)
    except OSError as exc:
        raise ConfigError(f"--plot {plot_path}: {exc.strerror or exc}") from None


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` of a command that builds an engine (checked by :func:`check_device`)."""
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the weights and the cache live: cpu, cuda or cuda:N (default cpu)",
    )
    parser.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="weights and cache (default float32)"
    )
