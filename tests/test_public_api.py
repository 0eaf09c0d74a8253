"""The public API of ``import kvferry``: every name resolves, and the import stays cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvferry


def test_every_public_name_resolves_to_its_module_object() -> None:
    for name in kvferry.__all__:
        assert getattr(kvferry, name) is not None, name
    from kvferry.pools.manager import CacheManager
    from kvferry.transports.registry import get_transport

    assert kvferry.CacheManager is CacheManager
    assert kvferry.get_transport is get_transport


def test_the_engine_types_a_caller_meets_are_public() -> None:
    """build_engine returns a BuiltEngine, generate a Generation, statistics() EngineStatistics and
    GenerationStatistics: each is importable from kvferry, for annotations."""
    from kvferry.engine.engine import EngineStatistics, Generation, GenerationStatistics
    from kvferry.engine.runner import BuiltEngine

    for name, obj in {
        "Generation": Generation,
        "EngineStatistics": EngineStatistics,
        "GenerationStatistics": GenerationStatistics,
        "BuiltEngine": BuiltEngine,
    }.items():
        assert name in kvferry.__all__ and getattr(kvferry, name) is obj


def test_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="NotAThing"):
        _ = kvferry.NotAThing


def test_import_kvferry_imports_no_optional_library_and_not_torch() -> None:
    code = (
        "import sys, kvferry; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'torch', 'nixl', 'nixl_cu12', 'nixl_cu13', 'ucxx', 'transformers'}); "
        "print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""
