"""Two sides of a transfer in one process: arenas and managers per rank, a transport each, hand-made prefills."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import torch
from attrs import define

from kvferry.disagg.protocol import BlockIds, PeerInfo, PeerRole, ReceiveRequest
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout, GroupKind, Role
from kvferry.pools.manager import CacheManager
from kvferry.pools.spec import ModelSpec, preset
from kvferry.transports import Peer, Registration, Transport, get_transport


def tiny_spec(*, drafter: bool = True, model: str = "tiny") -> ModelSpec:
    """A preset (the NemotronH reference ``tiny`` by default, or ``tiny-kimi``), with or without its drafter."""
    spec = preset(model)
    return spec if drafter else spec.without_drafter()


@define(eq=False)
class Side:
    spec: ModelSpec
    tp: int
    arenas: list[CacheArena]
    managers: list[CacheManager]
    transport: Transport | None = None
    registration: Registration | None = None

    @property
    def groups(self) -> list[str]:
        return [g.name for g in self.arenas[0].layout.pool_groups]

    def info(self, role: PeerRole) -> PeerInfo:
        assert self.transport is not None
        return PeerInfo(
            role,
            self.transport.instance_id if hasattr(self.transport, "instance_id") else "t",
            self.transport.name,
            self.transport.address,
            self.tp,
            tuple(a.page_table() for a in self.arenas),
        )

    def free_counts(self) -> tuple[tuple[int, int, int], ...]:
        out = []
        for m in self.managers:
            s = m.statistics()
            out.append((s.pages_free, s.slots_free, s.draft_pages_free))
        return tuple(out)

    def create(self, rid: object, prompt: Sequence[int]) -> None:
        for m in self.managers:
            m.create(rid, prompt, reuse=False)
            m.resume(rid)

    def fake_prefill(self, rid: object, prompt: Sequence[int], seed: int) -> None:
        """Allocate like a prefill and fill the request's pages and slot with seeded random bytes (each rank its
        own, except MLA latent pages: every rank holds the same latent, as a real prefill leaves it)."""
        self.create(rid, prompt)
        for rank, (m, arena) in enumerate(zip(self.managers, self.arenas, strict=True)):
            for group in self.arenas[0].layout.pool_groups:
                if group.kind is GroupKind.PAGED:
                    ids = m.draft_block_table(rid) if group.name == "draft" else m.block_table(rid)
                    latent = Role.LATENT in arena.layout.layer_group(group.name).roles
                    arena.fill_garbage(group.name, list(ids), seed=seed + (0 if latent else rank))
                else:
                    slot = m.slot_id(rid)
                    assert slot is not None
                    arena.fill_garbage(group.name, [slot], seed=seed + 100 + rank)
            m.commit(rid, prompt)

    def blocks(self, rid: object) -> dict[str, list[int]]:
        m = self.managers[0]
        out = {"attention": list(m.block_table(rid))}
        if m.config.has_draft:
            out["draft"] = list(m.draft_block_table(rid))
        return out

    def slot(self, rid: object) -> int:
        slot = self.managers[0].slot_id(rid)
        return 0 if slot is None else slot

    def receive_request(self, session_id: int, key: str, rid: object, num_tokens: int) -> ReceiveRequest:
        blocks = tuple(BlockIds(name, tuple(ids)) for name, ids in self.blocks(rid).items())
        return ReceiveRequest(session_id, key, 0, num_tokens, blocks, self.slot(rid))

    def read(self, rid: object, num_tokens: int) -> list[dict[str, torch.Tensor]]:
        """Per rank, per group: the request's bytes (pages covering num_tokens, or its slot)."""
        out = []
        for m, arena in zip(self.managers, self.arenas, strict=True):
            per: dict[str, torch.Tensor] = {}
            for group in arena.layout.pool_groups:
                if group.kind is GroupKind.PAGED:
                    tpb = arena.layout.layer_group(group.name).tokens_per_block
                    ids = m.draft_block_table(rid) if group.name == "draft" else m.block_table(rid)
                    ids = list(ids)[: math.ceil(num_tokens / tpb)]
                else:
                    slot = m.slot_id(rid)
                    assert slot is not None, rid
                    ids = [slot]
                per[group.name] = torch.cat(
                    [arena.pool_tensor(p.name).view(p.num_slots, -1)[ids].clone() for p in group.pools], 1
                )
            out.append(per)
        return out


def make_side(
    spec: ModelSpec, tp: int, *, num_pages: int = 40, num_slots: int = 6, num_draft_pages: int = 24
) -> Side:
    arenas, managers = [], []
    for rank in range(tp):
        layout = CacheLayout.build(
            spec.shard(tp, rank),
            num_pages=num_pages,
            num_slots=num_slots,
            num_draft_pages=num_draft_pages if spec.drafter is not None else 0,
            max_replay_tokens=4,
        )
        arena = CacheArena(layout, "cpu")
        arenas.append(arena)
        managers.append(CacheManager.for_arena(arena, max_batch_size=8, enable_reuse=False))
    return Side(spec, tp, arenas, managers)


@asynccontextmanager
async def connected(a: Side, b: Side, transport: str = "local") -> AsyncIterator[tuple[Peer, Peer]]:
    """Start a transport per side, register every arena, connect a to b; yield (a's peer b, b's peer a)."""
    factory = get_transport(transport)
    async with factory() as ta, factory() as tb:
        a.transport, b.transport = ta, tb
        a.registration = await ta.register([t for ar in a.arenas for t in ar.pool_tensors().values()])
        b.registration = await tb.register([t for ar in b.arenas for t in ar.pool_tensors().values()])
        peer_ab = await ta.connect(tb.address)
        peer_ba = await tb.accept()
        yield peer_ab, peer_ba


def whole_cache(side: Side, rid: object, num_tokens: int, *, draft: bool = True) -> dict[str, torch.Tensor]:
    """The request's cache as the whole model sees it, assembled per element from every rank's head shard
    (plain torch, independent of the mapping; values as same-size ints, so bits compare exactly): per
    attention/draft layer K and V ``[tokens, heads, dim]`` for the first ``num_tokens`` tokens (an MLA layer:
    its latent ``[tokens, 1, latent_dim]``, the first replica's; :func:`latents` gives every rank's), per
    recurrent layer each conv section (``[x|B|C]`` or ``[q|k|v]``) ``[channels, k-1]`` and SSM
    ``[heads, ...]``."""
    out: dict[str, torch.Tensor] = {}
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sentinel = -12345  # garbage is random bits; compare bits, and check coverage by a sentinel in int space

    def as_int(t: torch.Tensor) -> torch.Tensor:
        return t.view(ints[t.element_size()])

    for rank, (m, arena) in enumerate(zip(side.managers, side.arenas, strict=True)):
        layout = arena.layout
        for group in layout.layer_groups:
            if group.name == "draft" and not draft:
                continue
            if group.kind is GroupKind.PAGED:
                ids = list(m.draft_block_table(rid) if group.name == "draft" else m.block_table(rid))
                shard = group.heads
                for layer in group.layer_ids:
                    if group.roles == (Role.LATENT,):
                        views: tuple[tuple[str, torch.Tensor], ...] = (
                            ("latent", arena.latent(layer).unsqueeze(1)),
                        )
                    else:
                        views = tuple(zip(("k", "v"), arena.kv(layer), strict=True))
                    for role, t in views:
                        pages = as_int(t)[ids]  # [nb, h_r, tpb, d]
                        flat = pages.permute(0, 2, 1, 3).reshape(-1, pages.shape[1], pages.shape[3])[
                            :num_tokens
                        ]
                        key = f"{layer}.{role}"
                        if key not in out:
                            out[key] = torch.full(
                                (num_tokens, shard.total, flat.shape[2]), sentinel, dtype=flat.dtype
                            )
                        if shard.is_writer(rank):  # duplicated heads: the first replica is the reference
                            out[key][:, shard.first : shard.first + shard.count] = flat
            else:
                slot = m.slot_id(rid)
                for layer in group.layer_ids:
                    conv = as_int(arena.conv(layer))[slot]
                    local = 0
                    for i, section in enumerate(group.conv_sections):
                        key = f"{layer}.conv{i}"
                        if key not in out:
                            out[key] = torch.full((section.total, conv.shape[1]), sentinel, dtype=conv.dtype)
                        if section.is_writer(rank):
                            out[key][section.first : section.first + section.count] = conv[
                                local : local + section.count
                            ]
                        local += section.count
                    ssm = as_int(arena.ssm(layer))[slot]
                    key = f"{layer}.ssm"
                    if key not in out:
                        out[key] = torch.full((group.heads.total, *ssm.shape[1:]), sentinel, dtype=ssm.dtype)
                    if group.heads.is_writer(rank):
                        out[key][group.heads.first : group.heads.first + group.heads.count] = ssm
    return out


def latents(side: Side, rid: object, num_tokens: int) -> list[dict[int, torch.Tensor]]:
    """Per rank, per MLA layer: the request's latent ``[num_tokens, latent_dim]`` that rank holds, as raw bytes
    (``uint8``, ``latent_dim * itemsize`` per token: garbage bits compare exactly, NaNs included)."""
    out = []
    for m, arena in zip(side.managers, side.arenas, strict=True):
        group = arena.layout.layer_group("attention")
        ids = list(m.block_table(rid))
        per = {}
        for layer in group.layer_ids:
            pages = arena.latent(layer)[ids]
            per[layer] = pages.reshape(-1, pages.shape[-1])[:num_tokens].view(torch.uint8).clone()
        out.append(per)
    return out
