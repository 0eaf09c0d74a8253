"""Mapping between peers: rank overlap, elected writers, and bit-exact resharding against a slow reference.

The oracle: a logical whole-model cache (per layer K/V ``[tokens, kv_heads, head_dim]``, conv ``[conv_dim, k-1]``,
SSM ``[heads, head_dim, state]``) is written into every sender rank's arena element by element through the
arena's typed views (plain torch indexing; nothing of the mapper). Receiver arenas are poisoned; the mapping's
fragments are applied by translating addresses back into (pool tensor, offset) and copying bytes. The expected
receiver memory is the poisoned snapshot with the request's shard written by the same slow reference: every byte
must match, so both the written bytes and the untouched ones are checked at once.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvferry.disagg.mapping import (
    BouncePolicy,
    MappingStatistics,
    PeerMap,
    RankMap,
    RequestCache,
    TokenRange,
    TransferPlan,
    elected,
    overlapping_ranks,
)
from kvferry.errors import ConfigError, PeerIncompatible
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.pagetable import PageTable
from kvferry.pools.spec import LayerKind, ModelSpec, preset, split_heads
from kvferry.transports._memory import GrantTable
from kvferry.transports.base import coalesce

TP_PAIRS = [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1), (2, 2), (4, 4)]
NUM_PAGES = 24
NUM_SLOTS = 5
PROMPT = 23


# --- models ------------------------------------------------------------------------------------------------


def tiny(tokens_per_block: int = 4, draft_tokens_per_block: int = 8, *, drafter: bool = True) -> ModelSpec:
    spec = preset("tiny").with_dtype("float64")
    assert spec.drafter is not None
    spec = attrs.evolve(
        spec,
        tokens_per_block=tokens_per_block,
        drafter=attrs.evolve(spec.drafter, tokens_per_block=draft_tokens_per_block) if drafter else None,
    )
    return spec


def duplicated(tokens_per_block: int = 4) -> ModelSpec:
    """kv heads 1 and Mamba groups 1: duplicated on every rank of TP 2 and 4; draft kv heads 2."""
    spec = tiny(tokens_per_block)
    assert spec.attention is not None and spec.mamba2 is not None and spec.drafter is not None
    return attrs.evolve(
        spec,
        attention=attrs.evolve(spec.attention, num_kv_heads=1),
        mamba2=attrs.evolve(spec.mamba2, num_groups=1),
        drafter=attrs.evolve(spec.drafter, num_kv_heads=2),
    )


def arenas(spec: ModelSpec, tp: int, *, num_pages: int = NUM_PAGES) -> list[CacheArena]:
    out = []
    for rank in range(tp):
        layout = CacheLayout.build(
            spec.shard(tp, rank),
            num_pages=num_pages,
            num_slots=NUM_SLOTS,
            num_draft_pages=num_pages if spec.drafter is not None else 0,
        )
        out.append(CacheArena(layout, "cpu"))
    return out


def table(arena: CacheArena) -> PageTable:
    # A receiver without a drafter serves the same target model: compat_hash leaves the drafter out.
    return arena.page_table()


# --- the logical cache and the slow reference --------------------------------------------------------------


@attrs.define
class Logical:
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> K, V [tokens, kv_heads, head_dim]
    conv: dict[int, torch.Tensor]  # layer -> [conv_dim, k - 1]
    ssm: dict[int, torch.Tensor]  # layer -> [heads, head_dim, state]


def logical(spec: ModelSpec, tokens: int, seed: int) -> Logical:
    g = torch.Generator().manual_seed(seed)
    att, m, d = spec.attention, spec.mamba2, spec.drafter
    assert att is not None and m is not None and d is not None

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    kv = {
        layer: (rand(tokens, att.num_kv_heads, att.head_dim), rand(tokens, att.num_kv_heads, att.head_dim))
        for layer in spec.attention_layer_ids
    }
    kv.update(
        {
            layer: (rand(tokens, d.num_kv_heads, d.head_dim), rand(tokens, d.num_kv_heads, d.head_dim))
            for layer in d.global_layer_ids
        }
    )
    mamba = spec.layer_ids(LayerKind.MAMBA2)
    conv = {layer: rand(m.conv_dim, m.conv_kernel - 1) for layer in mamba}
    ssm = {layer: rand(m.num_heads, m.head_dim, m.state_size) for layer in mamba}
    return Logical(kv, conv, ssm)


def conv_channels(arena: CacheArena) -> list[int]:
    """Whole-model conv channel of each of this rank's conv rows (sections x, B, C in order)."""
    group = arena.layout.layer_group("mamba2")
    out: list[int] = []
    section_start = 0
    for shard in group.conv_sections:
        out.extend(section_start + shard.first + i for i in range(shard.count))
        section_start += shard.total
    return out


def write_reference(
    arena: CacheArena,
    cache: Logical,
    blocks: dict[str, list[int]],
    slot: int,
    tokens: TokenRange,
    *,
    draft: bool = True,
) -> None:
    """Write the rank's shard of the logical cache for ``tokens`` into ``arena``, element by element."""
    layout = arena.layout
    for name in ("attention", "draft"):
        if not layout.has_group(name) or (name == "draft" and not draft):
            continue
        group = layout.layer_group(name)
        tpb, heads = group.tokens_per_block, group.heads
        lo = tokens.draft_start if name == "draft" else tokens.start
        for layer in group.layer_ids:
            views = arena.kv(layer)
            for role in range(2):
                for t in range(lo, tokens.end):
                    page, pos = blocks[name][t // tpb], t % tpb
                    for i in range(heads.count):
                        views[role][page, i, pos, :] = cache.kv[layer][role][t, heads.first + i, :]
    if tokens.state:
        group = layout.layer_group("mamba2")
        channels = conv_channels(arena)
        for layer in group.layer_ids:
            conv, ssm = arena.conv(layer), arena.ssm(layer)
            for row, channel in enumerate(channels):
                conv[slot, row, :] = cache.conv[layer][channel, :]
            for i in range(group.heads.count):
                ssm[slot, i] = cache.ssm[layer][group.heads.first + i]


def snapshot(arena: CacheArena) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in arena.pool_tensors().items()}


# --- applying fragments by copying bytes -------------------------------------------------------------------


class Memory:
    """Address -> (pool tensor, offset) over every pool of the given arenas (the tables' bases are data_ptrs)."""

    def __init__(self, all_arenas: list[CacheArena]) -> None:
        tensors = [t for a in all_arenas for t in a.pool_tensors().values()]
        tensors.sort(key=lambda t: t.data_ptr())
        self.tensors = tensors
        self.starts = np.array([t.data_ptr() for t in tensors], dtype=np.int64)

    def locate(self, address: int, length: int) -> tuple[torch.Tensor, int]:
        i = int(np.searchsorted(self.starts, address, side="right")) - 1
        assert i >= 0, f"address {address:#x} below every pool"
        tensor = self.tensors[i]
        offset = address - int(self.starts[i])
        assert offset >= 0 and offset + length <= tensor.numel(), (
            f"fragment {address:#x}+{length} leaves its pool"
        )
        return tensor, offset

    def copy(self, src: np.ndarray, dst: np.ndarray) -> None:
        assert src.shape == dst.shape and np.array_equal(src[:, 1], dst[:, 1])
        reads = []
        for s, n in src.tolist():
            tensor, offset = self.locate(s, n)
            reads.append(tensor[offset : offset + n].clone())
        for (d, n), data in zip(dst.tolist(), reads, strict=True):
            tensor, offset = self.locate(d, n)
            tensor[offset : offset + n] = data


def assert_disjoint(fragments: list[np.ndarray]) -> None:
    table = (
        np.concatenate([f.astype(np.int64) for f in fragments]) if fragments else np.zeros((0, 2), np.int64)
    )
    order = np.argsort(table[:, 0], kind="stable")
    starts, ends = table[order, 0], table[order, 0] + table[order, 1]
    assert not np.any(ends[:-1] > starts[1:]), "two writes reach the same destination byte"


# --- the scenario ------------------------------------------------------------------------------------------


@attrs.define
class Scenario:
    src_spec: ModelSpec
    dst_spec: ModelSpec
    src: list[CacheArena]
    dst: list[CacheArena]
    peer: PeerMap
    cache: Logical
    src_blocks: dict[str, list[int]]
    dst_blocks: dict[str, list[int]]
    src_slot: int
    dst_slot: int

    def requests(self) -> tuple[RequestCache, RequestCache]:
        return RequestCache(self.src_blocks, slot=self.src_slot), RequestCache(
            self.dst_blocks, slot=self.dst_slot
        )


def pick_blocks(rng: np.random.Generator, spec: ModelSpec, tokens: int) -> dict[str, list[int]]:
    out = {"attention": rng.permutation(NUM_PAGES)[: -(-tokens // spec.tokens_per_block)].tolist()}
    if spec.drafter is not None:
        out["draft"] = rng.permutation(NUM_PAGES)[: -(-tokens // spec.drafter.tokens_per_block)].tolist()
    return out


def build(
    src_tp: int,
    dst_tp: int,
    *,
    same_block_size: bool = True,
    dst_drafter: bool = True,
    src_drafter: bool = True,
    model: Any = tiny,
    seed: int = 0,
) -> Scenario:
    rng = np.random.default_rng(seed)
    full = src_spec = model()
    dst_spec = src_spec if same_block_size else attrs.evolve(src_spec, tokens_per_block=6)
    if not same_block_size:
        assert dst_spec.drafter is not None
        dst_spec = attrs.evolve(dst_spec, drafter=attrs.evolve(dst_spec.drafter, tokens_per_block=3))
    if not dst_drafter:
        dst_spec = dst_spec.without_drafter()
    if not src_drafter:
        src_spec = src_spec.without_drafter()
    src, dst = arenas(src_spec, src_tp), arenas(dst_spec, dst_tp)
    peer = PeerMap.build([table(a) for a in src], [table(a) for a in dst])
    return Scenario(
        src_spec,
        dst_spec,
        src,
        dst,
        peer,
        logical(full, PROMPT, seed),
        pick_blocks(rng, src_spec, PROMPT),
        pick_blocks(rng, dst_spec, PROMPT),
        int(rng.integers(0, NUM_SLOTS)),
        int(rng.integers(0, NUM_SLOTS)),
    )


def run_transfer(
    sc: Scenario, tokens: TokenRange, *, policy: BouncePolicy | None = None, bounce: bool = False
) -> tuple[list[TransferPlan], dict[int, list[np.ndarray]]]:
    """Fill senders by the reference and apply every pair's plan to the (poisoned) receivers. Returns the plans
    and the destination fragments per receiver rank."""
    for a in sc.src:
        for name in ("attention", "draft", "mamba2"):
            if a.layout.has_group(name):
                a.fill_garbage(name, range(a.layout.pool_group(name).num_slots), seed=7)
        write_reference(a, sc.cache, sc.src_blocks, sc.src_slot, attrs.evolve(tokens, start=0, draft_start=0))
    memory = Memory(sc.src + sc.dst)
    src_req, dst_req = sc.requests()
    plans = []
    written: dict[int, list[np.ndarray]] = {d: [] for d in range(len(sc.dst))}
    for s in range(len(sc.src)):
        for d in sc.peer.targets(s):
            plan = sc.peer.pair(s, d).plan(src_req, dst_req, tokens, policy=policy)
            plans.append(plan)
            # the same write as a template and ids: the same fragments once expanded
            indexed = sc.peer.pair(s, d).indexed_write(src_req, dst_req, tokens)
            if indexed is None:
                assert plan.empty
            else:
                assert indexed.nbytes == plan.nbytes
                assert all(map(np.array_equal, indexed.expand(), (plan.src, plan.dst)))
                # what the receiver grants this writer: exactly the bytes it writes
                granted = sc.peer.pair(s, d).destinations(dst_req, tokens)
                assert GrantTable(granted).ranges.tolist() == GrantTable(plan.dst).ranges.tolist()
            if bounce and plan.gather is not None:
                staging = torch.full((plan.nbytes + 16,), 0xEE, dtype=torch.uint8)
                packed = plan.gather.gather(sc.src[s].pool_tensors(), staging)
                receiver = sc.peer.pair(s, d).scatter_plan(dst_req, tokens)
                assert receiver.nbytes == plan.nbytes
                landed = torch.full((receiver.nbytes + 8,), 0x11, dtype=torch.uint8)
                landed[: plan.nbytes] = packed  # the one large write
                receiver.scatter(sc.dst[d].pool_tensors(), landed)
            else:
                memory.copy(plan.src, plan.dst)
            written[d].append(plan.dst)
    return plans, written


def expected_receivers(
    sc: Scenario, tokens: TokenRange, poisoned: list[dict[str, torch.Tensor]]
) -> list[dict[str, torch.Tensor]]:
    """Receiver memory as it must be: the poisoned snapshot plus the request's shard from the reference."""
    out = []
    for a, snap in zip(sc.dst, poisoned, strict=True):
        scratch = CacheArena(a.layout, "cpu")
        for name, t in scratch.pool_tensors().items():
            t.copy_(snap[name])
        draft = sc.src_spec.drafter is not None
        write_reference(scratch, sc.cache, sc.dst_blocks, sc.dst_slot, tokens, draft=draft)
        out.append(snapshot(scratch))
    return out


def check(
    sc: Scenario, tokens: TokenRange, *, bounce: bool = False, policy: BouncePolicy | None = None
) -> list[TransferPlan]:
    poisoned: list[dict[str, torch.Tensor]] = []
    for i, a in enumerate(sc.dst):
        for g in a.layout.pool_groups:
            a.fill_garbage(g.name, range(g.num_slots), seed=100 + i)
        poisoned.append(snapshot(a))
    expected = expected_receivers(sc, tokens, poisoned)
    plans, written = run_transfer(sc, tokens, policy=policy, bounce=bounce)
    for d, a in enumerate(sc.dst):
        assert_disjoint(written[d])
        for name, t in a.pool_tensors().items():
            assert torch.equal(t, expected[d][name]), f"receiver rank {d} pool {name} differs"
        total = sum(p.nbytes for p in plans if p.dst_rank == d)
        assert total == sum(int(f[:, 1].sum()) for f in written[d])
    return plans


# --- rank overlap ------------------------------------------------------------------------------------------


def test_overlapping_ranks_for_every_tp_pair() -> None:
    expected = {
        (1, 1): {0: [0]},
        (1, 2): {0: [0, 1]},
        (2, 1): {0: [0], 1: [0]},
        (2, 4): {0: [0, 1], 1: [2, 3]},
        (4, 2): {0: [0], 1: [0], 2: [1], 3: [1]},
        (1, 4): {0: [0, 1, 2, 3]},
        (4, 1): {0: [0], 1: [0], 2: [0], 3: [0]},
    }
    for (src_tp, dst_tp), targets in expected.items():
        for s, ds in targets.items():
            assert list(overlapping_ranks(src_tp, s, dst_tp)) == ds
        for d in range(dst_tp):
            writers = [s for s, ds in targets.items() if d in ds]
            assert list(overlapping_ranks(dst_tp, d, src_tp)) == writers
    with pytest.raises(ConfigError):
        overlapping_ranks(2, 2, 1)


@pytest.mark.parametrize("model", [tiny, duplicated], ids=["tiny", "duplicated"])
@pytest.mark.parametrize(("src_tp", "dst_tp"), TP_PAIRS)
def test_peer_map_tables(model: Any, src_tp: int, dst_tp: int) -> None:
    spec = model()
    src, dst = arenas(spec, src_tp, num_pages=4), arenas(spec, dst_tp, num_pages=4)
    peer = PeerMap.build([a.page_table() for a in src], [a.page_table() for a in dst])
    table_ = peer.overlap_table()
    for s in range(src_tp):
        for d in range(dst_tp):
            assert table_[s, d] == (d in peer.targets(s)) == (s in peer.expected_writers(d))
            # every byte-exchanging pair overlaps
            if peer.writes(s, d):
                assert table_[s, d]
    # equal TP sizes pair rank r with rank r only, even with duplicated heads
    if src_tp == dst_tp:
        assert [[peer.writes(s, d) for d in range(dst_tp)] for s in range(src_tp)] == np.eye(
            src_tp, dtype=bool
        ).tolist()
    # Mamba x heads are never duplicated: every overlapping pair exchanges bytes
    for s in range(src_tp):
        for d in peer.targets(s):
            assert peer.writes(s, d)
    assert peer.skipped == ()


def test_elected_writer_is_unique_per_head() -> None:
    for total in (1, 2, 4):
        for src_tp in (1, 2, 4):
            for dst_tp in (1, 2, 4):
                for d in range(dst_tp):
                    dh = split_heads(total, dst_tp, d)
                    for head in range(dh.first, dh.first + dh.count):
                        writers = [
                            s
                            for s in range(src_tp)
                            if (sh := split_heads(total, src_tp, s)).first <= head < sh.first + sh.count
                            and elected(sh, s, dh, d)
                        ]
                        assert len(writers) == 1
                        assert writers[0] in overlapping_ranks(dst_tp, d, src_tp)


def test_duplicated_fan_in_has_empty_writers() -> None:
    # attention-only view of the duplicated model: kv head 0 on all four sender ranks, one receiver rank
    spec = duplicated()
    src, dst = arenas(spec, 4, num_pages=4), arenas(spec, 1, num_pages=4)
    peer = PeerMap.build([a.page_table() for a in src], [a.page_table() for a in dst])
    assert peer.expected_writers(0) == (0, 1, 2, 3)
    attention = {
        s: next(g for g in peer.pair(s, 0).groups if g.src_group == "attention").num_pieces for s in range(4)
    }
    # 2 layers x K/V x 1 head, only from replica 0
    assert attention == {0: 4, 1: 0, 2: 0, 3: 0}


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
