"""ucx: a writer that dies in the middle of a large write to us (one rendezvous message) leaves the receiving
process running, the peer lost with a typed error. With CMA, UCX 1.21 aborts a receiving process that reads the
dead writer's memory (``process_vm_readv`` failing is fatal without error handling: it ended a CI run once),
so the transport's UCX context leaves CMA out unless asked or ``UCX_TLS`` says otherwise. Each case runs in
processes of its own (``ucx_peer_death.py``), so that an abort fails the case, not the whole run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ucxx")
from kvferry.transports.ucx import may_use_cma

SCRIPT = Path(__file__).with_name("ucx_peer_death.py")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=100,
        env=None if env is None else {**os.environ, **env},
    )


@pytest.mark.timeout(120)
def test_the_ucx_context_leaves_cma_out_unless_asked() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "UCX_TLS"}
    default = subprocess.run(
        [sys.executable, str(SCRIPT), "config"], capture_output=True, text=True, timeout=100, env=environ
    )
    assert default.stdout.split()[-1:] == ["^cma"], default
    asked = subprocess.run(
        [sys.executable, str(SCRIPT), "config", "cma"],
        capture_output=True,
        text=True,
        timeout=100,
        env=environ,
    )
    assert asked.returncode == 0 and may_use_cma(asked.stdout.split()[-1]), asked
    # a UCX_TLS of the user's decides, with a warning when it lets UCX use CMA
    chosen = _run("config", env={"UCX_TLS": "tcp,sm,self"})
    assert chosen.stdout.split()[-1:] == ["tcp,sm,self"], chosen
    assert "may read peers' memory by CMA" in chosen.stderr + chosen.stdout


def test_may_use_cma_reads_ucx_transport_lists() -> None:
    assert may_use_cma("all") and may_use_cma("sm,self") and may_use_cma("tcp,cma") and may_use_cma("^tcp")
    assert not may_use_cma("^cma") and not may_use_cma("^tcp,cma") and not may_use_cma("tcp,self")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("moment", [0.0, 0.01])
def test_writer_killed_in_the_middle_of_a_message(moment: float) -> None:
    done = _run("receive", str(moment))
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stdout, done.stderr)
