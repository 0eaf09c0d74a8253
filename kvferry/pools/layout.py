"""Where every byte of one rank's cache lives: pool groups, pools, entries, layer groups, replay buffers.

A :class:`CacheLayout` is pure description (nothing is allocated; :class:`kvferry.pools.arena.CacheArena`
allocates it). One formula addresses everything::

    addr(slot, layer, entry) = pool.base + slot * pool.slot_stride + layer * pool.layer_stride + entry.offset

where ``layer`` is the index of the entry's layer among :attr:`Pool.layer_ids`. Layouts built here are all
*slot-first* (``layer_stride == 0``; the layer is in ``entry.offset``), so one slot (a page of a paged group,
a request's state slot of a state group) is one contiguous run of ``slot_bytes`` bytes in each pool.

- PAGED group ``attention``: the target's attention layers; a page holds every layer, each K then V, each
  head-major ``[kv_heads_rank, tokens_per_block, head_dim]``. An MLA model's pages hold one LATENT buffer per
  layer instead, ``[1, tokens_per_block, latent_dim]``, the same on every rank.
- PAGED group ``draft``: the drafter's layers (global ids ``DRAFT_LAYER_SHIFT + i``), own ``tokens_per_block``.
- STATE groups ``mamba2`` / ``kda``: per layer a conv window ``[conv_dim_rank, conv_kernel - 1]`` (channel-major,
  so each section ``[x|B|C]`` / ``[q|k|v]`` is contiguous) and an SSM matrix ``[heads_rank, head_dim, state]``.

Buffers of equal per-slot size are coalesced into one pool; buffers of different sizes get pools of their own,
so conv and SSM strides differ unless their sizes match. Every entry offset and slot stride is a multiple of
:data:`ALIGNMENT` bytes so typed views of any cache dtype are aligned.

Replay buffers (speculative decoding) sit beside the state pools: per recurrent layer
``[num_slots, max_replay_tokens, replay_width]``, slot-first, plus ``num_accepted`` (int64 per slot). They are
not part of the page table and never transferred.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator

from attrs import frozen

from kvferry.errors import ConfigError
from kvferry.pools.spec import HeadShard, LayerKind, RankSpec, dtype_from_name

__all__ = [
    "ALIGNMENT",
    "LATENT_ROLES",
    "PAGED_ROLES",
    "STATE_ROLES",
    "CacheLayout",
    "Fit",
    "GroupKind",
    "LayerGroup",
    "Pool",
    "PoolEntry",
    "PoolGroup",
    "ReplayBuffer",
    "ReplayLayout",
    "Role",
    "fit",
]

#: Entry offsets and slot strides are multiples of this many bytes (a cache line; covers every dtype).
ALIGNMENT = 64

#: Bytes per slot that ``num_accepted`` (int64) adds to the state budget.
NUM_ACCEPTED_BYTES = 8


class GroupKind(enum.StrEnum):
    """PAGED: attention KV in pages of ``tokens_per_block`` tokens. STATE: one recurrent slot per request."""

    PAGED = "paged"
    STATE = "state"


class Role(enum.StrEnum):
    """What one buffer of a layer holds."""

    KEY = "key"
    VALUE = "value"
    LATENT = "latent"
    CONV = "conv"
    SSM = "ssm"


PAGED_ROLES = (Role.KEY, Role.VALUE)
#: the roles of an MLA model's attention pages: one latent vector per token
LATENT_ROLES = (Role.LATENT,)
STATE_ROLES = (Role.CONV, Role.SSM)


def _align(value: int, alignment: int = ALIGNMENT) -> int:
    return -(-value // alignment) * alignment


@frozen
class PoolEntry:
    """One buffer of one layer inside a slot: ``nbytes`` bytes at ``offset`` from the slot's (and layer's) start."""

    layer_id: int
    role: Role
    offset: int
    nbytes: int


@frozen
class Pool:
    """One contiguous byte arena of ``num_slots`` slots.

    ``base`` is 0 in a :class:`CacheLayout` (each pool is its own arena) and the device address of byte 0 in a
    page table. ``slot_bytes`` is the used part of one slot (of one layer run when ``layer_stride != 0``);
    ``slot_stride`` and ``layer_stride`` are in bytes.
    """

    name: str
    num_slots: int
    slot_bytes: int
    slot_stride: int
    layer_stride: int
    entries: tuple[PoolEntry, ...]
    base: int = 0

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Distinct layer ids of the entries, in order; the ``layer`` of the address formula indexes this."""
        return tuple(dict.fromkeys(e.layer_id for e in self.entries))

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(dict.fromkeys(e.role for e in self.entries))

    @property
    def nbytes(self) -> int:
        """Bytes of the arena from ``base`` to the end of the last slot's last layer run (``num_slots *
        slot_stride`` for the slot-first pools we build)."""
        if self.num_slots == 0 or not self.entries:
            return 0
        if self.layer_stride == 0:
            return (self.num_slots - 1) * self.slot_stride + max(self.slot_stride, self.slot_bytes)
        num_layers = len(self.layer_ids)
        last = (self.num_slots - 1) * self.slot_stride + (num_layers - 1) * self.layer_stride
        return last + self.slot_bytes

    def entry(self, layer_id: int, role: Role) -> PoolEntry | None:
        for e in self.entries:
            if e.layer_id == layer_id and e.role == role:
                return e
        return None

    def address(self, slot: int, entry: PoolEntry) -> int:
        """The formula: ``base + slot * slot_stride + layer * layer_stride + entry.offset``."""
        layer = self.layer_ids.index(entry.layer_id)
        return self.base + slot * self.slot_stride + layer * self.layer_stride + entry.offset


@frozen
class PoolGroup:
    """Pools that share one slot id space (page ids of a paged group, slot ids of a state group)."""

    name: str
    kind: GroupKind
    num_slots: int
    pools: tuple[Pool, ...]

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot (page) id takes across the group's pools, strides included."""
        return sum(p.slot_stride for p in self.pools)


@frozen
class LayerGroup:
    """Layers of one kind that share a shape and a pool group.

    PAGED: ``roles`` key/value (or latent alone for MLA, one replicated "head" of ``head_dim`` = the latent
    width), ``heads`` = kv heads of this rank, ``tokens_per_block`` > 0, ``state_size`` and ``conv_kernel`` 0,
    no conv sections. STATE: ``roles`` conv/ssm, ``heads`` = SSM heads of this rank,
    ``state_size`` = the SSM matrix's last dim (Mamba2 state size, KDA head dim), ``conv_sections`` = channel
    shards of ``[x|B|C]`` (Mamba2) or ``[q|k|v]`` (KDA), ``tokens_per_block`` 0. ``dtypes`` align with ``roles``.
    """

    name: str
    kind: GroupKind
    layer_kind: LayerKind
    roles: tuple[Role, ...]
    dtypes: tuple[str, ...]
    layer_ids: tuple[int, ...]
    tokens_per_block: int
    heads: HeadShard
    head_dim: int
    state_size: int = 0
    conv_kernel: int = 0
    conv_sections: tuple[HeadShard, ...] = ()

    def dtype(self, role: Role) -> str:
        return self.dtypes[self.roles.index(role)]

    @property
    def conv_dim(self) -> int:
        """Conv channels this rank holds (all sections)."""
        return sum(s.count for s in self.conv_sections)

    @property
    def conv_channel_bytes(self) -> int:
        """Bytes of one conv channel's window (``conv_kernel - 1`` values)."""
        if self.kind != GroupKind.STATE:
            return 0
        return (self.conv_kernel - 1) * dtype_from_name(self.dtype(Role.CONV)).itemsize

    @property
    def conv_section_bytes(self) -> tuple[int, ...]:
        """Bytes of each conv section of one layer on this rank (contiguous, in order)."""
        return tuple(s.count * self.conv_channel_bytes for s in self.conv_sections)

    @property
    def ssm_bytes_per_head(self) -> int:
        if self.kind != GroupKind.STATE:
            return 0
        return self.head_dim * self.state_size * dtype_from_name(self.dtype(Role.SSM)).itemsize

    def role_bytes(self, role: Role) -> int:
        """Bytes of one layer's buffer of ``role`` in one slot (page)."""
        itemsize = dtype_from_name(self.dtype(role)).itemsize
        if role in PAGED_ROLES or role == Role.LATENT:
            return self.heads.count * self.tokens_per_block * self.head_dim * itemsize
        if role == Role.CONV:
            return sum(self.conv_section_bytes)
        return self.heads.count * self.ssm_bytes_per_head

    def role_shape(self, role: Role) -> tuple[int, ...]:
        """Shape of one layer's buffer of ``role`` in one slot, in elements of ``dtype(role)``."""
        if role in PAGED_ROLES or role == Role.LATENT:
            return (self.heads.count, self.tokens_per_block, self.head_dim)
        if role == Role.CONV:
            return (self.conv_dim, self.conv_kernel - 1)
        return (self.heads.count, self.head_dim, self.state_size)


@frozen
class ReplayBuffer:
    """One recurrent layer's replay buffer ``[max_tokens, width]`` of ``dtype`` at ``offset`` in each replay slot."""

    layer_id: int
    width: int
    dtype: str
    offset: int
    nbytes: int


@frozen
class ReplayLayout:
    """Slot-first replay buffers of every recurrent layer (not in the page table, never transferred)."""

    num_slots: int
    max_tokens: int
    slot_stride: int
    buffers: tuple[ReplayBuffer, ...]

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_stride

    def buffer(self, layer_id: int) -> ReplayBuffer:
        for b in self.buffers:
            if b.layer_id == layer_id:
                return b
        raise ConfigError(f"layer {layer_id} has no replay buffer")


@frozen
class CacheLayout:
    """One rank's whole cache, described: pool groups, layer groups and replay buffers.

    Build with :meth:`build`. Group names: ``attention``, ``draft`` (PAGED), ``mamba2``, ``kda`` (STATE).
    """

    spec: RankSpec
    pool_groups: tuple[PoolGroup, ...]
    layer_groups: tuple[LayerGroup, ...]
    replay: ReplayLayout

    @classmethod
    def build(
        cls,
        rank_spec: RankSpec,
        *,
        num_pages: int,
        num_slots: int,
        num_draft_pages: int = 0,
        max_replay_tokens: int = 0,
    ) -> CacheLayout:
        """Lay out one rank's cache.

        :param num_pages: pages of the ``attention`` group (ignored, may be 0, when the model has no attention).
        :param num_slots: state slots of every STATE group (ignored when the model has no recurrent layers).
        :param num_draft_pages: pages of the ``draft`` group; must be positive when the model has a drafter
            (use ``ModelSpec.without_drafter()`` for a model without draft KV).
        :param max_replay_tokens: tokens per replay buffer (``k + 1`` for ``k`` draft tokens; 0 without spec decode).
        :raises ~kvferry.errors.ConfigError: on a count that cannot work.
        """
        for name, value in (
            ("num_pages", num_pages),
            ("num_slots", num_slots),
            ("num_draft_pages", num_draft_pages),
            ("max_replay_tokens", max_replay_tokens),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a non-negative int, got {value!r}")
        layer_groups = _layer_groups(rank_spec)
        pool_groups: list[PoolGroup] = []
        for group in layer_groups:
            if group.name == "attention":
                count = num_pages
            elif group.name == "draft":
                count = num_draft_pages
            else:
                count = num_slots
            if count <= 0:
                what = {"attention": "num_pages", "draft": "num_draft_pages"}.get(group.name, "num_slots")
                hint = " (or build from spec.without_drafter())" if group.name == "draft" else ""
                raise ConfigError(f"{what} must be positive for the {group.name} group{hint}")
            pool_groups.append(_pool_group(group, count))
        replay = _replay_layout(rank_spec, layer_groups, num_slots, max_replay_tokens)
        return cls(spec=rank_spec, pool_groups=tuple(pool_groups), layer_groups=layer_groups, replay=replay)

    # --- lookups -------------------------------------------------------------------------------------------

    def pool_group(self, name: str) -> PoolGroup:
        for g in self.pool_groups:
            if g.name == name:
                return g
        raise ConfigError(f"no pool group {name!r}; have {[g.name for g in self.pool_groups]}")

    def layer_group(self, name: str) -> LayerGroup:
        for g in self.layer_groups:
            if g.name == name:
                return g
        raise ConfigError(f"no layer group {name!r}; have {[g.name for g in self.layer_groups]}")

    def has_group(self, name: str) -> bool:
        return any(g.name == name for g in self.pool_groups)

    def layer_group_of(self, layer_id: int) -> LayerGroup:
        """The layer group holding global layer ``layer_id``."""
        for g in self.layer_groups:
            if layer_id in g.layer_ids:
                return g
        raise ConfigError(f"layer {layer_id} holds no cache on this rank")

    def locate(self, layer_id: int, role: Role) -> tuple[Pool, PoolEntry]:
        """The pool and entry of one layer's buffer of ``role``."""
        group = self.layer_group_of(layer_id)
        for pool in self.pool_group(group.name).pools:
            entry = pool.entry(layer_id, role)
            if entry is not None:
                return pool, entry
        raise ConfigError(f"layer {layer_id} has no {role.value} buffer")

    def pools(self) -> Iterator[tuple[PoolGroup, Pool]]:
        for g in self.pool_groups:
            for p in g.pools:
                yield g, p

    @property
    def state_groups(self) -> tuple[PoolGroup, ...]:
        return tuple(g for g in self.pool_groups if g.kind == GroupKind.STATE)

    @property
    def paged_groups(self) -> tuple[PoolGroup, ...]:
        return tuple(g for g in self.pool_groups if g.kind == GroupKind.PAGED)

    @property
    def num_slots(self) -> int:
        """State slots (0 when the model has no recurrent layers)."""
        groups = self.state_groups
        return groups[0].num_slots if groups else 0

    # --- sizing --------------------------------------------------------------------------------------------

    def page_bytes(self, group: str) -> int:
        """Bytes one page id of a PAGED group takes (all its layers, K and V)."""
        return self.pool_group(group).slot_bytes

    def bytes_per_token(self, group: str) -> float:
        """Bytes one token takes in a PAGED group (page bytes / tokens_per_block)."""
        return self.page_bytes(group) / self.layer_group(group).tokens_per_block

    @property
    def state_bytes_per_slot(self) -> int:
        """Bytes one state slot takes in the STATE pools (every recurrent layer, conv and SSM)."""
        return sum(g.slot_bytes for g in self.state_groups)

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one state slot costs in all: state pools, replay buffers and ``num_accepted``."""
        if not self.state_groups:
            return 0
        return self.state_bytes_per_slot + self.replay.slot_stride + NUM_ACCEPTED_BYTES

    @property
    def nbytes(self) -> int:
        """Bytes of every arena: pools, replay buffers and ``num_accepted``."""
        total = sum(p.nbytes for _g, p in self.pools()) + self.replay.nbytes
        return total + NUM_ACCEPTED_BYTES * self.num_slots


def _in_channels(shard: HeadShard, total: int, width: int) -> HeadShard:
    """``shard`` of ``total`` heads counted in channels: each head is ``width`` channels."""
    return HeadShard(
        total=total * width,
        count=shard.count * width,
        first=shard.first * width,
        replicas=shard.replicas,
    )


def _layer_groups(rank: RankSpec) -> tuple[LayerGroup, ...]:
    model = rank.model
    groups: list[LayerGroup] = []
    if model.mla is not None and model.attention_layer_ids:
        assert rank.attention_kv_heads is not None
        groups.append(
            LayerGroup(
                name="attention",
                kind=GroupKind.PAGED,
                layer_kind=LayerKind.ATTENTION,
                roles=LATENT_ROLES,
                dtypes=(model.mla.dtype,),
                layer_ids=model.attention_layer_ids,
                tokens_per_block=model.tokens_per_block,
                heads=rank.attention_kv_heads,
                head_dim=model.mla.latent_dim,
            )
        )
    if model.attention is not None and model.attention_layer_ids:
        assert rank.attention_kv_heads is not None
        groups.append(
            LayerGroup(
                name="attention",
                kind=GroupKind.PAGED,
                layer_kind=LayerKind.ATTENTION,
                roles=PAGED_ROLES,
                dtypes=(model.attention.dtype, model.attention.dtype),
                layer_ids=model.attention_layer_ids,
                tokens_per_block=model.tokens_per_block,
                heads=rank.attention_kv_heads,
                head_dim=model.attention.head_dim,
            )
        )
    if model.drafter is not None:
        assert rank.draft_kv_heads is not None
        d = model.drafter
        groups.append(
            LayerGroup(
                name="draft",
                kind=GroupKind.PAGED,
                layer_kind=LayerKind.ATTENTION,
                roles=PAGED_ROLES,
                dtypes=(d.dtype, d.dtype),
                layer_ids=d.global_layer_ids,
                tokens_per_block=d.tokens_per_block,
                heads=rank.draft_kv_heads,
                head_dim=d.head_dim,
            )
        )
    if model.mamba2 is not None and model.layer_ids(LayerKind.MAMBA2):
        m = model.mamba2
        heads, mgroups = rank.mamba2_heads, rank.mamba2_groups
        assert heads is not None and mgroups is not None
        x = _in_channels(heads, m.num_heads, m.head_dim)
        bc = _in_channels(mgroups, m.num_groups, m.state_size)
        groups.append(
            LayerGroup(
                name="mamba2",
                kind=GroupKind.STATE,
                layer_kind=LayerKind.MAMBA2,
                roles=STATE_ROLES,
                dtypes=(m.conv_dtype, m.ssm_dtype),
                layer_ids=model.layer_ids(LayerKind.MAMBA2),
                tokens_per_block=0,
                heads=heads,
                head_dim=m.head_dim,
                state_size=m.state_size,
                conv_kernel=m.conv_kernel,
                conv_sections=(x, bc, bc),
            )
        )
    if model.kda is not None and model.layer_ids(LayerKind.KDA):
        k = model.kda
        heads = rank.kda_heads
        assert heads is not None
        section = _in_channels(heads, k.num_heads, k.head_dim)
        groups.append(
            LayerGroup(
                name="kda",
                kind=GroupKind.STATE,
                layer_kind=LayerKind.KDA,
                roles=STATE_ROLES,
                dtypes=(k.conv_dtype, k.ssm_dtype),
                layer_ids=model.layer_ids(LayerKind.KDA),
                tokens_per_block=0,
                heads=heads,
                head_dim=k.head_dim,
                state_size=k.head_dim,
                conv_kernel=k.conv_kernel,
                conv_sections=(section, section, section),
            )
        )
    return tuple(groups)


def _pool_group(group: LayerGroup, num_slots: int) -> PoolGroup:
    # Coalesce buffers of equal per-slot size into one slot-first pool, in order of first appearance.
    by_size: dict[int, list[tuple[int, Role]]] = {}
    for layer_id in group.layer_ids:
        for role in group.roles:
            by_size.setdefault(group.role_bytes(role), []).append((layer_id, role))
    pools: list[Pool] = []
    names: set[str] = set()
    for nbytes, buffers in by_size.items():
        entries: list[PoolEntry] = []
        offset = 0
        for layer_id, role in buffers:
            entries.append(PoolEntry(layer_id=layer_id, role=role, offset=offset, nbytes=nbytes))
            offset = _align(offset + nbytes)
        roles = tuple(dict.fromkeys(role for _, role in buffers))
        name = group.name if len(by_size) == 1 else f"{group.name}.{'+'.join(r.value for r in roles)}"
        if name in names:
            name = f"{name}.{len(pools)}"
        names.add(name)
        slot_bytes = entries[-1].offset + nbytes
        pools.append(
            Pool(
                name=name,
                num_slots=num_slots,
                slot_bytes=slot_bytes,
                slot_stride=_align(slot_bytes),
                layer_stride=0,
                entries=tuple(entries),
            )
        )
    return PoolGroup(name=group.name, kind=group.kind, num_slots=num_slots, pools=tuple(pools))


def _replay_layout(
    rank: RankSpec, layer_groups: tuple[LayerGroup, ...], num_slots: int, max_tokens: int
) -> ReplayLayout:
    buffers: list[ReplayBuffer] = []
    offset = 0
    for group in layer_groups:
        if group.kind != GroupKind.STATE:
            continue
        # Mamba2: raw pre-conv xBC and raw dt per token. KDA: raw pre-conv qkv, the gate (per channel) and beta.
        if group.layer_kind == LayerKind.MAMBA2:
            width = group.conv_dim + group.heads.count
        else:
            width = group.conv_dim + group.heads.count * group.head_dim + group.heads.count
        dtype = group.dtype(Role.CONV)
        nbytes = max_tokens * width * dtype_from_name(dtype).itemsize
        for layer_id in group.layer_ids:
            buffers.append(
                ReplayBuffer(layer_id=layer_id, width=width, dtype=dtype, offset=offset, nbytes=nbytes)
            )
            offset = _align(offset + nbytes)
    has_state = any(g.kind == GroupKind.STATE for g in layer_groups)
    return ReplayLayout(
        num_slots=num_slots if has_state else 0,
        max_tokens=max_tokens,
        slot_stride=offset,
        buffers=tuple(buffers),
    )


@frozen
class Fit:
    """How much cache fits in a memory budget, sized for full-length requests of ``max_tokens`` tokens."""

    memory_bytes: int
    max_tokens: int
    max_replay_tokens: int
    requests: int
    num_pages: int
    num_slots: int
    num_draft_pages: int
    bytes_per_request: int
    bytes_used: int
    pages_per_request: int
    draft_pages_per_request: int


def fit(rank_spec: RankSpec, memory_bytes: int, max_tokens: int, *, max_replay_tokens: int = 0) -> Fit:
    """How many pages, slots and draft pages fit in ``memory_bytes``, and how many full-length requests they serve.

    Each request of ``max_tokens`` tokens needs ``ceil(max_tokens / tokens_per_block)`` pages of every PAGED
    group and one state slot (with its replay buffers). Counts are whole requests' worth; leftover bytes stay
    unused. Prefix-reuse snapshots need extra state slots and are not counted here.

    :raises ~kvferry.errors.ConfigError: on a negative budget or a non-positive ``max_tokens``.
    """
    if not isinstance(memory_bytes, int) or isinstance(memory_bytes, bool) or memory_bytes < 0:
        raise ConfigError(f"memory_bytes must be a non-negative int, got {memory_bytes!r}")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise ConfigError(f"max_tokens must be a positive int, got {max_tokens!r}")
    unit = CacheLayout.build(
        rank_spec,
        num_pages=1,
        num_slots=1,
        num_draft_pages=1,
        max_replay_tokens=max_replay_tokens,
    )
    pages = draft_pages = 0
    per_request = unit.bytes_per_slot
    for group in unit.paged_groups:
        count = math.ceil(max_tokens / unit.layer_group(group.name).tokens_per_block)
        per_request += count * group.slot_bytes
        if group.name == "draft":
            draft_pages = count
        else:
            pages = count
    requests = memory_bytes // per_request if per_request else 0
    has_state = bool(unit.state_groups)
    return Fit(
        memory_bytes=memory_bytes,
        max_tokens=max_tokens,
        max_replay_tokens=max_replay_tokens,
        requests=requests,
        num_pages=requests * pages,
        num_slots=requests if has_state else 0,
        num_draft_pages=requests * draft_pages,
        bytes_per_request=per_request,
        bytes_used=requests * per_request,
        pages_per_request=pages,
        draft_pages_per_request=draft_pages,
    )
