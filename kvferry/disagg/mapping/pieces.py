"""The pieces of a (sender layer group, receiver layer group) pair: what does not depend on page ids.

From the two ranks' page tables, each pair of layer groups is cut into *pieces*, each with its address in slot
(page) 0, its slot stride and its pool on both sides:

- a PAGED group (attention or draft KV): one piece per (layer, role, kv head) the two ranks share and the sender
  is elected for; its length is the bytes of one head per token (pages are mapped token by token, so the page
  sizes of the two sides may differ);
- a STATE group (Mamba2 or KDA conv and SSM state): one piece per (role, layer, conv section or SSM head run), role
  major (every layer's conv, then every layer's SSM) so runs stay inside one pool and merge; its length is the
  piece's bytes in the slot.

Paired groups must agree on kind, roles, dtypes and whole-model shapes, else
:class:`~kvferry.errors.PeerIncompatible`. Pieces come in a canonical order that depends on the two tables only.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np
from attrs import define, frozen

from kvferry.disagg.mapping.arrays import EMPTY, Int64Array
from kvferry.disagg.mapping.ranks import elected, head_overlap
from kvferry.errors import PeerIncompatible
from kvferry.pools.layout import GroupKind, LayerGroup, Role
from kvferry.pools.pagetable import PageTable
from kvferry.pools.spec import DRAFT_LAYER_SHIFT, dtype_from_name

__all__ = ["GroupMap", "PieceSide", "group_map", "is_draft"]


@frozen(eq=False)
class PieceSide:
    """Per piece: address in slot 0, slot stride and pool index on one side."""

    base: Int64Array
    stride: Int64Array
    pool: Int64Array


@frozen(eq=False)
class GroupMap:
    """The pieces of one (sender layer group, receiver layer group) pair, in canonical order.

    PAGED: one piece per (layer, role, head); ``length`` is bytes per token of one head and ``src.base`` already
    includes the head's offset in the page. STATE: one piece per (role, layer, section or head run); ``length``
    is the piece's bytes.
    """

    src_group: str
    dst_group: str
    kind: GroupKind
    draft: bool
    src_tokens_per_block: int
    dst_tokens_per_block: int
    src_num_slots: int
    dst_num_slots: int
    src: PieceSide
    dst: PieceSide
    length: Int64Array
    #: per number of tokens (PAGED) or 1 (STATE): the runs of pieces that merge on both sides, see :meth:`runs`
    _runs: dict[int, tuple[Int64Array, Int64Array]] = attrs.field(factory=dict, init=False, repr=False)

    @property
    def num_pieces(self) -> int:
        return len(self.length)

    def runs(self, tokens: int) -> tuple[Int64Array, Int64Array]:
        """The pieces of one page (PAGED, ``tokens`` tokens of it) or one slot (STATE, ``tokens`` = 1) merged into
        runs that are contiguous on both sides whatever the page or slot ids: ``(first piece of each run, bytes per
        token of each run)``. Consecutive pieces merge when they share pool, stride and ``length`` on each side
        and the next one starts where this one's ``tokens * length`` bytes end, on both sides. Depends on the two
        tables only, so it is computed once per ``tokens`` and kept."""
        cached = self._runs.get(tokens)
        if cached is not None:
            return cached
        n = self.num_pieces
        if n == 0:
            out = (EMPTY, EMPTY)
        else:
            src, dst, length = self.src, self.dst, self.length
            span = tokens * length[:-1]
            joins = (
                (src.base[1:] - src.base[:-1] == span)
                & (dst.base[1:] - dst.base[:-1] == span)
                & (src.stride[1:] == src.stride[:-1])
                & (dst.stride[1:] == dst.stride[:-1])
                & (src.pool[1:] == src.pool[:-1])
                & (dst.pool[1:] == dst.pool[:-1])
                & (length[1:] == length[:-1])
            )
            first = np.flatnonzero(np.concatenate(([True], ~joins))).astype(np.int64)
            out = (first, np.add.reduceat(length, first).astype(np.int64))
        for array in out:
            array.flags.writeable = False
        self._runs[tokens] = out
        return out


#: (address in slot 0, slot stride, pool index) of one piece on one side
Where = tuple[int, int, int]


@define(eq=False)
class _PieceBuilder:
    src_base: list[int] = attrs.Factory(list)
    src_stride: list[int] = attrs.Factory(list)
    src_pool: list[int] = attrs.Factory(list)
    dst_base: list[int] = attrs.Factory(list)
    dst_stride: list[int] = attrs.Factory(list)
    dst_pool: list[int] = attrs.Factory(list)
    length: list[int] = attrs.Factory(list)

    def add(self, src: Where, dst: Where, length: int) -> None:
        self.src_base.append(src[0])
        self.src_stride.append(src[1])
        self.src_pool.append(src[2])
        self.dst_base.append(dst[0])
        self.dst_stride.append(dst[1])
        self.dst_pool.append(dst[2])
        self.length.append(length)

    def sides(self) -> tuple[PieceSide, PieceSide, Int64Array]:
        def arr(values: list[int]) -> Int64Array:
            return np.asarray(values, dtype=np.int64).reshape(-1)

        return (
            PieceSide(arr(self.src_base), arr(self.src_stride), arr(self.src_pool)),
            PieceSide(arr(self.dst_base), arr(self.dst_stride), arr(self.dst_pool)),
            arr(self.length),
        )


def is_draft(group: LayerGroup) -> bool:
    """Whether ``group`` holds the drafter's layers (ids from ``DRAFT_LAYER_SHIFT``)."""
    return group.layer_ids[0] >= DRAFT_LAYER_SHIFT


def _check_geometry(src: LayerGroup, dst: LayerGroup) -> None:
    def shape(g: LayerGroup) -> dict[str, object]:
        return {
            "kind": g.kind,
            "layer_kind": g.layer_kind,
            "roles": g.roles,
            "dtypes": g.dtypes,
            "head_dim": g.head_dim,
            "heads": g.heads.total,
            "state_size": g.state_size,
            "conv_kernel": g.conv_kernel,
            "conv_sections": tuple(s.total for s in g.conv_sections),
        }

    a, b = shape(src), shape(dst)
    diff = {k: (a[k], b[k]) for k in a if a[k] != b[k]}
    if diff:
        raise PeerIncompatible(f"layer groups {src.name} / {dst.name} differ: {diff}")


#: where (layer, role) lies in one side's pools
Locator = Callable[[int, Role], Where]


def _locator(table: PageTable) -> Locator:
    pools = {pool.name: i for i, pool in enumerate(p for g in table.pool_groups for p in g.pools)}

    def locate(layer_id: int, role: Role) -> Where:
        pool, entry = table.locate(layer_id, role)
        base = pool.base + pool.layer_ids.index(layer_id) * pool.layer_stride + entry.offset
        return base, pool.slot_stride, pools[pool.name]

    return locate


def _paged_pieces(
    out: _PieceBuilder,
    src: LayerGroup,
    dst: LayerGroup,
    layers: list[int],
    where: tuple[Locator, Locator],
    ranks: tuple[int, int],
) -> None:
    """One piece per (layer, role, head) of a PAGED group both ranks hold, if the sender is elected for them."""
    src_at, dst_at = where
    lo, hi = head_overlap(src.heads, dst.heads)
    if not (lo < hi and elected(src.heads, ranks[0], dst.heads, ranks[1])):
        return
    for layer in layers:
        for role in src.roles:
            head_bytes = src.head_dim * dtype_from_name(src.dtype(role)).itemsize
            s_base, s_stride, s_pool = src_at(layer, role)
            d_base, d_stride, d_pool = dst_at(layer, role)
            for head in range(lo, hi):
                s_off = (head - src.heads.first) * src.tokens_per_block * head_bytes
                d_off = (head - dst.heads.first) * dst.tokens_per_block * head_bytes
                out.add((s_base + s_off, s_stride, s_pool), (d_base + d_off, d_stride, d_pool), head_bytes)


def _state_pieces(
    out: _PieceBuilder,
    src: LayerGroup,
    dst: LayerGroup,
    layers: list[int],
    where: tuple[Locator, Locator],
    ranks: tuple[int, int],
) -> None:
    """The pieces of a STATE group's slot: per layer, the conv channels of each section both ranks hold, and the
    run of SSM heads both hold (each only if the sender is elected for it)."""
    src_at, dst_at = where
    s_rank, d_rank = ranks
    channel = src.conv_channel_bytes
    # role-major: every layer's conv, then every layer's SSM, so runs stay inside one pool and merge
    for role in src.roles:
        for layer in layers:
            s_base, s_stride, s_pool = src_at(layer, role)
            d_base, d_stride, d_pool = dst_at(layer, role)
            if role == Role.CONV:
                s_sec = d_sec = 0
                for s_shard, d_shard in zip(src.conv_sections, dst.conv_sections, strict=True):
                    lo, hi = head_overlap(s_shard, d_shard)
                    if lo < hi and elected(s_shard, s_rank, d_shard, d_rank):
                        s_off = s_sec + (lo - s_shard.first) * channel
                        d_off = d_sec + (lo - d_shard.first) * channel
                        out.add(
                            (s_base + s_off, s_stride, s_pool),
                            (d_base + d_off, d_stride, d_pool),
                            (hi - lo) * channel,
                        )
                    s_sec += s_shard.count * channel
                    d_sec += d_shard.count * channel
            else:
                per_head = src.ssm_bytes_per_head
                lo, hi = head_overlap(src.heads, dst.heads)
                if lo < hi and elected(src.heads, s_rank, dst.heads, d_rank):
                    s_off = (lo - src.heads.first) * per_head
                    d_off = (lo - dst.heads.first) * per_head
                    out.add(
                        (s_base + s_off, s_stride, s_pool),
                        (d_base + d_off, d_stride, d_pool),
                        (hi - lo) * per_head,
                    )


def group_map(src_table: PageTable, src: LayerGroup, dst_table: PageTable, dst: LayerGroup) -> GroupMap:
    """The pieces of sender group ``src`` paired with receiver group ``dst`` (over the layers both hold).

    :raises ~kvferry.errors.PeerIncompatible: the groups differ in kind, roles, dtypes or whole-model shapes.
    """
    _check_geometry(src, dst)
    dst_layers = set(dst.layer_ids)
    layers = [layer for layer in src.layer_ids if layer in dst_layers]
    where = (_locator(src_table), _locator(dst_table))
    ranks = (src_table.rank, dst_table.rank)
    out = _PieceBuilder()
    if src.kind == GroupKind.PAGED:
        _paged_pieces(out, src, dst, layers, where, ranks)
    else:
        _state_pieces(out, src, dst, layers, where, ranks)
    src_side, dst_side, length = out.sides()
    return GroupMap(
        src_group=src.name,
        dst_group=dst.name,
        kind=src.kind,
        draft=is_draft(src),
        src_tokens_per_block=src.tokens_per_block,
        dst_tokens_per_block=dst.tokens_per_block,
        src_num_slots=src_table.pool_group(src.name).num_slots,
        dst_num_slots=dst_table.pool_group(dst.name).num_slots,
        src=src_side,
        dst=dst_side,
        length=length,
    )
