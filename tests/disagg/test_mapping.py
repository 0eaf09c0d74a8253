"""Rank maps and their plans: bit-exact resharding against a slow reference (:mod:`tests.support.disagg_mapping`),
bounces, merged runs, and the errors of incompatible peers and bad request ids."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.disagg.mapping import (
    BouncePolicy,
    MappingStatistics,
    PeerMap,
    RankMap,
    RequestCache,
    TokenRange,
)
from kvferry.errors import ConfigError, PeerIncompatible
from kvferry.pools.layout import CacheLayout
from kvferry.pools.pagetable import PageTable
from kvferry.pools.spec import ModelSpec, preset
from kvferry.transports.base import coalesce
from tests.support.disagg_mapping import (
    NUM_PAGES,
    NUM_SLOTS,
    PROMPT,
    TP_PAIRS,
    arenas,
    build,
    check,
    duplicated,
    tiny,
)

# --- bit-exact resharding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dst_drafter", [True, False], ids=["drafter", "no-drafter"])
@pytest.mark.parametrize("same_block_size", [True, False], ids=["same-tpb", "other-tpb"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
def test_bit_exact(
    src_tp: int, dst_tp: int, same_block_size: bool, dst_drafter: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvferry.disagg.mapping"):
        sc = build(
            src_tp,
            dst_tp,
            same_block_size=same_block_size,
            dst_drafter=dst_drafter,
            seed=src_tp * 10 + dst_tp,
        )
    warnings = [r for r in caplog.records if "draft" in r.getMessage()]
    assert len(warnings) == (0 if dst_drafter else 1)
    assert sc.peer.skipped == (() if dst_drafter else ("draft",))
    # receiver reused 7 tokens of the prompt: target pages move [7, 23), draft pages the whole prompt
    plans = check(sc, TokenRange(7, PROMPT), policy=BouncePolicy.never())
    stats = MappingStatistics.total(p.statistics for p in plans)
    groups = dict(stats.bytes_per_group)
    assert ("draft" in groups) == dst_drafter
    assert stats.bounced == 0 and stats.posted == stats.fragments <= stats.units
    check(sc, TokenRange(0, PROMPT), policy=BouncePolicy.never())


@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
def test_bit_exact_duplicated_heads(src_tp: int, dst_tp: int) -> None:
    sc = build(src_tp, dst_tp, model=duplicated, seed=3)
    check(sc, TokenRange(5, PROMPT))


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (2, 4), (4, 1), (1, 2)])
@pytest.mark.parametrize("same_block_size", [True, False], ids=["same-tpb", "other-tpb"])
def test_bounce_gives_identical_bytes(src_tp: int, dst_tp: int, same_block_size: bool) -> None:
    sc = build(src_tp, dst_tp, same_block_size=same_block_size, seed=5)
    plans = check(sc, TokenRange(3, PROMPT), bounce=True, policy=BouncePolicy.always())
    for p in plans:
        assert p.gather is not None and p.statistics.bounce
        assert p.statistics.posted == 1 and p.gather.nbytes == p.nbytes
        src, dst = p.staged_fragments(1000, 5000, chunk_bytes=1000)
        assert int(src[:, 1].sum()) == p.nbytes and src[0, 0] == 1000 and dst[0, 0] == 5000


def test_sender_without_drafter_leaves_receiver_draft_pages_alone(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvferry.disagg.mapping"):
        sc = build(2, 4, src_drafter=False, same_block_size=False, seed=11)
    assert len([r for r in caplog.records if "draft" in r.getMessage()]) == 1
    assert sc.peer.skipped == ("draft",)
    plans = check(sc, TokenRange(2, PROMPT))
    assert all("draft" not in dict(p.statistics.bytes_per_group) for p in plans)


def test_without_state_and_chunks() -> None:
    sc = build(2, 1, seed=9)
    # chunked: [0, 12) without state, then [12, 23) with it; draft moved with the first chunk only
    first = TokenRange(0, 12, draft_start=0, state=False)
    check(sc, first)
    last = TokenRange(12, PROMPT, draft_start=PROMPT)
    plans = check(sc, last)
    assert all("draft" not in dict(p.statistics.bytes_per_group) for p in plans)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    pair=st.sampled_from(TP_PAIRS),
    same=st.booleans(),
    seed=st.integers(0, 1 << 20),
    start=st.integers(0, PROMPT),
    state=st.booleans(),
)
def test_random_block_ids(pair: tuple[int, int], same: bool, seed: int, start: int, state: bool) -> None:
    sc = build(*pair, same_block_size=same, seed=seed)
    rng = np.random.default_rng(seed + 1)
    end = int(rng.integers(start, PROMPT + 1))
    tokens = TokenRange(start, end, draft_start=int(rng.integers(0, end + 1)), state=state)
    check(sc, tokens, bounce=bool(seed % 2), policy=BouncePolicy(min_fragments=seed % 40))


# --- merging -----------------------------------------------------------------------------------------------


def test_same_tp_merges_whole_pages_and_runs() -> None:
    spec = tiny()
    src, dst = arenas(spec, 1), arenas(spec, 1)
    pair = RankMap.build(src[0].page_table(), dst[0].page_table())
    # 16 tokens = 4 target pages, 2 draft pages; sender pages 3..6 contiguous, receiver 10..11 and 0..1
    src_req = RequestCache({"attention": [3, 4, 5, 6], "draft": [1, 2]}, slot=1)
    dst_req = RequestCache({"attention": [10, 11, 0, 1], "draft": [7, 9]}, slot=2)
    plan = pair.plan(src_req, dst_req, TokenRange(0, 16), policy=BouncePolicy.never())
    att_page = src[0].layout.page_bytes("attention")
    draft_page = src[0].layout.page_bytes("draft")
    lengths = plan.src[:, 1].tolist()
    # attention: two runs of two pages; draft: two single pages; state: conv pool, SSM pool (one run each)
    conv = src[0].layout.pool_group("mamba2").pools
    assert lengths[:4] == [2 * att_page, 2 * att_page, draft_page, draft_page]
    assert len(conv) == 2 and len(lengths) == 6
    assert plan.statistics.units > plan.statistics.fragments == 6


def unmerged_units(pair: RankMap, src: RequestCache, dst: RequestCache, tokens: TokenRange) -> Any:
    """One row per (page segment, piece) or state piece in canonical order, straight from the pieces: no merging
    within a page or slot (the reference for the precomputed runs)."""
    rows: list[tuple[int, int, int]] = []
    for g in pair.groups:
        if g.kind.value == "paged":
            lo = tokens.draft_start if g.draft else tokens.start
            a, b = g.src_tokens_per_block, g.dst_tokens_per_block
            cuts = sorted({lo, tokens.end, *range(0, tokens.end, a), *range(0, tokens.end, b)})
            segments = [(x, y) for x, y in itertools.pairwise(cuts) if x >= lo]
            for x, y in segments:
                for i in range(g.num_pieces):
                    hb = int(g.length[i])
                    s_page, d_page = (
                        int(src.blocks[g.src_group][x // a]),
                        int(dst.blocks[g.dst_group][x // b]),
                    )
                    rows.append(
                        (
                            int(g.src.base[i]) + s_page * int(g.src.stride[i]) + (x % a) * hb,
                            int(g.dst.base[i]) + d_page * int(g.dst.stride[i]) + (x % b) * hb,
                            (y - x) * hb,
                        )
                    )
        elif tokens.state:
            assert src.slot is not None and dst.slot is not None
            rows.extend(
                (
                    int(g.src.base[i]) + src.slot * int(g.src.stride[i]),
                    int(g.dst.base[i]) + dst.slot * int(g.dst.stride[i]),
                    int(g.length[i]),
                )
                for i in range(g.num_pieces)
            )
    return np.asarray(rows, dtype=np.uint64).reshape(-1, 3)


@settings(max_examples=30, deadline=None)
@given(
    pair=st.sampled_from(TP_PAIRS),
    tpb=st.sampled_from([(4, 8), (4, 4), (3, 8), (8, 4)]),
    contiguous=st.booleans(),
    seed=st.integers(0, 1 << 20),
    state=st.booleans(),
)
def test_runs_equal_coalesced_pieces(
    pair: tuple[int, int], tpb: tuple[int, int], contiguous: bool, seed: int, state: bool
) -> None:
    """Pieces merged once per pair (:meth:`_GroupMap.runs`) give exactly the fragments, unit count and staging
    layout of coalescing every (page segment, piece) unit of the request."""
    src_tp, dst_tp = pair
    src_spec, dst_spec = tiny(*tpb), tiny(4, 8)
    s_tables = [a.page_table() for a in arenas(src_spec, src_tp)]
    d_tables = [a.page_table() for a in arenas(dst_spec, dst_tp)]
    peer = PeerMap.build(s_tables, d_tables)
    rng = np.random.default_rng(seed)
    end = int(rng.integers(1, PROMPT + 1))
    tokens = TokenRange(
        int(rng.integers(0, end)), end, draft_start=int(rng.integers(0, end + 1)), state=state
    )

    def ids(spec: ModelSpec) -> dict[str, list[int]]:
        assert spec.drafter is not None
        out = {}
        for name, tpb_ in (("attention", spec.tokens_per_block), ("draft", spec.drafter.tokens_per_block)):
            need = -(-end // tpb_)
            out[name] = (np.arange(need) + 1 if contiguous else rng.permutation(NUM_PAGES)[:need]).tolist()
        return out

    src, dst = RequestCache(ids(src_spec), slot=1), RequestCache(ids(dst_spec), slot=3)
    for s in range(src_tp):
        for d in peer.targets(s):
            rank_pair = peer.pair(s, d)
            plan = rank_pair.plan(src, dst, tokens, policy=BouncePolicy.always())
            units = unmerged_units(rank_pair, src, dst, tokens)
            ref_src, ref_dst = coalesce(
                np.ascontiguousarray(units[:, [0, 2]]), np.ascontiguousarray(units[:, [1, 2]])
            )
            assert np.array_equal(plan.src, ref_src) and np.array_equal(plan.dst, ref_dst)
            assert plan.statistics.units == len(units) and plan.nbytes == int(units[:, 2].sum())
            # staging order: the gather plan packs every unit's source bytes back to back, in unit order
            assert plan.gather is not None or not len(units)
            if plan.gather is not None:
                bases = dict(zip(rank_pair._src_pools, rank_pair._src_bases.tolist(), strict=True))
                packed = [
                    (bases[seg.pool] + int(off), int(n))
                    for seg in plan.gather.segments
                    for off, n in seg.fragments
                ]
                assert merged(packed) == merged([(int(a), int(n)) for a, _, n in units])


def merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for address, length in ranges:
        if out and sum(out[-1]) == address:
            out[-1] = (out[-1][0], out[-1][1] + length)
        else:
            out.append((address, length))
    return out


def test_tp_mismatch_fragment_per_page_layer_role() -> None:
    spec = tiny()
    src, dst = arenas(spec, 1), arenas(spec, 2)
    pair = RankMap.build(src[0].page_table(), dst[1].page_table())
    req = RequestCache({"attention": [1, 2, 3], "draft": [1, 2]}, slot=1)
    plan = pair.plan(req, req, TokenRange(0, 12, state=False), policy=BouncePolicy.never())
    # target: 3 pages x 2 layers x K/V, two heads each; draft: a full page per K/V, then 4 tokens per head
    head_bytes = 16 * 8
    assert (
        plan.src[:, 1].tolist() == [2 * 4 * head_bytes] * 12 + [2 * 8 * head_bytes] * 2 + [4 * head_bytes] * 4
    )


# --- errors ------------------------------------------------------------------------------------------------


def test_model_mismatch_is_peer_incompatible() -> None:
    a = arenas(tiny(), 1, num_pages=4)[0].page_table()
    other = preset("tiny").with_dtype("float32")
    b = arenas(other, 1, num_pages=4)[0].page_table()
    with pytest.raises(PeerIncompatible):
        PeerMap.build([a], [b])
    # same hash but another shape (a corrupt or lying peer): the group comparison catches it
    c = arenas(duplicated(), 1, num_pages=4)[0].page_table()
    with pytest.raises(PeerIncompatible):
        RankMap.build(a, attrs.evolve(c, compat_hash=a.compat_hash))


def test_bad_request_ids_raise_config_error() -> None:
    spec = tiny()
    pair = RankMap.build(arenas(spec, 1)[0].page_table(), arenas(spec, 2)[0].page_table())
    good = RequestCache({"attention": [1, 2, 3], "draft": [1, 2]}, slot=1)
    tokens = TokenRange(0, 12)
    for bad in (
        RequestCache({"attention": [1, 2], "draft": [1, 2]}, slot=1),  # too few pages
        RequestCache({"attention": [1, 2, NUM_PAGES], "draft": [1, 2]}, slot=1),  # out of range
        RequestCache({"attention": [1, 2, 1], "draft": [1, 2]}, slot=1),  # repeated destination
        RequestCache({"attention": [1, 2, 3]}, slot=1),  # no draft ids
        RequestCache({"attention": [1, 2, 3], "draft": [1, 2]}, slot=NUM_SLOTS),
        RequestCache({"attention": [1, 2, 3], "draft": [1, 2]}),
    ):
        with pytest.raises(ConfigError):
            pair.plan(good, bad, tokens)
        with pytest.raises(ConfigError):
            pair.indexed_write(good, bad, tokens)
        with pytest.raises(ConfigError):
            pair.destinations(bad, tokens)
    with pytest.raises(ConfigError):
        TokenRange(5, 4)
    with pytest.raises(ConfigError):
        RequestCache({"attention": [1.5]})


# --- realistic size ----------------------------------------------------------------------------------------


def fake_tables(spec: ModelSpec, tp: int, num_pages: int, num_slots: int) -> Iterator[PageTable]:
    address = 1 << 32
    for rank in range(tp):
        layout = CacheLayout.build(
            spec.shard(tp, rank), num_pages=num_pages, num_slots=num_slots, num_draft_pages=num_pages
        )
        bases = {}
        for _g, pool in layout.pools():
            bases[pool.name] = address
            address += pool.nbytes + 4096
        yield PageTable.from_layout(layout, bases)


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (2, 4), (4, 2)])
def test_nemotron_8k_prompt_counts(src_tp: int, dst_tp: int) -> None:
    spec = preset("nemotron-h-8b")
    tokens = 8192
    peer = PeerMap.build(list(fake_tables(spec, src_tp, 600, 4)), list(fake_tables(spec, dst_tp, 600, 4)))
    rng = np.random.default_rng(0)
    # even page ids only: no two pages of a request are adjacent, so same-TP merging stops at every page
    src = RequestCache(
        {"attention": 2 * rng.permutation(300)[:256], "draft": 2 * rng.permutation(300)[:128]}, slot=1
    )
    dst = RequestCache(
        {"attention": 2 * rng.permutation(300)[:256], "draft": 2 * rng.permutation(300)[:128]}, slot=2
    )
    began = time.perf_counter()
    plans = [
        peer.pair(s, d).plan(src, dst, TokenRange(0, tokens)) for s in range(src_tp) for d in peer.targets(s)
    ]
    elapsed = time.perf_counter() - began
    stats = MappingStatistics.total(p.statistics for p in plans)
    # whole-model bytes: 4 attention layers + 1 draft layer of K/V for 8192 tokens, 24 Mamba layers' state
    kv = 5 * 2 * 8 * 128 * 2 * tokens
    conv = 24 * (128 * 64 + 2 * 8 * 128) * 3 * 2
    ssm = 24 * 128 * 64 * 128 * 4
    assert stats.nbytes == kv + conv + ssm
    if src_tp == dst_tp:
        # one fragment per page (all layers, K and V) + one run per state pool
        assert stats.fragments == src_tp * (256 + 128 + 2)
    print(f"tp {src_tp}->{dst_tp}: {len(plans)} plans, {stats}, {elapsed * 1e3:.1f} ms")
