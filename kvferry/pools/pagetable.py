"""The page table: one rank's cache memory as a peer sees it, on the wire.

A :class:`PageTable` is a :class:`~kvferry.pools.layout.CacheLayout` with real base addresses, plus what a peer
needs to pair with it: the wire version, a compatibility hash of the model (shape, dtypes, layer kinds; not the
TP size, block sizes or layout, which peers compare at run time), the TP size and rank, and the layer counts
that bound the global layer ids.

Page tables come from peers, so :meth:`PageTable.validate` (run by :func:`kvferry.wire.decode`) checks every
field: after a successful decode, every address the formula gives for a valid (slot, layer, entry) lies inside
its pool, pools do not overlap, every layer id is in range and held once, and every entry's size matches its
layer group's shapes. A table that fails raises :class:`~kvferry.errors.WireFormatError`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

import attrs
from attrs import frozen

from kvferry import wire
from kvferry.errors import ConfigError, PeerIncompatible, WireFormatError
from kvferry.pools.layout import (
    LATENT_ROLES,
    PAGED_ROLES,
    STATE_ROLES,
    CacheLayout,
    GroupKind,
    LayerGroup,
    Pool,
    PoolEntry,
    PoolGroup,
    Role,
)
from kvferry.pools.spec import DRAFT_LAYER_SHIFT, HeadShard, LayerKind, ModelSpec, dtype_from_name

__all__ = [
    "MAX_ENTRIES",
    "MAX_GROUPS",
    "MAX_LAYERS",
    "MAX_POOLS",
    "PageTable",
    "check_compatible",
    "compat_hash",
]

#: Caps on what a peer's page table may hold; anything over them is a WireFormatError, refused from the lengths
#: before any per-item work. Real models are far below them (tens to hundreds of layers, at most 4 groups and 6
#: pools); a table at the caps decodes in 0.5-0.7 s (1 MB, 2-core host; structuring it is most of that).
#: ``MAX_LAYERS`` bounds ``num_layers``, ``num_draft_layers`` and the layer ids of each group (the target's and
#: the drafter's together: ``2 * MAX_LAYERS``); ``MAX_GROUPS`` the pool (and layer) groups; ``MAX_POOLS`` the
#: pools of the whole table; ``MAX_ENTRIES`` the entries of the whole table (a buffer per layer and role: two
#: roles per layer).
MAX_LAYERS = 1 << 14
MAX_GROUPS = 64
MAX_POOLS = 256
MAX_ENTRIES = 4 * MAX_LAYERS
#: heads of a shard (``HeadShard.total``): a bound on the shapes, not a count of anything the table holds
_MAX_HEADS = 1 << 30
_MAX_NAME = 256


def compat_hash(model: ModelSpec) -> str:
    """Hash of what must match between peers: the target's layer kinds, shapes and dtypes.

    Not the name or block sizes, and not the drafter: a peer without a drafter still pairs (its draft groups are
    skipped with a warning), and two drafters' groups are compared shape by shape when the peers are mapped.
    """
    desc = attrs.asdict(model)
    desc.pop("name")
    desc.pop("tokens_per_block")
    desc.pop("drafter")
    blob = json.dumps(desc, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def _fail(message: str) -> WireFormatError:
    return WireFormatError(f"page table: {message}")


def _check_int(name: str, value: int, low: int, high: int = wire.INT64_MAX) -> None:
    if not low <= value <= high:
        raise _fail(f"{name} = {value} outside [{low}, {high}]")


def _check_shard(name: str, shard: HeadShard) -> None:
    _check_int(f"{name}.total", shard.total, 1, _MAX_HEADS)
    _check_int(f"{name}.count", shard.count, 1, shard.total)
    _check_int(f"{name}.first", shard.first, 0, shard.total - shard.count)
    _check_int(f"{name}.replicas", shard.replicas, 1, 1 << 16)


@frozen
class PageTable:
    """One rank's pools and layer groups with device base addresses (wire object; see the module docstring)."""

    wire_version: int
    compat_hash: str
    model: str
    tp_size: int
    rank: int
    num_layers: int
    num_draft_layers: int
    pool_groups: tuple[PoolGroup, ...]
    layer_groups: tuple[LayerGroup, ...]

    @classmethod
    def from_layout(cls, layout: CacheLayout, bases: Mapping[str, int]) -> PageTable:
        """The page table of ``layout`` with pool ``name`` at address ``bases[name]``.

        :raises ~kvferry.errors.ConfigError: if a pool has no base.
        """
        missing = [p.name for _g, p in layout.pools() if p.name not in bases]
        if missing:
            raise ConfigError(f"no base address for pools {missing}")
        groups = tuple(
            attrs.evolve(g, pools=tuple(attrs.evolve(p, base=bases[p.name]) for p in g.pools))
            for g in layout.pool_groups
        )
        model = layout.spec.model
        return cls(
            wire_version=wire.WIRE_VERSION,
            compat_hash=compat_hash(model),
            model=model.name,
            tp_size=layout.spec.tp_size,
            rank=layout.spec.rank,
            num_layers=model.num_layers,
            num_draft_layers=0 if model.drafter is None else model.drafter.num_layers,
            pool_groups=groups,
            layer_groups=layout.layer_groups,
        )

    # --- wire ----------------------------------------------------------------------------------------------

    def encode(self) -> bytes:
        return wire.encode(self)

    @classmethod
    def decode(cls, data: bytes | bytearray | memoryview) -> PageTable:
        """Decode and validate a peer's page table.

        :raises ~kvferry.errors.WireFormatError: on anything malformed or inconsistent.
        """
        return wire.decode(data, cls)

    # --- lookups -------------------------------------------------------------------------------------------

    def pool_group(self, name: str) -> PoolGroup:
        for g in self.pool_groups:
            if g.name == name:
                return g
        raise ConfigError(f"no pool group {name!r}")

    def layer_group(self, name: str) -> LayerGroup:
        for g in self.layer_groups:
            if g.name == name:
                return g
        raise ConfigError(f"no layer group {name!r}")

    def locate(self, layer_id: int, role: Role) -> tuple[Pool, PoolEntry]:
        """The pool (with its base) and entry of one layer's buffer of ``role``."""
        for g in self.pool_groups:
            for pool in g.pools:
                entry = pool.entry(layer_id, role)
                if entry is not None:
                    return pool, entry
        raise ConfigError(f"layer {layer_id} has no {role.value} buffer")

    # --- validation ----------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Check every field and every cross-field invariant (see the module docstring).

        Linear in the size of the table (entries are sorted per layer run: ``n log n`` there), and refused before
        any per-entry work when it holds more than :data:`MAX_GROUPS` groups, :data:`MAX_POOLS` pools,
        :data:`MAX_LAYERS` layers or :data:`MAX_ENTRIES` entries.

        :raises ~kvferry.errors.WireFormatError: naming the first problem found.
        """
        _check_int("wire_version", self.wire_version, 1)
        if not 0 < len(self.compat_hash) <= _MAX_NAME or not 0 < len(self.model) <= _MAX_NAME:
            raise _fail("compat_hash and model must be non-empty short strings")
        _check_int("tp_size", self.tp_size, 1, 1 << 16)
        _check_int("rank", self.rank, 0, self.tp_size - 1)
        _check_int("num_layers", self.num_layers, 1, MAX_LAYERS)
        _check_int("num_draft_layers", self.num_draft_layers, 0, MAX_LAYERS)
        if not 0 < len(self.pool_groups) <= MAX_GROUPS:
            raise _fail(f"{len(self.pool_groups)} pool groups")
        if len(self.layer_groups) > MAX_GROUPS:
            raise _fail(f"{len(self.layer_groups)} layer groups")
        self._check_caps()
        group_names = [g.name for g in self.pool_groups]
        if len(set(group_names)) != len(group_names):
            raise _fail(f"duplicate pool group names {group_names}")
        layer_groups = {g.name: g for g in self.layer_groups}
        if sorted(group_names) != sorted(g.name for g in self.layer_groups):
            raise _fail("pool groups and layer groups do not correspond one to one")
        seen_layers: set[int] = set()
        for layer_group in self.layer_groups:
            self._validate_layer_group(layer_group, seen_layers)
        pool_names: set[str] = set()
        spans: list[tuple[int, int, str]] = []
        for group in self.pool_groups:
            layer_group = layer_groups[group.name]
            if group.kind != layer_group.kind:
                raise _fail(f"group {group.name}: pool kind {group.kind} != layer kind {layer_group.kind}")
            _check_int(f"{group.name}.num_slots", group.num_slots, 1, 1 << 40)
            if not 0 < len(group.pools) <= MAX_POOLS:
                raise _fail(f"group {group.name} has {len(group.pools)} pools")
            buffers = _Buffers(layer_group)
            for pool in group.pools:
                if pool.name in pool_names or not 0 < len(pool.name) <= _MAX_NAME:
                    raise _fail(f"bad or duplicate pool name {pool.name!r}")
                pool_names.add(pool.name)
                if pool.num_slots != group.num_slots:
                    raise _fail(f"pool {pool.name}: {pool.num_slots} slots, its group has {group.num_slots}")
                end = self._validate_pool(pool, buffers)
                spans.append((pool.base, end, pool.name))
            expected = len(layer_group.layer_ids) * len(layer_group.roles)
            if len(buffers.held) != expected:
                # every held buffer is one of the group's (checked entry by entry), so the counts decide
                raise _fail(
                    f"group {group.name}: pools hold {len(buffers.held)} buffers, its layers need {expected}"
                )
        spans.sort()
        reach, last = -1, ""
        for start, end, name in spans:
            if start < reach:
                raise _fail(f"pools {last} and {name} overlap")
            if end > reach:
                reach, last = end, name

    def _check_caps(self) -> None:
        """The caps on pools, entries and layers, checked from the lengths alone (before any per-item work)."""
        pools = sum(len(g.pools) for g in self.pool_groups)
        if pools > MAX_POOLS:
            raise _fail(f"{pools} pools (at most {MAX_POOLS})")
        entries = sum(len(p.entries) for g in self.pool_groups for p in g.pools)
        if entries > MAX_ENTRIES:
            raise _fail(f"{entries} entries (at most {MAX_ENTRIES})")
        layers = sum(len(g.layer_ids) for g in self.layer_groups)
        if layers > 2 * MAX_LAYERS:
            raise _fail(f"{layers} layer ids (at most {2 * MAX_LAYERS})")

    def _validate_layer_group(self, group: LayerGroup, seen: set[int]) -> None:
        name = group.name
        if not 0 < len(name) <= _MAX_NAME:
            raise _fail("bad layer group name")
        if group.kind == GroupKind.PAGED:
            if group.roles not in (PAGED_ROLES, LATENT_ROLES) or group.layer_kind != LayerKind.ATTENTION:
                raise _fail(f"paged group {name}: roles {group.roles}, kind {group.layer_kind}")
            _check_int(f"{name}.tokens_per_block", group.tokens_per_block, 1, 1 << 20)
            if group.state_size or group.conv_kernel or group.conv_sections:
                raise _fail(f"paged group {name} has state fields")
        else:
            if group.roles != STATE_ROLES or group.layer_kind not in (LayerKind.MAMBA2, LayerKind.KDA):
                raise _fail(f"state group {name}: roles {group.roles}, kind {group.layer_kind}")
            if group.tokens_per_block != 0:
                raise _fail(f"state group {name} has tokens_per_block")
            _check_int(f"{name}.state_size", group.state_size, 1, 1 << 20)
            _check_int(f"{name}.conv_kernel", group.conv_kernel, 2, 1 << 10)
            if len(group.conv_sections) != 3:
                raise _fail(f"state group {name}: {len(group.conv_sections)} conv sections, expected 3")
            for i, section in enumerate(group.conv_sections):
                _check_shard(f"{name}.conv_sections[{i}]", section)
        if len(group.dtypes) != len(group.roles):
            raise _fail(f"group {name}: {len(group.dtypes)} dtypes for {len(group.roles)} roles")
        for dtype in group.dtypes:
            try:
                dtype_from_name(dtype)
            except ConfigError:
                raise _fail(f"group {name}: unknown dtype {dtype!r}") from None
        _check_shard(f"{name}.heads", group.heads)
        _check_int(f"{name}.head_dim", group.head_dim, 1, 1 << 20)
        if not 0 < len(group.layer_ids) <= MAX_LAYERS:
            raise _fail(f"group {name} has {len(group.layer_ids)} layers")
        draft = group.layer_ids[0] >= DRAFT_LAYER_SHIFT
        low, count = (DRAFT_LAYER_SHIFT, self.num_draft_layers) if draft else (0, self.num_layers)
        if draft and group.kind != GroupKind.PAGED:
            raise _fail(f"state group {name} has draft layer ids")
        for layer_id in group.layer_ids:
            if not low <= layer_id < low + count:
                raise _fail(f"group {name}: layer id {layer_id} outside [{low}, {low + count})")
            if layer_id in seen:
                raise _fail(f"layer id {layer_id} appears twice")
            seen.add(layer_id)

    def _validate_pool(self, pool: Pool, buffers: _Buffers) -> int:
        """Check one pool of ``buffers``' group (adding its entries to ``buffers.held``); its end address."""
        name = pool.name
        _check_int(f"{name}.base", pool.base, 0)
        _check_int(f"{name}.slot_bytes", pool.slot_bytes, 1)
        _check_int(f"{name}.slot_stride", pool.slot_stride, 0)
        _check_int(f"{name}.layer_stride", pool.layer_stride, 0)
        if not pool.entries:
            raise _fail(f"pool {name} has 0 entries")
        # the ``layer`` of the address formula: each layer id's index among the pool's distinct layer ids
        layer_index = {
            layer_id: i for i, layer_id in enumerate(dict.fromkeys(e.layer_id for e in pool.entries))
        }
        num_layers = len(layer_index)
        if pool.layer_stride == 0:
            if pool.num_slots > 1 and pool.slot_stride < pool.slot_bytes:
                raise _fail(f"pool {name}: slot_stride {pool.slot_stride} < slot_bytes {pool.slot_bytes}")
            nbytes = (pool.num_slots - 1) * pool.slot_stride + max(pool.slot_stride, pool.slot_bytes)
        else:
            layer_first = (
                pool.slot_stride >= pool.slot_bytes and pool.layer_stride >= pool.num_slots * pool.slot_stride
            )
            slot_major = (
                pool.layer_stride >= pool.slot_bytes and pool.slot_stride >= num_layers * pool.layer_stride
            )
            if not (layer_first or slot_major):
                raise _fail(
                    f"pool {name}: strides {pool.slot_stride}/{pool.layer_stride} overlap slots or layers"
                )
            last = (pool.num_slots - 1) * pool.slot_stride + (num_layers - 1) * pool.layer_stride
            nbytes = last + pool.slot_bytes
        end = pool.base + nbytes
        _check_int(f"{name}.end", end, 0)
        group, held, layers, role_bytes = buffers.group, buffers.held, buffers.layers, buffers.role_bytes
        runs: dict[int, list[tuple[int, int]]] = {}
        for entry in pool.entries:
            key = (entry.layer_id, entry.role)
            if entry.layer_id not in layers or entry.role not in role_bytes:
                raise _fail(f"pool {name}: entry {key} is not a buffer of group {group.name}")
            if key in held:
                raise _fail(f"pool {name}: buffer {key} held twice")
            held.add(key)
            _check_int(f"{name}.entry.offset", entry.offset, 0)
            _check_int(f"{name}.entry.nbytes", entry.nbytes, 1)
            if entry.offset + entry.nbytes > pool.slot_bytes:
                raise _fail(f"pool {name}: entry {key} ends past slot_bytes {pool.slot_bytes}")
            if entry.nbytes != role_bytes[entry.role]:
                raise _fail(
                    f"pool {name}: entry {key} has {entry.nbytes} bytes, its shape needs {role_bytes[entry.role]}"
                )
            # slot-first: every entry shares the slot; otherwise each layer has a run of its own
            run = 0 if pool.layer_stride == 0 else layer_index[entry.layer_id]
            runs.setdefault(run, []).append((entry.offset, entry.offset + entry.nbytes))
        for intervals in runs.values():
            intervals.sort()
            reach = 0
            for start, stop in intervals:
                if start < reach:
                    raise _fail(f"pool {name}: entries overlap")
                reach = max(reach, stop)
        return end


class _Buffers:
    """What the pools of one group may hold (its layers, the bytes of each role's buffer), and what they hold
    so far: made once per group, so that each entry costs set and dict lookups, never a scan of the layers."""

    __slots__ = ("group", "held", "layers", "role_bytes")

    def __init__(self, group: LayerGroup) -> None:
        self.group = group
        self.layers = frozenset(group.layer_ids)
        self.role_bytes = {role: group.role_bytes(role) for role in group.roles}
        self.held: set[tuple[int, Role]] = set()


def check_compatible(local: PageTable, remote: PageTable) -> None:
    """Refuse a peer that speaks another wire version or serves another model.

    :raises ~kvferry.errors.PeerIncompatible: naming what differs.
    """
    if local.wire_version != remote.wire_version:
        raise PeerIncompatible(f"wire version {remote.wire_version}, we speak {local.wire_version}")
    if local.compat_hash != remote.compat_hash:
        raise PeerIncompatible(
            f"peer serves {remote.model!r} (hash {remote.compat_hash}), we serve {local.model!r} ({local.compat_hash})"
        )
