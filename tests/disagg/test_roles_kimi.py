"""KimiLinear engine roles end to end: a tiny-kimi context engine prefills, its KDA state, MLA latent pages and
draft KV move to a tiny-kimi generation engine of another TP size, and every token and draft proposal equals
aggregated serving's; the receiver's poisoned pages and slots change nothing and every count returns.

As for NemotronH (``test_roles.py``): a few (TP pair, transport) cases in the default suite, the rest of the
matrix in the slow suite."""

from __future__ import annotations

import anyio
import pytest

from kvferry.disagg.serve import disaggregated
from tests.support.disagg_reference import MAX_TOKENS, PROMPTS, SPEC_K, aggregated, run_disaggregated

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny-kimi"
PAIRS = [(c, g) for c in (1, 2, 4) for g in (1, 2, 4)]
#: in the default (CI) suite; the rest of PAIRS x transports is the slow suite
CI = {(1, 1, "nixl"), (2, 1, "ucx"), (1, 4, "local"), (4, 2, "local")}
MATRIX = [
    pytest.param(c, g, t, marks=() if (c, g, t) in CI else pytest.mark.slow, id=f"{c}-{g}-{t}")
    for c, g in PAIRS
    for t in ("nixl", "ucx", "local")
]


@pytest.mark.parametrize(("ctx_tp", "gen_tp", "transport"), MATRIX)
@pytest.mark.anyio
async def test_kimi_disaggregated_equals_aggregated(ctx_tp: int, gen_tp: int, transport: str) -> None:
    expected = await aggregated(PROMPTS, MODEL)
    async with disaggregated(
        model=MODEL, transport=transport, ctx_tp=ctx_tp, gen_tp=gen_tp, spec_k=SPEC_K, separate_process=False
    ) as (router, parts):
        gen, ctx = parts["gen"], parts["ctx"]
        before = [
            (b.pages_free, b.slots_free + b.slots_snapshot, b.draft_pages_free)
            for b in (gen.cache.statistics(), ctx.cache.statistics())
        ]
        got, transfers = await run_disaggregated(router, parts)
        assert got == expected
        assert len(transfers) == len(PROMPTS) and all(t is not None and t.nbytes > 0 for t in transfers)
        with anyio.fail_after(5):
            while parts["context"].statistics()["held"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        after = [
            (a.pages_free, a.slots_free + a.slots_snapshot, a.draft_pages_free)
            for a in (gen.cache.statistics(), ctx.cache.statistics())
        ]
        assert after == before
        assert gen.cache.statistics().quarantines == 0


@pytest.mark.anyio
async def test_kimi_without_the_draft_kv_keeps_the_tokens() -> None:
    """Leaving the draft KV behind: the target's tokens are still aggregated serving's (the drafter's
    proposals may differ: it drafts without the prompt's draft KV)."""
    expected_tokens, _ = await aggregated(PROMPTS, MODEL)
    async with disaggregated(
        model=MODEL, transport="local", gen_tp=2, spec_k=SPEC_K, separate_process=False
    ) as (
        router,
        parts,
    ):
        parts["worker"].transfer_draft = False
        for i, prompt in enumerate(PROMPTS):
            routed = router.generate(prompt, max_tokens=MAX_TOKENS, spec_k=SPEC_K)
            assert await routed.collect() == expected_tokens[i]
