"""kvferry._glibc: the environment the kvferry command runs itself again with (host copies near a memcpy)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from kvferry import _glibc


def test_the_tuned_environment_names_the_threshold_once() -> None:
    tuned = _glibc.tuned_env({"PATH": "/bin"})
    if tuned is None:  # not Linux on x86-64 with glibc: nothing to tune
        assert not (sys.platform.startswith("linux") and platform.machine() == "x86_64")
        return
    assert tuned["GLIBC_TUNABLES"] == f"{_glibc.TUNABLE}={_glibc.THRESHOLD:#x}"
    assert tuned[_glibc.MARK] == "1" and tuned["PATH"] == "/bin"
    # run tuned already, a user's own tunables, or the opt-out: left alone
    assert _glibc.tuned_env(tuned) is None
    assert _glibc.tuned_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) is None
    assert _glibc.tuned_env({_glibc.MARK: "0"}) is None


@pytest.mark.skipif(_glibc.tuned_env({}) is None, reason="glibc on x86-64 only")
def test_the_command_runs_itself_again_tuned_and_children_inherit_it() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", _glibc.MARK)}
    code = "from kvferry._glibc import reexec_tuned; import os; reexec_tuned(); print(os.environ['GLIBC_TUNABLES'])"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == f"{_glibc.TUNABLE}={_glibc.THRESHOLD:#x}"
    # the opt-out: glibc's default stays
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code.replace("os.environ['GLIBC_TUNABLES']", "os.environ.get('GLIBC_TUNABLES')"),
        ],
        env={**env, _glibc.MARK: "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "None"
