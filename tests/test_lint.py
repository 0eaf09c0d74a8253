"""The project's own rules, checked where CI looks: ruff (lint + format) and mypy --strict are clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is in the test extra")
def test_ruff_check_and_format_are_clean() -> None:
    lint = _run("ruff", "check", "kvferry", "tests", "benchmarks", timeout=120)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = _run("ruff", "format", "--check", "kvferry", "tests", "benchmarks", timeout=120)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


@pytest.mark.timeout(600)
def test_mypy_strict_is_clean() -> None:
    pytest.importorskip("mypy")
    result = _run(sys.executable, "-m", "mypy", timeout=590)
    assert result.returncode == 0, result.stdout + result.stderr
