"""The pytest plugin ``kvferry.testing``: its fixtures under pytest-asyncio and under anyio's plugin.

The cases in plugin_cases/user_tests.py are what a user writes; they run in a pytest of their own, in a
directory of their own, with the plugin loaded by ``-p kvferry.testing`` (what the ``pytest11`` entry point
does once the package is installed)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CASES = Path(__file__).resolve().parent / "plugin_cases" / "user_tests.py"


@pytest.mark.timeout(300)
def test_fixtures_work_under_pytest_asyncio_and_anyio(tmp_path: Path) -> None:
    shutil.copy(CASES, tmp_path / "test_user.py")
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = strict\nasyncio_default_fixture_loop_scope = function\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "kvferry.testing", "-p", "no:cacheprovider", "-q", "-rA"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=290,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    # anyio's plugin runs a user's anyio tests on every backend installed: trio as well where it is
    backends = ["asyncio", "trio"] if importlib.util.find_spec("trio") else ["asyncio"]
    expected = [
        "test_user_fixture",
        "test_engine_asyncio",
        "test_pair_asyncio_marker",
        *(f"test_engine_anyio[{backend}]" for backend in backends),
        *(f"test_pair_anyio_indirect[{backend}-kvferry_pair0]" for backend in backends),
    ]
    assert re.search(rf"\b{len(expected)} passed\b", output), output[-3000:]
    assert "error" not in output.splitlines()[-1]
    for name in expected:
        assert f"PASSED test_user.py::{name}" in output, output[-3000:]


def test_the_plugin_is_a_pytest11_entry_point() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {"kvferry.testing": "kvferry.testing"}
