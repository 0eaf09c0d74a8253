"""How kernel tests run a Triton kernel: ``torch`` (its torch form), ``interpreted`` (Triton's interpreter on the
CPU) and ``cuda`` (compiled, where there is a GPU).

Triton's own jitted helpers (``tl.sum``, ``tl.max``) run interpreted only when ``TRITON_INTERPRET=1`` was set
before Triton was imported, so a module's interpreted cases run in a process of their own
(:func:`run_interpreted`); in that process :data:`INTERPRETED` is true and the compiled cases are left out.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

__all__ = ["CUDA", "INTERPRETED", "MODES", "run_interpreted"]

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available() and not INTERPRETED
MODES = ("torch", *(("interpreted",) if INTERPRETED else ()), *(("cuda",) if CUDA else ()))


def run_interpreted(test_file: str) -> None:
    """Run ``test_file``'s ``interpreted`` cases in a new process with ``TRITON_INTERPRET=1``; fail with its
    output when one fails, skip where Triton is missing or this already is that process."""
    if INTERPRETED:
        pytest.skip("this process is the interpreted run")
    if torch.cuda.is_available():
        pytest.skip("the compiled kernels are tested on this machine's GPU")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "-k",
        "interpreted",
    ]
    done = subprocess.run(
        [*args, test_file], env=env, capture_output=True, text=True, timeout=360, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]
