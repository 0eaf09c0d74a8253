"""The engine is anyio end to end and nothing in it is asyncio's alone: its suites run under asyncio and trio."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    backend: str = request.param
    return backend
