"""Engine roles end to end on the reference model: disaggregated tokens == aggregated, the handshake refuses an
incompatible peer, poisoned receiver pages change nothing, and accounting returns to the initial counts."""

from __future__ import annotations

from typing import Any

import anyio
import attrs
import pytest

from kvferry import wire
from kvferry.disagg.link import exchange_hello
from kvferry.disagg.protocol import ContextRequest, PeerRole, decode_hello, encode_hello
from kvferry.disagg.roles import GenerationWorker, Handoff
from kvferry.disagg.serve import _options, disaggregated
from kvferry.engine.runner import build_engine
from kvferry.errors import PeerIncompatible, WireFormatError
from kvferry.pools.pagetable import PageTable
from kvferry.transports import get_transport
from tests.support.disagg_reference import MAX_TOKENS, PROMPTS, SPEC_K, aggregated, run_disaggregated

pytestmark = pytest.mark.timeout(120)

PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
#: in the default (CI) suite; the rest of PAIRS x transports is the slow suite
CI = {(1, 1, "nixl"), (2, 1, "ucx"), (1, 2, "local"), (4, 2, "local")}
MATRIX = [
    pytest.param(c, g, t, marks=() if (c, g, t) in CI else pytest.mark.slow, id=f"{c}-{g}-{t}")
    for c, g in PAIRS
    for t in ("nixl", "ucx", "local")
]


@pytest.mark.parametrize(("ctx_tp", "gen_tp", "transport"), MATRIX)
@pytest.mark.anyio
async def test_disaggregated_tokens_and_proposals_equal_aggregated(
    ctx_tp: int, gen_tp: int, transport: str
) -> None:
    expected = await aggregated(PROMPTS)
    async with disaggregated(
        transport=transport, ctx_tp=ctx_tp, gen_tp=gen_tp, spec_k=SPEC_K, separate_process=False
    ) as (router, parts):
        gen, ctx = parts["gen"], parts["ctx"]
        gen_free = gen.cache.statistics()
        ctx_free = ctx.cache.statistics()
        got, _transfers = await run_disaggregated(router, parts)
        assert got == expected
        with anyio.fail_after(5):
            while parts["context"].statistics()["held"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        for before, now in ((gen_free, gen.cache.statistics()), (ctx_free, ctx.cache.statistics())):
            # snapshot slots are prefix cache (evictable), not held by anyone
            assert (now.pages_free, now.slots_free + now.slots_snapshot, now.quarantines) == (
                before.pages_free,
                before.slots_free + before.slots_snapshot,
                0,
            )
            assert (now.draft_pages_free, now.requests_active + now.requests_suspended) == (
                before.draft_pages_free,
                0,
            )
        assert len(parts["worker"].transfers()) == len(PROMPTS)
        assert not gen.runner._fed and not ctx.runner._fed


@pytest.mark.anyio
async def test_draft_kv_travels_and_is_not_recomputed() -> None:
    """The generation side drafts from the transferred draft KV: with it, proposals equal aggregated serving's;
    without it (pages left zero, nothing recomputed: the hand-off holds one hidden state), they differ and
    fewer drafts are accepted (the drafter's attention needs the prompt's draft KV), while the target's
    tokens stay the same."""
    expected_tokens, expected_drafts = await aggregated(PROMPTS)
    acceptance = {}
    async with disaggregated(transport="local", spec_k=SPEC_K, separate_process=False) as (router, parts):
        worker = parts["worker"]
        for transfer_draft in (True, False):
            worker.transfer_draft = transfer_draft
            drafted = accepted = 0
            for i, prompt in enumerate(PROMPTS):
                routed = router.generate(prompt, max_tokens=MAX_TOKENS, spec_k=SPEC_K)
                assert await routed.collect() == expected_tokens[i]
                if transfer_draft:
                    assert routed.draft_history == expected_drafts[i], (transfer_draft, i)
                else:
                    assert routed.draft_history != expected_drafts[i], i
                assert routed.generation is not None
                drafted += routed.generation.request.num_drafted
                accepted += routed.generation.request.num_accepted
            acceptance[transfer_draft] = accepted / drafted
            draft_bytes = [t.nbytes for t in worker.transfers()[-len(PROMPTS) :]]
            if transfer_draft:
                with_draft = draft_bytes
        # the draft pages of the prompt are what the transfer adds
        assert all(a > b for a, b in zip(with_draft, draft_bytes, strict=True))
    # both paths run either way (accepted and rejected drafts); leaving the draft KV behind costs acceptance
    assert 0.2 <= acceptance[True] <= 0.9, acceptance
    assert 0 < acceptance[False] <= acceptance[True] - 0.05, acceptance


@pytest.mark.anyio
async def test_a_malformed_hand_off_is_a_typed_error_and_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with disaggregated(transport="local", spec_k=SPEC_K, separate_process=False) as (router, parts):
        gen = parts["gen"]
        free = gen.cache.statistics()
        real = GenerationWorker.prefill_remote

        async def tampered(self: GenerationWorker, request: ContextRequest, link: Any = None) -> Handoff:
            handoff = await real(self, request, link)
            handoff.host_state = handoff.host_state[:-8]
            return handoff

        monkeypatch.setattr(GenerationWorker, "prefill_remote", tampered)
        with pytest.raises(WireFormatError):
            await router.generate(PROMPTS[0], max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
        monkeypatch.undo()
        with anyio.fail_after(5):
            while parts["context"].statistics()["held"]:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        await gen.engine.wait_idle()  # the failed request is freed at the engine's next step boundary
        now = gen.cache.statistics()
        assert (now.pages_free, now.draft_pages_free, now.requests_suspended) == (
            free.pages_free,
            free.draft_pages_free,
            0,
        )
        assert not gen.runner._fed
        # the engines keep serving. The context engine prefilled PROMPTS[0] before the hand-off failed, so
        # serving it again reuses that prefix there, whose draft KV is zero-filled by design (draft KV takes
        # no part in reuse): its tokens are exact, its proposals those of a drafter without that draft KV.
        routed = router.generate(PROMPTS[0], max_tokens=MAX_TOKENS, spec_k=SPEC_K)
        assert [await routed.collect()] == (await aggregated(PROMPTS[:1]))[0]
        # a prompt that was never served gets everything an aggregated engine gives, proposals included
        expected = await aggregated(PROMPTS[1:2])
        routed = router.generate(PROMPTS[1], max_tokens=MAX_TOKENS, spec_k=SPEC_K)
        assert ([await routed.collect()], [routed.draft_history]) == expected


def test_handshake_compares_hash_first() -> None:
    built = build_engine("tiny", _options(2, 0, 0, "float64"))
    tables = tuple(a.page_table() for a in built.arenas)
    from kvferry.disagg.protocol import Hello, PeerInfo

    info = PeerInfo(PeerRole.CONTEXT, "i", "local", "local://x:1", 2, tables)
    data = encode_hello(info)
    assert decode_hello(data, wire_version=wire.WIRE_VERSION, compat_hash=tables[0].compat_hash) == info
    with pytest.raises(PeerIncompatible):
        decode_hello(data, wire_version=wire.WIRE_VERSION, compat_hash="0" * 32)
    with pytest.raises(PeerIncompatible):
        decode_hello(data, wire_version=wire.WIRE_VERSION + 1, compat_hash=tables[0].compat_hash)
    # a mismatching envelope is refused before its (here: garbage) body is looked at
    garbage = wire.encode(Hello(wire.WIRE_VERSION, "f" * 32, b"\xc1not msgpack"))
    with pytest.raises(PeerIncompatible):
        decode_hello(garbage, wire_version=wire.WIRE_VERSION, compat_hash=tables[0].compat_hash)
    with pytest.raises(WireFormatError):
        decode_hello(
            wire.encode(Hello(wire.WIRE_VERSION, tables[0].compat_hash, b"\xc1")),
            wire_version=wire.WIRE_VERSION,
            compat_hash=tables[0].compat_hash,
        )
    lying = attrs.evolve(info, tp_size=3)
    with pytest.raises(WireFormatError):
        decode_hello(encode_hello(lying), wire_version=wire.WIRE_VERSION, compat_hash=tables[0].compat_hash)


@pytest.mark.anyio
async def test_incompatible_peer_is_refused_and_others_keep_working() -> None:
    ours = build_engine("tiny", _options(1, 0, 0, "float64"))
    other = build_engine("tiny", _options(1, 0, 0, "float32"))  # another dtype: another compatibility hash
    same = build_engine("tiny", _options(1, 0, 0, "float64"))

    def info(built: object, transport: object, role: PeerRole) -> object:
        from kvferry.disagg.protocol import PeerInfo

        tables = tuple(a.page_table() for a in built.arenas)  # type: ignore[attr-defined]
        return PeerInfo(role, "x", "local", transport.address, 1, tables)  # type: ignore[attr-defined]

    factory = get_transport("local")
    async with factory() as t_ours, factory() as t_other, factory() as t_same:
        bad_peer = await t_ours.connect(t_other.address)
        bad_back = await t_other.accept()
        good_peer = await t_ours.connect(t_same.address)
        good_back = await t_same.accept()
        results: dict[str, object] = {}

        async def side(name: str, transport: object, peer: object, local: object) -> None:
            try:
                results[name] = await exchange_hello(transport, peer, local)  # type: ignore[arg-type]
            except PeerIncompatible as exc:
                results[name] = exc

        async with anyio.create_task_group() as tg:
            tg.start_soon(side, "ours-bad", t_ours, bad_peer, info(ours, t_ours, PeerRole.GENERATION))
            tg.start_soon(side, "other", t_other, bad_back, info(other, t_other, PeerRole.CONTEXT))
            tg.start_soon(side, "ours-good", t_ours, good_peer, info(ours, t_ours, PeerRole.GENERATION))
            tg.start_soon(side, "same", t_same, good_back, info(same, t_same, PeerRole.CONTEXT))
        assert isinstance(results["ours-bad"], PeerIncompatible)
        assert isinstance(results["other"], PeerIncompatible)
        assert not isinstance(results["ours-good"], Exception)
        assert not isinstance(results["same"], Exception)
        await bad_peer.aclose()
        await t_ours.send_message(good_peer, b"still here")
        assert await t_same.receive_message(good_back) == b"still here"


_ = PageTable
