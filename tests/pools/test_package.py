"""``kvferry.pools`` re-exports its public names, each the object of the module that defines it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvferry.pools
from kvferry.pools import manager


def test_every_public_name_resolves() -> None:
    for name in kvferry.pools.__all__:
        assert getattr(kvferry.pools, name) is not None, name
    for name in manager.__all__:
        assert getattr(kvferry.pools, name) is getattr(manager, name), name
    with pytest.raises(AttributeError, match="NotAThing"):
        _ = kvferry.pools.NotAThing


def test_one_module_imports_without_the_manager() -> None:
    code = "import sys, kvferry.pools.spec; print('kvferry.pools.manager' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
