"""What every benchmark result carries: the commit, date, hardware and command that produced it, and the
median and spread of its repetitions.

A result is one JSON file, ``benchmarks/results/<machine>/<benchmark>.json``, one current file per benchmark
and machine (history lives in git). Its top level is ``{"benchmark": name, "provenance": stamp(), ...}``, the
rest being the benchmark's own configuration and rows. Within a row a measured ``metric`` holds the median over
the repetitions and ``metric_spread`` the ``[min, max]`` of the repetitions.

Imported by the benchmark scripts as a sibling module (``python benchmarks/<name>.py`` puts this directory
first on ``sys.path``).
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

#: the repository this benchmark directory belongs to
ROOT = Path(__file__).resolve().parent.parent


def median_spread(values: Iterable[float]) -> tuple[float, list[float]]:
    """The median of ``values`` and their spread as ``[min, max]`` (what a result row stores per metric)."""
    data = list(values)
    if not data:
        raise ValueError("no values to summarise")
    return statistics.median(data), [min(data), max(data)]


def commit() -> str:
    """The checked-out commit (short hash), ``+dirty`` when tracked files outside ``benchmarks/results`` differ
    from it, or ``unknown``."""
    git = shutil.which("git")
    if git is None:
        return "unknown"
    try:
        head = subprocess.run(
            [git, "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        changed = subprocess.run(
            # results being rewritten are not a change of the code that produced them
            [
                git,
                "-C",
                str(ROOT),
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!benchmarks/results",
            ],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if changed else head


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu_driver() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


def hardware(device: str = "cpu") -> dict[str, Any]:
    """The CPU (model, cores), the GPU (name, driver) when ``device`` is a CUDA device, and the software that
    drives them (torch, its CUDA, Python, the OS)."""
    import torch

    gpu = None
    if device.startswith("cuda") and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(torch.device(device))
    return {
        "cpu": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "gpu": gpu,
        "gpu_driver": _gpu_driver() if gpu else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "os": platform.platform(),
    }


def stamp(device: str = "cpu", argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The provenance of a result made now by this process: commit, UTC date, hardware and command line."""
    args = list(sys.argv if argv is None else argv)
    if args and os.path.isabs(args[0]):
        with_root = Path(args[0])
        if with_root.is_relative_to(ROOT):
            args[0] = str(with_root.relative_to(ROOT))
    return {
        "commit": commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "hardware": hardware(device),
        "command": shlex.join(["python", *args]),
    }


def write_result(
    path: str | os.PathLike[str], benchmark: str, body: dict[str, Any], device: str = "cpu"
) -> None:
    """Write ``body`` to ``path`` as the result of ``benchmark``, stamped (:func:`stamp`)."""
    result = {"benchmark": benchmark, "provenance": stamp(device), **body}
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(result, indent=1) + "\n")
