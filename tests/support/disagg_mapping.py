"""The mapping tests' models, arenas and slow reference: a logical whole-model cache written into sender arenas
element by element (plain torch indexing through the arenas' typed views, nothing of the mapper), receiver
arenas poisoned, and the mapping's fragments applied by translating addresses back into (pool tensor, offset)
and copying bytes. The expected receiver memory is the poisoned snapshot with the request's shard written by the
same slow reference: every byte must match, so both the written bytes and the untouched ones are checked."""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from kvferry.disagg.mapping import (
    BouncePolicy,
    PeerMap,
    RequestCache,
    TokenRange,
    TransferPlan,
)
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.pagetable import PageTable
from kvferry.pools.spec import LayerKind, ModelSpec, preset
from kvferry.transports._memory import GrantTable

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


def kimi(tokens_per_block: int = 4, draft_tokens_per_block: int = 8, *, drafter: bool = True) -> ModelSpec:
    """tiny-kimi (KDA state, MLA latent pages replicated on every rank, the tiny drafter) in float64."""
    spec = preset("tiny-kimi").with_dtype("float64")
    assert spec.drafter is not None
    return attrs.evolve(
        spec,
        tokens_per_block=tokens_per_block,
        drafter=attrs.evolve(spec.drafter, tokens_per_block=draft_tokens_per_block) if drafter else None,
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
    latent: dict[int, torch.Tensor] = attrs.Factory(dict)  # MLA layer -> [tokens, latent_dim]


def state_group(spec: ModelSpec) -> str:
    """The name of the model's recurrent state group."""
    return "kda" if spec.kda is not None else "mamba2"


def logical(spec: ModelSpec, tokens: int, seed: int) -> Logical:
    """A whole-model cache of ``tokens`` tokens: GQA K/V or MLA latents, Mamba2 or KDA state, draft K/V."""
    g = torch.Generator().manual_seed(seed)
    att, mla, d = spec.attention, spec.mla, spec.drafter
    assert d is not None

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    kv = {}
    latent = {}
    if att is not None:
        kv = {
            layer: (
                rand(tokens, att.num_kv_heads, att.head_dim),
                rand(tokens, att.num_kv_heads, att.head_dim),
            )
            for layer in spec.attention_layer_ids
        }
    if mla is not None:
        latent = {layer: rand(tokens, mla.latent_dim) for layer in spec.attention_layer_ids}
    kv.update(
        {
            layer: (rand(tokens, d.num_kv_heads, d.head_dim), rand(tokens, d.num_kv_heads, d.head_dim))
            for layer in d.global_layer_ids
        }
    )
    if spec.kda is not None:
        k = spec.kda
        layers = spec.layer_ids(LayerKind.KDA)
        conv = {layer: rand(3 * k.num_heads * k.head_dim, k.conv_kernel - 1) for layer in layers}
        ssm = {layer: rand(k.num_heads, k.head_dim, k.head_dim) for layer in layers}
    else:
        m = spec.mamba2
        assert m is not None
        layers = spec.layer_ids(LayerKind.MAMBA2)
        conv = {layer: rand(m.conv_dim, m.conv_kernel - 1) for layer in layers}
        ssm = {layer: rand(m.num_heads, m.head_dim, m.state_size) for layer in layers}
    return Logical(kv, conv, ssm, latent)


def conv_channels(arena: CacheArena) -> list[int]:
    """Whole-model conv channel of each of this rank's conv rows (sections x, B, C or q, k, v in order)."""
    group = arena.layout.layer_group(state_group(arena.layout.spec.model))
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
            if layer in cache.latent:  # MLA: the whole latent on every rank
                latent = arena.latent(layer)
                for t in range(lo, tokens.end):
                    latent[blocks[name][t // tpb], t % tpb, :] = cache.latent[layer][t, :]
                continue
            views = arena.kv(layer)
            for role in range(2):
                for t in range(lo, tokens.end):
                    page, pos = blocks[name][t // tpb], t % tpb
                    for i in range(heads.count):
                        views[role][page, i, pos, :] = cache.kv[layer][role][t, heads.first + i, :]
    if tokens.state:
        group = layout.layer_group(state_group(layout.spec.model))
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
        for name in ("attention", "draft", "mamba2", "kda"):
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
