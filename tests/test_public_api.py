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
    from kvferry.engine.engine import EngineStatistics
    from kvferry.engine.generation import Generation, GenerationStatistics
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


SUBPACKAGES = ["engine", "model", "pools", "kernels", "transports", "disagg"]


@pytest.mark.parametrize("package", SUBPACKAGES)
def test_every_subpackage_re_exports_its_public_names(package: str) -> None:
    """Each domain package names its public API in ``__all__``, and every name there resolves to the object its
    defining module holds."""
    import importlib

    module = importlib.import_module(f"kvferry.{package}")
    assert module.__all__, package
    for name in module.__all__:
        value = getattr(module, name)
        defined_in = getattr(value, "__module__", None)
        if defined_in is not None and defined_in.startswith("kvferry."):
            assert getattr(importlib.import_module(defined_in), name, value) is value, f"{package}.{name}"


@pytest.mark.parametrize("package", ["engine", "model", "kernels"])
def test_importing_a_subpackage_imports_none_of_its_modules(package: str) -> None:
    """The re-exports are lazy: ``import kvferry.engine`` alone loads no module of the package."""
    code = (
        f"import sys, kvferry.{package}; "
        f"print([m for m in sys.modules if m.startswith('kvferry.{package}.')])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"
