"""Soak: a seeded randomized run through disaggregated serving under tight pools, with random cancels, client
disconnects, context-engine restarts and tensor-parallel mismatch (see :mod:`tests.support.soak`).

Every request that finished has the tokens of an unconstrained aggregated run, a cancelled one a prefix of them,
an errored one failed on a context engine that was killed; afterwards every pool, hold, receiver session, grant,
registration, open descriptor and thread count is back to its value after a warm-up. The figures are printed
(``pytest -s``). The default run serves 200 requests over the local transport; ``-m slow`` serves 5,000 more
across transports and TP pairs.
"""

from __future__ import annotations

import pytest

from kvferry.transports import available_transports
from tests.support.soak import SoakReport, run_soak


def _check(report: SoakReport, requests: int, restarts: int) -> None:
    print(f"\n{report.summary()}")
    assert not report.problems, "\n".join(report.problems)
    assert report.requests == requests
    assert report.completed + report.cancelled + report.errored == requests
    assert report.restarts == restarts
    assert report.completed > 0 and report.transfers > 0


@pytest.mark.timeout(300)
@pytest.mark.anyio
async def test_soak_200_requests_local_ctx_tp2_gen_tp1() -> None:
    report = await run_soak(200, seed=20240611, transport="local", ctx_tp=2, gen_tp=1, restarts=2)
    _check(report, 200, 2)


#: (transport, ctx_tp, gen_tp, context engines up at once, requests, restarts): 5,000 requests in all
MATRIX = [
    ("local", 2, 1, 2, 1500, 3),
    ("local", 1, 2, 1, 500, 2),
    ("nixl", 1, 2, 2, 1500, 3),
    ("ucx", 2, 2, 2, 1000, 3),
    ("ucx", 1, 1, 1, 500, 1),
]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize(("transport", "ctx_tp", "gen_tp", "contexts", "requests", "restarts"), MATRIX)
@pytest.mark.anyio
async def test_soak_matrix(
    transport: str, ctx_tp: int, gen_tp: int, contexts: int, requests: int, restarts: int
) -> None:
    missing = available_transports()[transport]
    if missing is not None:
        pytest.skip(missing)
    report = await run_soak(
        requests,
        seed=requests * 7 + ctx_tp * 3 + gen_tp,
        transport=transport,
        ctx_tp=ctx_tp,
        gen_tp=gen_tp,
        restarts=restarts,
        contexts=contexts,
        deadline=3000.0,
    )
    _check(report, requests, restarts)
