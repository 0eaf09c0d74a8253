"""A disaggregated engine pair under attack: the context engine in its own process and the generation engine in
this one, authenticated by a shared secret. Hostile processes attack both listeners, one attack after another;
after each, the pair serves the same prompts with the tokens of aggregated serving, the context process is
alive, and a flood left both within their caps."""

from __future__ import annotations

import os
from typing import Any

import anyio
import pytest

from kvferry.disagg.serve import _options, disaggregated
from kvferry.engine.runner import build_engine
from kvferry.transports.limits import ChannelLimits
from tests.support.attacks import SECRET, hostile, rss_bytes

pytestmark = pytest.mark.anyio

PROMPTS = [[5, 9, 14, 200, 3, 3, 77], [250, 1, 7], list(range(30, 70))]
MAX_TOKENS, SPEC_K = 6, 2
MiB = 1 << 20
#: (attack, hostile arguments, whether the hostile holds the secret)
ATTACKS: list[tuple[str, tuple[str, ...], bool]] = [
    ("message-first", (), False),
    ("huge-handshake", (), False),
    ("garbage", (), False),
    ("old-version", (), False),
    ("no-secret", (), False),
    ("wrong-secret", (), False),
    ("replay", (), True),
    ("region-overflow", (), True),
    ("many-refusals", ("--count", "100"), False),
    ("flood-notify", ("--megabytes", "256", "--seconds", "2"), True),
    ("flood-messages", ("--megabytes", "256", "--seconds", "2"), True),
]


async def aggregated() -> list[list[int]]:
    built = build_engine("tiny", _options(1, SPEC_K, 0, "float64"))
    async with built.engine:
        return [
            await built.engine.generate(p, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect() for p in PROMPTS
        ]


async def served(router: Any) -> list[list[int]]:
    with anyio.fail_after(60):
        return [await router.generate(p, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect() for p in PROMPTS]


@pytest.mark.parametrize("transport", ["nixl", "ucx"])
async def test_an_engine_pair_under_attack_serves_identical_tokens(transport: str) -> None:
    expected = await aggregated()
    async with disaggregated(transport=transport, spec_k=SPEC_K, secret=SECRET) as (router, parts):
        context = parts["context"]
        targets = {"generation": (parts["transport"], os.getpid()), "context": (context.address, context.pid)}
        assert await served(router) == expected
        for attack, args, with_secret in ATTACKS:
            for side, (where, pid) in targets.items():
                address = where if isinstance(where, str) else where.address
                rss = rss_bytes(pid)
                seen = await hostile(attack, address, *args, secret=with_secret)
                if attack.startswith("flood"):
                    # a peer nobody accepts: held to its per-peer cap, slowed down instead
                    assert seen["outcome"] == "accepted", (side, seen)
                    assert seen["sent_bytes"] < 192 * MiB, (side, seen)
                    assert rss_bytes(pid) - rss < ChannelLimits().max_peer_buffered_bytes + 64 * MiB, side
                elif attack != "many-refusals":
                    assert seen["outcome"].startswith(("refused", "closed")), (side, attack, seen)
                assert context.proc.poll() is None, f"{attack} against the {side} ended the context process"
                assert await served(router) == expected, f"tokens differ after {attack} against the {side}"
        stats = parts["transport"].statistics()
        assert stats.refused_connections >= 100 and stats.peers >= 1
