"""Test setup shared by every suite.

The UCX environment is set before any test imports nixl or ucxx (docs/transports.md, "Environment"):
loopback only, no warnings about variables UCX does not know, reusable listener ports, blocking progress
(no core spinning at 100%).

Async tests use anyio's pytest plugin (``pytest.mark.anyio``) on the asyncio backend; tests/engine, which
nothing ties to asyncio, runs under trio as well (its conftest.py). pytest-asyncio stays installed only for
tests/test_testing_plugin.py, which checks kvferry's fixtures for pytest-asyncio users.
"""

from __future__ import annotations

import os

for _key, _value in {
    "UCX_NET_DEVICES": "lo",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_CM_REUSEADDR": "y",
    "UCXPY_PROGRESS_MODE": "blocking",
}.items():
    os.environ.setdefault(_key, _value)

import pytest  # noqa: E402
import torch  # noqa: E402

# The suites run on 2 cores beside helper processes (transport peers, engine workers): more intra-op threads
# only oversubscribe them, and one thread keeps float reductions in one order for every test.
torch.set_num_threads(1)


@pytest.fixture
def anyio_backend() -> str:
    # ucxx is asyncio-only, so the transports, disagg and security suites run on asyncio alone
    return "asyncio"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # one async plugin for the suites: a test marked for pytest-asyncio would run on a loop of its own, beside
    # the anyio fixtures it shares with every other test
    stray = [item.nodeid for item in items if item.get_closest_marker("asyncio") is not None]
    if stray:
        raise pytest.UsageError(
            "async tests here use pytest.mark.anyio, not pytest.mark.asyncio: " + ", ".join(stray)
        )
