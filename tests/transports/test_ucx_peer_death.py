"""ucx with ``cma=False``: a writer that dies in the middle of a large write to us (one rendezvous message) leaves
the receiving process running, the peer lost with a typed error. With CMA (the default), UCX 1.21 may abort a
receiving process that reads the dead writer's memory (``process_vm_readv`` failing is fatal without error
handling: it ended a CI run once); ``cma=False`` leaves CMA out of the transport's UCX context. Each case runs
in processes of its own (``ucx_peer_death.py``), so that an abort fails the case, not the whole run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ucxx")

SCRIPT = Path(__file__).with_name("ucx_peer_death.py")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ucx_peer_death.py *args`` in a process of its own (``env``: its whole environment)."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=100, env=env
    )


@pytest.mark.timeout(120)
def test_cma_false_leaves_cma_out_of_the_ucx_context() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    left_out = _run("config", env=environ)
    assert left_out.stdout.split()[-1:] == ["^cma"], left_out
    default = _run("config", "cma", env=environ)
    assert default.stdout.split()[-1:] == ["all"], default
    # a UCX_TLS of the user's decides
    chosen = _run("config", env={**environ, "UCX_TLS": "tcp,sm,self"})
    assert chosen.stdout.split()[-1:] == ["tcp,sm,self"], chosen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("moment", [0.0, 0.01])
def test_writer_killed_in_the_middle_of_a_message(moment: float) -> None:
    done = _run("receive", str(moment))
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stdout, done.stderr)
