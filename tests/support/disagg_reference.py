"""The aggregated reference for the engine-role tests: fixed prompts served by one tensor-parallel-1 float64
tiny engine, whose tokens and draft proposals disaggregated serving must reproduce."""

from __future__ import annotations

import random
from typing import Any

import anyio

from kvferry.disagg.serve import _options
from kvferry.engine.runner import build_engine

PROMPTS = [
    [5, 9, 14, 200, 3, 3, 77, 1, 2, 8, 40],
    [250, 1, 7],
    [random.Random(5).randrange(256) for _ in range(45)],
]
MAX_TOKENS = 8
SPEC_K = 2

#: (tokens per prompt, draft proposals per prompt)
Result = tuple[list[list[int]], list[list[tuple[int, ...]]]]


async def aggregated(prompts: list[list[int]], model: str = "tiny") -> Result:
    """Tokens and draft proposals of aggregated serving of ``model`` (a preset) for ``prompts``, one after
    another."""
    built = build_engine(model, _options(1, SPEC_K, 0, "float64"))
    tokens, drafts = [], []
    async with built.engine:
        for p in prompts:
            g = built.engine.generate(p, max_tokens=MAX_TOKENS, spec_k=SPEC_K)
            tokens.append(await g.collect())
            drafts.append(list(g.request.draft_history))
    return tokens, drafts


async def run_disaggregated(router: Any, parts: dict[str, Any]) -> tuple[Result, list[Any]]:
    """Every prompt through ``router`` at once, after poisoning the receiver's free pages and slots (a correct
    transfer, bounced or not, overwrites all it uses); the result to compare with :func:`aggregated`, and each
    request's transfer. Returns once the generation engine is idle."""
    gen = parts["gen"]
    for arena in gen.arenas:
        for group in arena.layout.pool_groups:  # attention (K/V or latent), draft, mamba2 or kda
            arena.fill_garbage(group.name, list(range(1, group.num_slots)), seed=4)
    routed = [router.generate(p, max_tokens=MAX_TOKENS, spec_k=SPEC_K) for p in PROMPTS]
    got: list[list[int]] = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        got[i] = await routed[i].collect()

    async with anyio.create_task_group() as tg:  # concurrent: leases of several transfers overlap
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    await gen.engine.wait_idle()
    return (got, [r.draft_history for r in routed]), [r.transfer for r in routed]
