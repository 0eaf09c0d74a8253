"""Whole KimiLinear transfers (tiny-kimi: KDA state, MLA latent pages, draft KV) across the real session code and
real transports, between every TP pair of 1, 2 and 4: bit-exact, every receiver rank's latent the sender's, each
KDA conv section ``[q|k|v]`` and SSM head from the rank that holds it, poisoned receiver memory overwritten.

Over ``local`` the whole matrix runs in the default suite; ``nixl`` and ``ucx`` (two transports of this process)
run a few pairs there and the rest in the slow suite, as the NemotronH role tests do."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvferry.disagg.link import pump
from kvferry.disagg.session import SendSession
from kvferry.disagg.transfer import ManagerHold
from tests.support.disagg_harness import Side, connected, latents, make_side, tiny_spec, whole_cache
from tests.support.disagg_session import PROMPT, plan_for, receiver_for, send_when_asked, writers

pytestmark = pytest.mark.timeout(120)

PAIRS = [(c, g) for c in (1, 2, 4) for g in (1, 2, 4)]
#: in the default (CI) suite besides every local case; the rest of PAIRS x {nixl, ucx} is the slow suite
CI = {(1, 1, "nixl"), (4, 2, "nixl"), (2, 1, "ucx"), (1, 4, "ucx")}
MATRIX = [
    pytest.param(
        c, g, t, marks=() if t == "local" or (c, g, t) in CI else pytest.mark.slow, id=f"{c}-{g}-{t}"
    )
    for c, g in PAIRS
    for t in ("local", "nixl", "ucx")
]


def _poison(gen: Side, rid: str) -> None:
    for arena, m in zip(gen.arenas, gen.managers, strict=True):
        arena.fill_garbage("attention", list(m.block_table(rid)), seed=99)
        if m.config.has_draft:
            arena.fill_garbage("draft", list(m.draft_block_table(rid)), seed=98)
        slot = m.slot_id(rid)
        assert slot is not None
        arena.fill_garbage("kda", [slot], seed=97)


async def _transfer(ctx: Side, gen: Side, transport: str, chunk_bytes: int | None) -> int:
    """Push ctx's request "c" into gen's "g" (poisoned first) over ``transport``; the bytes moved."""
    async with connected(ctx, gen, transport) as (to_gen, to_ctx):
        assert gen.transport is not None and ctx.transport is not None
        receiver = receiver_for(ctx, gen, to_ctx)
        gen.create("g", PROMPT)
        _poison(gen, "g")
        session = receiver.new_session("r", ManagerHold(gen.managers, "g"))
        request, plan = plan_for(ctx, gen, session.session_id, max_chunk_bytes=chunk_bytes)
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(pump, gen.transport, to_ctx, receiver)
                tg.start_soon(send_when_asked, ctx.transport, to_gen, SendSession(session.session_id, plan))
                stats = await receiver.receive(session, request)
                tg.cancel_scope.cancel()
        assert stats.writers == len(writers(ctx, gen)) and receiver.statistics()["sessions"] == 0
        return stats.nbytes


def _check(ctx: Side, gen: Side, *, draft: bool) -> None:
    src, dst = (
        whole_cache(ctx, "c", len(PROMPT), draft=draft),
        whole_cache(gen, "g", len(PROMPT), draft=draft),
    )
    assert src.keys() == dst.keys()
    kda = ctx.spec.kda
    assert kda is not None
    for layer in ctx.spec.layer_ids(ctx.spec.layer_kinds[0]):  # KDA layers: q, k, v sections, SSM
        for section in range(3):
            key = f"{layer}.conv{section}"
            assert src[key].shape[0] == kda.num_heads * kda.head_dim, key
            assert torch.equal(src[key], dst[key]), key
    for key in src:
        assert not (src[key] == -12345).all(-1).any(), key  # every element assembled from some rank
        assert torch.equal(src[key], dst[key]), key
    assert any(k.endswith(".latent") for k in src) and any(k.endswith(".ssm") for k in src)
    assert any(k.endswith(".k") for k in src) == draft
    # the latent on every receiver rank equals the sender's (every sender rank holds the same)
    sent = latents(ctx, "c", len(PROMPT))
    assert all(r.keys() == sent[0].keys() and all(torch.equal(r[k], sent[0][k]) for k in r) for r in sent)
    for rank, got in enumerate(latents(gen, "g", len(PROMPT))):
        for layer, latent in got.items():
            assert torch.equal(latent, sent[0][layer]), (rank, layer)


@pytest.mark.parametrize("drafter", [True, False], ids=["draft", "no-draft"])
@pytest.mark.parametrize(("ctx_tp", "gen_tp", "transport"), MATRIX)
@pytest.mark.anyio
async def test_kimi_transfer_is_bit_exact(ctx_tp: int, gen_tp: int, transport: str, drafter: bool) -> None:
    spec = tiny_spec(model="tiny-kimi", drafter=drafter)
    ctx, gen = make_side(spec, ctx_tp), make_side(spec, gen_tp)
    ctx.fake_prefill("c", PROMPT, seed=11)
    before = gen.free_counts()
    await _transfer(ctx, gen, transport, chunk_bytes=None)
    _check(ctx, gen, draft=drafter)
    ManagerHold(gen.managers, "g").free()
    assert gen.free_counts() == before


@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 4), (4, 1), (2, 4)])
@pytest.mark.anyio
async def test_kimi_transfer_in_many_chunks(ctx_tp: int, gen_tp: int) -> None:
    spec = tiny_spec(model="tiny-kimi")
    ctx, gen = make_side(spec, ctx_tp), make_side(spec, gen_tp)
    ctx.fake_prefill("c", PROMPT, seed=3)
    await _transfer(ctx, gen, "local", chunk_bytes=2048)
    _check(ctx, gen, draft=True)


@pytest.mark.anyio
async def test_a_receiver_without_a_drafter_takes_the_rest() -> None:
    ctx, gen = (
        make_side(tiny_spec(model="tiny-kimi"), 2),
        make_side(tiny_spec(model="tiny-kimi", drafter=False), 4),
    )
    ctx.fake_prefill("c", PROMPT, seed=5)
    await _transfer(ctx, gen, "local", chunk_bytes=None)
    _check(ctx, gen, draft=False)
