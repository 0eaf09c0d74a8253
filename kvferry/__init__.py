"""kvferry: the whole cache of a hybrid LLM, correct through every turn of a request, and ferried between engines."""

from __future__ import annotations

from kvferry.errors import *  # noqa: F403
from kvferry.errors import __all__ as _errors_all

__version__ = "0.1.0"

__all__ = ["__version__", *_errors_all]
