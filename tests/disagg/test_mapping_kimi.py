"""KimiLinear caches between TP sizes: MLA latent pages (one replicated "head", written once per receiver rank by
one elected sender rank), KDA conv windows by section ``[q|k|v]`` and heads, KDA SSM state by heads, draft KV
as for NemotronH; bit-exact against the slow reference of :mod:`tests.support.disagg_mapping`."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence

import anyio
import attrs
import pytest
import torch

from kvferry.disagg.link import exchange_hello
from kvferry.disagg.mapping import (
    BouncePolicy,
    MappingStatistics,
    PeerMap,
    RankMap,
    RequestCache,
    TokenRange,
    elected,
)
from kvferry.disagg.mapping.compat import explain
from kvferry.disagg.protocol import PeerInfo, PeerRole, check_pairing
from kvferry.errors import PeerIncompatible
from kvferry.pools.layout import LayerGroup, Role
from kvferry.pools.pagetable import PageTable
from kvferry.pools.spec import AttentionSpec, ModelSpec
from kvferry.transports import Peer, Transport, get_transport
from kvferry.transports.base import Fragments
from tests.support.disagg_mapping import PROMPT, TP_PAIRS, Memory, arenas, build, check, kimi, tiny

# --- bit-exact resharding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("drafter", [True, False], ids=["drafter", "no-drafter"])
@pytest.mark.parametrize("same_block_size", [True, False], ids=["same-tpb", "other-tpb"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
def test_bit_exact(
    src_tp: int, dst_tp: int, same_block_size: bool, drafter: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvferry.disagg.mapping"):
        sc = build(
            src_tp,
            dst_tp,
            model=kimi,
            same_block_size=same_block_size,
            dst_drafter=drafter,
            src_drafter=drafter,
            seed=src_tp * 10 + dst_tp,
        )
    assert not [r for r in caplog.records if "draft" in r.getMessage()]  # both sides alike: nothing skipped
    for tokens in (TokenRange(7, PROMPT), TokenRange(0, PROMPT)):
        plans = check(sc, tokens, policy=BouncePolicy.never())
        groups = dict(MappingStatistics.total(p.statistics for p in plans).bytes_per_group)
        assert set(groups) == ({"attention", "kda", "draft"} if drafter else {"attention", "kda"})
        # the latent reaches every receiver rank whole: tp copies of [tokens, latent_dim] per MLA layer
        mla = sc.src_spec.mla
        assert mla is not None
        latent = len(sc.src_spec.attention_layer_ids) * mla.latent_bytes_per_token()
        assert groups["attention"] == dst_tp * (tokens.end - tokens.start) * latent


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (1, 4), (4, 1), (2, 4), (4, 2)])
def test_bounce_gives_identical_bytes(src_tp: int, dst_tp: int) -> None:
    sc = build(src_tp, dst_tp, model=kimi, same_block_size=False, seed=5)
    plans = check(sc, TokenRange(3, PROMPT), bounce=True, policy=BouncePolicy.always())
    assert all(p.gather is not None for p in plans if p.nbytes)


def test_a_sender_without_drafter_leaves_the_receivers_draft_pages_alone() -> None:
    sc = build(2, 4, model=kimi, src_drafter=False, seed=11)
    assert sc.peer.skipped == ("draft",)
    plans = check(sc, TokenRange(2, PROMPT))
    assert all("draft" not in dict(p.statistics.bytes_per_group) for p in plans)


def test_state_alone_and_chunks() -> None:
    sc = build(4, 2, model=kimi, seed=9)
    check(sc, TokenRange(0, 12, state=False))
    plans = check(sc, TokenRange(12, PROMPT, draft_start=PROMPT))
    assert all("draft" not in dict(p.statistics.bytes_per_group) for p in plans)
    plans = check(sc, TokenRange(PROMPT, PROMPT, draft_start=PROMPT))  # the state slot alone
    assert {g for p in plans for g, _ in p.statistics.bytes_per_group} == {"kda"}


# --- who writes the latent ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
def test_each_receiver_rank_gets_the_latent_from_one_elected_sender_rank(src_tp: int, dst_tp: int) -> None:
    """Sender replicas hold different latents here (each rank's tagged with its rank), so every receiver rank's
    latent pages tell which sender rank wrote them: exactly the one :func:`elected` names, which overlaps it;
    no other sender rank plans a latent byte for that receiver rank, and no byte is written twice."""
    assert sorted(TP_PAIRS) == sorted((a, b) for a in (1, 2, 4) for b in (1, 2, 4))
    sc = build(src_tp, dst_tp, model=kimi, seed=1)
    src_req, dst_req = sc.requests()
    tokens = TokenRange(0, PROMPT)
    layers = sc.src_spec.attention_layer_ids
    for s, arena in enumerate(sc.src):
        for layer in layers:
            arena.latent(layer).fill_(float(100 + s))
    for arena in sc.dst:
        for layer in layers:
            arena.latent(layer).fill_(-1.0)
    memory = Memory(sc.src + sc.dst)
    for d in range(dst_tp):
        writers = []
        for s in sc.peer.expected_writers(d):
            pair = sc.peer.pair(s, d)
            (group,) = (g for g in pair.groups if g.src_group == "attention")
            src_heads = sc.src[s].layout.layer_group("attention").heads
            dst_heads = sc.dst[d].layout.layer_group("attention").heads
            assert (src_heads.total, src_heads.replicas, dst_heads.replicas) == (1, src_tp, dst_tp)
            assert (group.num_pieces > 0) == elected(src_heads, s, dst_heads, d)
            if group.num_pieces:
                writers.append(s)
            memory.copy(*_group_fragments(pair, src_req, dst_req, tokens, "attention"))
        assert len(writers) == 1, (d, writers)
        pages = sc.dst_blocks["attention"][: -(-PROMPT // sc.dst_spec.tokens_per_block)]
        for layer in layers:
            got = sc.dst[d].latent(layer)[pages].reshape(-1, sc.dst[d].latent(layer).shape[-1])[:PROMPT]
            assert torch.equal(got, torch.full_like(got, float(100 + writers[0]))), (d, layer)
    # with tp 4 -> 2, receiver rank 1 reads from sender rank 2 (the replica whose share holds its start)
    if (src_tp, dst_tp) == (4, 2):
        assert [sc.peer.pair(s, 1).writes for s in (2, 3)] == [True, True]
        assert [g.num_pieces for g in sc.peer.pair(3, 1).groups if g.src_group == "attention"] == [0]


def _group_fragments(
    pair: RankMap, src: RequestCache, dst: RequestCache, tokens: TokenRange, name: str
) -> tuple[Fragments, Fragments]:
    """The fragments of one group's pieces only (a rank map of that group alone)."""
    only = attrs.evolve(pair, groups=tuple(g for g in pair.groups if g.src_group == name))
    plan = only.plan(src, dst, tokens, policy=BouncePolicy.never())
    return plan.src, plan.dst


# --- KDA state by section and heads ------------------------------------------------------------------------


@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
def test_kda_conv_moves_section_by_section(src_tp: int, dst_tp: int) -> None:
    """Each KDA conv piece lies inside one section (q, k or v) on both sides and carries the same channels of
    it there; the receiver rank's channels of every section are covered once; SSM pieces move whole heads."""
    sc = build(src_tp, dst_tp, model=kimi, seed=2)
    kda = sc.src_spec.kda
    assert kda is not None
    width = kda.num_heads * kda.head_dim  # channels of one section
    channel = 8  # float64
    for d in range(dst_tp):
        dst_group = sc.dst[d].layout.layer_group("kda")
        covered: dict[tuple[int, int], set[int]] = {
            (layer, sec): set() for layer in dst_group.layer_ids for sec in range(3)
        }
        heads: dict[int, set[int]] = {layer: set() for layer in dst_group.layer_ids}
        for s in sc.peer.expected_writers(d):
            src_group = sc.src[s].layout.layer_group("kda")
            src_table, dst_table = sc.src[s].page_table(), sc.dst[d].page_table()
            (g,) = (g for g in sc.peer.pair(s, d).groups if g.src_group == "kda")
            for i in range(g.num_pieces):
                hit = _locate(dst_table, dst_group, int(g.dst.base[i]))
                src_hit = _locate(src_table, src_group, int(g.src.base[i]))
                assert hit[:2] == src_hit[:2]  # same role, same layer
                role, layer, offset = hit
                n = int(g.length[i])
                if role is Role.CONV:
                    rows = dst_group.conv_kernel - 1
                    first, count = offset // (rows * channel), n // (rows * channel)
                    sec, at = divmod(first, dst_group.conv_sections[0].count)
                    s_first = src_hit[2] // (rows * channel)
                    s_sec, s_at = divmod(s_first, src_group.conv_sections[0].count)
                    assert sec == s_sec and at + count <= dst_group.conv_sections[sec].count
                    lo = dst_group.conv_sections[sec].first + at
                    assert lo == src_group.conv_sections[sec].first + s_at  # the same channels of the section
                    assert not covered[layer, sec] & set(range(lo, lo + count))
                    covered[layer, sec] |= set(range(lo, lo + count))
                else:
                    per_head = kda.head_dim * kda.head_dim * channel
                    assert offset % per_head == 0 and n % per_head == 0
                    first = dst_group.heads.first + offset // per_head
                    heads[layer] |= set(range(first, first + n // per_head))
        for (_layer, sec), channels in covered.items():
            shard = dst_group.conv_sections[sec]
            assert shard.total == width and channels == set(range(shard.first, shard.first + shard.count))
        for held in heads.values():
            assert held == set(range(dst_group.heads.first, dst_group.heads.first + dst_group.heads.count))


def _locate(table: PageTable, group: LayerGroup, address: int) -> tuple[Role, int, int]:
    """(role, layer, offset in the buffer) of a slot-0 address of a state group."""
    for layer in group.layer_ids:
        for role in group.roles:
            pool, entry = table.locate(layer, role)
            start = pool.base + pool.layer_ids.index(layer) * pool.layer_stride + entry.offset
            if start <= address < start + entry.nbytes:
                return role, layer, address - start
    raise AssertionError(f"address {address:#x} is in no buffer")


# --- pairs that cannot be resharded ------------------------------------------------------------------------


def _tables(spec: ModelSpec, tp: int) -> list[PageTable]:
    return [a.page_table() for a in arenas(spec, tp, num_pages=4)]


def _gqa() -> ModelSpec:
    """tiny-kimi with GQA attention layers (K/V pages) in place of MLA."""
    return attrs.evolve(kimi(), mla=None, attention=AttentionSpec(4, 2, 16, dtype="float64"))


def _wider_latent() -> ModelSpec:
    spec = kimi()
    assert spec.mla is not None
    return attrs.evolve(spec, mla=attrs.evolve(spec.mla, kv_lora_rank=48))


def _kda_heads(heads: int) -> ModelSpec:
    spec = kimi()
    assert spec.kda is not None
    return attrs.evolve(spec, kda=attrs.evolve(spec.kda, num_heads=heads))


REFUSED = [
    pytest.param(
        _gqa,
        kimi,
        (1, 2),
        "layer 2 is GQA attention (K/V pages) on the sender, MLA attention (latent pages) on the receiver",
        id="gqa-mla",
    ),
    pytest.param(
        kimi,
        _wider_latent,
        (2, 2),
        "MLA latent width: 40 on the sender, 56 on the receiver (layer 2)",
        id="latent-width",
    ),
    pytest.param(
        lambda: _kda_heads(6),
        kimi,
        (2, 4),
        "KDA heads: 6 on the sender, 4 on the receiver (layer 0); tp 4 on the receiver cannot split 6 KDA heads",
        id="kda-heads",
    ),
    pytest.param(
        tiny, kimi, (1, 1), "layer 0 is Mamba2 on the sender, KDA on the receiver", id="nemotron-kimi"
    ),
]


@pytest.mark.parametrize(("src_model", "dst_model", "tps", "why"), REFUSED)
def test_pairs_that_cannot_be_resharded_are_refused_saying_why(
    src_model: Callable[[], ModelSpec], dst_model: Callable[[], ModelSpec], tps: tuple[int, int], why: str
) -> None:
    src, dst = _tables(src_model(), tps[0]), _tables(dst_model(), tps[1])
    for build_map in (lambda: PeerMap.build(src, dst), lambda: RankMap.build(src[0], dst[0])):
        with pytest.raises(PeerIncompatible) as info:
            build_map()
        message = str(info.value)
        assert message == f"cannot reshard: {why}" and "\n" not in message


def _lying_tables() -> list[tuple[PageTable, str]]:
    """Tables of tiny-kimi whose shards their TP size does not give (same model hash: only the shards tell)."""
    tp2 = _tables(kimi(), 2)
    tp4 = _tables(kimi(), 4)

    def group(table: PageTable, name: str, **changes: object) -> PageTable:
        groups = tuple(
            attrs.evolve(g, **changes) if g.name == name else g  # type: ignore[arg-type]
            for g in table.layer_groups
        )
        return attrs.evolve(table, layer_groups=groups)

    kda = tp2[1].layer_group("kda")
    latent = tp2[1].layer_group("attention")
    return [
        (attrs.evolve(tp4[1], tp_size=3), "tp 3 cannot split 4 "),
        (attrs.evolve(tp4[3], tp_size=8, rank=7), "tp 8 cannot split 4 KDA heads"),
        (group(tp2[1], "kda", heads=attrs.evolve(kda.heads, first=0)), "holds heads [0, 2) of 4, tp 2 gives"),
        (
            group(tp2[1], "attention", heads=attrs.evolve(latent.heads, replicas=1)),
            "holds heads [0, 1) of 1, tp 2 gives [0, 1) of 1 x2",
        ),
        (
            group(
                tp2[1],
                "kda",
                conv_sections=(
                    kda.conv_sections[0],
                    *(attrs.evolve(s, first=0) for s in kda.conv_sections[1:]),
                ),
            ),
            "conv section 1 [0, 32) of 64 is not rank 1's share",
        ),
    ]


def test_shards_a_tp_size_does_not_give_are_refused() -> None:
    """A table that claims shards its own TP size cannot give (a KDA head count the TP size cannot split, heads
    of another rank, a latent held by fewer ranks than the TP size): resharding would trust them to elect one
    writer per byte, so the mapping refuses them whatever the hash says."""
    good = _tables(kimi(), 2)
    for table, why in _lying_tables():
        with pytest.raises(PeerIncompatible, match=re.escape(why)):
            RankMap.build(good[0], table)
        with pytest.raises(PeerIncompatible, match=re.escape(why)):
            RankMap.build(table, good[0])


# --- the same refusals in the handshake --------------------------------------------------------------------


def _info(spec: ModelSpec, tp: int, role: PeerRole, tables: Sequence[PageTable] | None = None) -> PeerInfo:
    tables = _tables(spec, tp) if tables is None else tables
    return PeerInfo(role, "i", "local", "local://x:1", tp, tuple(tables))


@pytest.mark.parametrize(("src_model", "dst_model", "tps", "why"), REFUSED)
@pytest.mark.anyio
async def test_the_handshake_says_why_a_peer_cannot_pair(
    src_model: Callable[[], ModelSpec], dst_model: Callable[[], ModelSpec], tps: tuple[int, int], why: str
) -> None:
    """Each side of a handshake over a real transport refuses the other with the reason (its hash differs: the
    body is decoded only to explain), and check_pairing says the same of two infos it is given."""
    context = _info(src_model(), tps[0], PeerRole.CONTEXT)
    generation = _info(dst_model(), tps[1], PeerRole.GENERATION)
    # the context side names its model "here"; the generation side compares the other way round
    mine = why.replace("on the sender", "here").replace("on the receiver", "on the peer")
    theirs = explain(generation.page_tables[0], context.page_tables[0])
    assert theirs is not None
    factory = get_transport("local")
    results: dict[str, object] = {}
    async with factory() as t_ctx, factory() as t_gen:
        to_gen = await t_ctx.connect(t_gen.address)
        to_ctx = await t_gen.accept()

        async def side(name: str, transport: Transport, peer: Peer, local: PeerInfo) -> None:
            try:
                results[name] = await exchange_hello(transport, peer, local)
            except PeerIncompatible as exc:
                results[name] = exc

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(side, "ctx", t_ctx, to_gen, context)
                tg.start_soon(side, "gen", t_gen, to_ctx, generation)
    assert isinstance(results["ctx"], PeerIncompatible) and isinstance(results["gen"], PeerIncompatible)
    assert str(results["ctx"]).endswith(f"): {mine}") and "\n" not in str(results["ctx"])
    assert str(results["gen"]).endswith(f"): {theirs}")
    with pytest.raises(PeerIncompatible) as info:
        check_pairing(context, generation)
    pairing_why = why.replace("on the sender", "on the context side").replace(
        "on the receiver", "on the generation side"
    )
    assert str(info.value) == f"the peers serve different models: {pairing_why}"


def test_pairing_refuses_shards_the_tp_size_does_not_give() -> None:
    good = _info(kimi(), 2, PeerRole.CONTEXT)
    for table, why in _lying_tables():
        tables = _tables(kimi(), table.tp_size) if table.tp_size in (1, 2, 4) else [table] * table.tp_size
        tables = [table if t.rank == table.rank else t for t in tables]
        lying = _info(kimi(), table.tp_size, PeerRole.GENERATION, tables)
        with pytest.raises(PeerIncompatible, match=re.escape(why)) as info:
            check_pairing(good, lying)
        assert "on the generation side" in str(info.value)
