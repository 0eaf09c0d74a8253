"""The aggregated reference for the engine-role tests: fixed prompts served by one tensor-parallel-1 float64
tiny engine, whose tokens and draft proposals disaggregated serving must reproduce."""

from __future__ import annotations

import random

from kvferry.engine.disagg.serve import _options
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


async def aggregated(prompts: list[list[int]]) -> Result:
    """Tokens and draft proposals of aggregated serving for ``prompts``, one after another."""
    built = build_engine("tiny", _options(1, SPEC_K, 0, "float64"))
    tokens, drafts = [], []
    async with built.engine:
        for p in prompts:
            g = built.engine.generate(p, max_tokens=MAX_TOKENS, spec_k=SPEC_K)
            tokens.append(await g.collect())
            drafts.append(list(g.request.draft_history))
    return tokens, drafts
