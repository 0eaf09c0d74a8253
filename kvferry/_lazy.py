"""Lazy re-exports for package ``__init__`` modules.

A package names its public names and the modules that define them; a name is imported on first use. Importing
one module of a package (``pools.spec`` for a wire message, say) then never imports the others, ``import
kvferry`` stays fast, and no import cycle can pass through an ``__init__``.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, names: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package`` whose public ``names`` map to their defining modules."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(names)

    return __getattr__, __dir__
