"""ucx: a writer that dies in the middle of a large write to us leaves the receiving process running, the peer
lost with a typed error, and no core spinning after it. Two paths: ``pull`` (the default: the receiver reads the
writer's memory with its own ``process_vm_readv``, which fails with an error where UCX's CMA, error handling off,
aborts the process: it ended a CI run once) and ``messages`` (UCX messages without UCX's CMA, through its
shared-memory FIFOs; the dead writer leaves UCX retrying forever, which kvferry's worker driver polls every
10 ms instead of spinning). Each case runs in processes of its own (``ucx_peer_death.py``), so that an abort fails
the case, not the whole run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.support import SUPPORT

pytest.importorskip("ucxx")

SCRIPT = SUPPORT / "ucx_peer_death.py"


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ucx_peer_death.py *args`` in a process of its own (``env``: its whole environment)."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=100, env=env
    )


@pytest.mark.timeout(120)
def test_the_ucx_context_leaves_cma_out_unless_asked() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    left_out = _run("config", env=environ)
    assert left_out.stdout.split()[-1:] == ["^cma"], left_out
    asked = _run("config", "cma", env=environ)
    assert asked.stdout.split()[-1:] == ["all"], asked
    # a UCX_TLS of the user's decides
    chosen = _run("config", env={**environ, "UCX_TLS": "tcp,sm,self"})
    assert chosen.stdout.split()[-1:] == ["tcp,sm,self"], chosen


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "path",
    [
        "pull",
        "messages",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
    ],
)
@pytest.mark.parametrize("moment", [0.0, 0.01])
def test_writer_killed_in_the_middle_of_a_message(moment: float, path: str) -> None:
    done = _run("receive", str(moment), path)
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stdout, done.stderr)
    # CPU seconds per second of this process once idle after the death (a spinning core: 1.0)
    idle = float(done.stdout.split("idle-cpu")[1].split()[0])
    assert idle < 0.3, done.stdout
