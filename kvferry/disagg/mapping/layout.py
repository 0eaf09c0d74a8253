"""A transfer's layout: the units of one token range in canonical order, and their addresses per request.

For a token range, each PAGED group's tokens are cut where a page of either side ends (so each segment lies
in one page per side) and each segment takes the runs of its group's pieces (:meth:`.pieces.GroupMap.runs`);
a STATE group takes its slot's runs once. The result, a :class:`Layout`, lists every *unit* (a run of pieces
over one segment) with, per side, which block table entry holds its page (or the slot), its address in page
or slot 0 and the stride, so a request costs a few numpy operations per group: ``base + page_id * stride``
(:func:`unit_addresses`).

A layout depends on the two tables and the token range only, never on page ids: units come in a canonical
order that the receiver can compute without the sender's ids (how a bounced transfer's staging bytes line up).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs
import numpy as np
from attrs import frozen

from kvferry.disagg.mapping.arrays import EMPTY, Int64Array, read_only
from kvferry.disagg.mapping.pieces import GroupMap
from kvferry.disagg.mapping.request import RequestCache, TokenRange
from kvferry.pools.layout import GroupKind
from kvferry.transports.indexed import IndexedRows

__all__ = [
    "LAYOUTS_KEPT",
    "Layout",
    "Part",
    "PartSide",
    "build_layout",
    "id_vector",
    "indexed_template",
    "unit_addresses",
]

#: token ranges whose layout (and indexed template) a rank map keeps (the oldest is dropped)
LAYOUTS_KEPT = 16


def _segments(lo: int, hi: int, a: int, b: int) -> tuple[Int64Array, Int64Array]:
    """Split tokens ``[lo, hi)`` at every multiple of ``a`` and of ``b``: each piece lies in one page per side."""
    cuts = np.arange((lo // a + 1) * a, hi, a, dtype=np.int64)
    if b != a:
        cuts = np.union1d(cuts, np.arange((lo // b + 1) * b, hi, b, dtype=np.int64))
    starts = np.concatenate((np.asarray([lo], dtype=np.int64), cuts))
    ends = np.concatenate((cuts, np.asarray([hi], dtype=np.int64)))
    return starts, ends


def _page_runs(g: GroupMap, seg_tokens: Int64Array) -> tuple[Int64Array, Int64Array, Int64Array]:
    """The runs (:meth:`GroupMap.runs`) of every segment of a PAGED group in canonical order (segment-major):
    ``(segment index, first piece, bytes)`` per run. Segments of one length share one run table (typically all
    but the first and last segment are whole pages)."""
    count = len(seg_tokens)
    if count and seg_tokens.min() == seg_tokens.max():
        piece, bytes_per_token = g.runs(int(seg_tokens[0]))
        seg = np.repeat(np.arange(count, dtype=np.int64), len(piece))
        return seg, np.tile(piece, count), seg_tokens[seg] * np.tile(bytes_per_token, count)
    values, inverse = np.unique(seg_tokens, return_inverse=True)
    tables = [g.runs(int(v)) for v in values.tolist()]
    runs = np.asarray([len(t[0]) for t in tables], dtype=np.int64)
    first = np.zeros((len(tables), int(runs.max(initial=0))), dtype=np.int64)
    per_token = np.zeros_like(first)
    for i, (p, t) in enumerate(tables):
        first[i, : len(p)] = p
        per_token[i, : len(t)] = t
    per_segment = runs[inverse]
    seg = np.repeat(np.arange(count, dtype=np.int64), per_segment)
    j = np.arange(len(seg), dtype=np.int64) - np.repeat(np.cumsum(per_segment) - per_segment, per_segment)
    table = inverse[seg]
    return seg, first[table, j], seg_tokens[seg] * per_token[table, j]


@frozen(eq=False)
class Part:
    """One group's units in a :class:`Layout` (rows ``where``). Per unit and side: which entry of the block
    table holds its page (``*_page``; None for a STATE group: the slot), the address in page or slot 0, and the
    stride; the unit's address is ``base + page_or_slot * stride``."""

    group: GroupMap
    where: slice
    lo: int
    hi: int
    src_page: Int64Array | None
    src_base: Int64Array
    src_stride: Int64Array
    dst_page: Int64Array | None
    dst_base: Int64Array
    dst_stride: Int64Array

    def side(self, *, src: bool) -> PartSide:
        """One side of the part: its units' page entries, bases and strides, and its group's name, page size and
        pool size on that side."""
        g = self.group
        if src:
            return PartSide(
                self.src_page,
                self.src_base,
                self.src_stride,
                g.src_group,
                g.src_tokens_per_block,
                g.src_num_slots,
            )
        return PartSide(
            self.dst_page,
            self.dst_base,
            self.dst_stride,
            g.dst_group,
            g.dst_tokens_per_block,
            g.dst_num_slots,
        )


class PartSide(NamedTuple):
    page: Int64Array | None
    base: Int64Array
    stride: Int64Array
    group: str
    tokens_per_block: int
    num_slots: int


@frozen(eq=False)
class Layout:
    """The units of a transfer of one token range in canonical order, without page ids: per group a
    :class:`Part`, lengths and pool indices per unit, bytes (per group and in all) and the number of units before
    pieces of one page or slot contiguous on both sides were merged (:meth:`GroupMap.runs`; the merged rows hold
    the same bytes in the same order)."""

    parts: tuple[Part, ...]
    length: Int64Array
    src_pool: Int64Array
    dst_pool: Int64Array
    nbytes: int
    count: int
    bytes_per_group: tuple[tuple[str, int], ...]
    #: per side (True: the sender's), what its id vector is made of: per part the group, its page size, its
    #: pool size, the token range and whether it is a state group (the vector's key in a RequestCache)
    ids_keys: dict[bool, tuple[Any, ...]] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        keys = {
            src: (
                "ids",
                src,
                *(
                    (side.group, side.tokens_per_block, side.num_slots, part.lo, part.hi, side.page is None)
                    for part in self.parts
                    for side in (part.side(src=src),)
                ),
            )
            for src in (True, False)
        }
        object.__setattr__(self, "ids_keys", keys)


def build_layout(groups: tuple[GroupMap, ...], tokens: TokenRange) -> Layout:
    """Everything of a transfer of ``tokens`` over ``groups`` that does not depend on page ids or slots: target
    PAGED groups move ``[start, end)``, draft groups ``[draft_start, end)``, STATE groups their whole slot when
    ``tokens.state``."""
    parts: list[Part] = []
    lengths: list[Int64Array] = []
    src_pools: list[Int64Array] = []
    dst_pools: list[Int64Array] = []
    per_group: dict[str, int] = {}
    count = offset = 0
    for g in groups:
        if g.num_pieces == 0:
            continue
        if g.kind == GroupKind.PAGED:
            lo = tokens.draft_start if g.draft else tokens.start
            hi = tokens.end
            if lo >= hi:
                continue
            a, b = g.src_tokens_per_block, g.dst_tokens_per_block
            starts, ends = _segments(lo, hi, a, b)
            seg, piece, length = _page_runs(g, ends - starts)
            count += len(starts) * g.num_pieces
            at = starts[seg]
            per_token = g.length[piece]
            part = Part(
                g,
                slice(offset, offset + len(piece)),
                lo,
                hi,
                read_only(at // a),
                read_only(g.src.base[piece] + (at % a) * per_token),
                read_only(g.src.stride[piece]),
                read_only(at // b),
                read_only(g.dst.base[piece] + (at % b) * per_token),
                read_only(g.dst.stride[piece]),
            )
        else:
            if not tokens.state:
                continue
            piece, length = g.runs(1)
            count += g.num_pieces
            part = Part(
                g,
                slice(offset, offset + len(piece)),
                0,
                0,
                None,
                read_only(g.src.base[piece]),
                read_only(g.src.stride[piece]),
                None,
                read_only(g.dst.base[piece]),
                read_only(g.dst.stride[piece]),
            )
        parts.append(part)
        offset += len(piece)
        src_pools.append(g.src.pool[piece])
        dst_pools.append(g.dst.pool[piece])
        lengths.append(length)
        per_group[g.dst_group] = per_group.get(g.dst_group, 0) + int(length.sum())

    def cat(arrays: list[Int64Array]) -> Int64Array:
        return read_only(np.concatenate(arrays).astype(np.int64, copy=False)) if arrays else EMPTY

    length = cat(lengths)
    return Layout(
        parts=tuple(parts),
        length=length,
        src_pool=cat(src_pools),
        dst_pool=cat(dst_pools),
        nbytes=int(length.sum()),
        count=count,
        bytes_per_group=tuple(per_group.items()),
    )


def unit_addresses(layout: Layout, cache: RequestCache, *, src: bool) -> Int64Array:
    """The start address of every unit of ``layout`` on one side, from that side's page ids and slot.

    :raises ~kvferry.errors.ConfigError: as :meth:`.request.RequestCache.pages` and
        :meth:`~.request.RequestCache.state_slot` (a receiver's page ids must not repeat).
    """
    out = np.empty(len(layout.length), dtype=np.int64)
    for part in layout.parts:
        side = part.side(src=src)
        view = out[part.where]
        if side.page is None:
            np.multiply(side.stride, cache.state_slot(side.group, side.num_slots), out=view)
        else:
            pages = cache.pages(
                side.group, side.tokens_per_block, side.num_slots, part.lo, part.hi, unique=not src
            )
            np.multiply(pages[side.page], side.stride, out=view)
        view += side.base
    return out


def id_vector(layout: Layout, cache: RequestCache, *, src: bool) -> Int64Array:
    """One side's id vector of the layout's indexed template for ``cache``: per group of the layout, the page ids
    of its token range (PAGED) or the slot (STATE), validated as :func:`unit_addresses` validates them. Kept in
    ``cache`` under what it is made of (groups, page sizes, pool sizes, token ranges): the rank pairs of a
    request that read the same ids (every sender rank's, the same receiver groups of every receiving rank) share
    one vector."""
    key = layout.ids_keys[src]

    def compute() -> Int64Array:
        parts: list[Int64Array] = []
        for name, tpb, slots, lo, hi, state in key[2:]:
            if state:
                parts.append(np.full(1, cache.state_slot(name, slots), dtype=np.int64))
            else:
                pages = cache.pages(name, tpb, slots, lo, hi, unique=not src)
                parts.append(pages[lo // tpb : (hi - 1) // tpb + 1])
        return np.concatenate(parts) if parts else EMPTY

    return cache.kept(key, compute)


def indexed_template(layout: Layout) -> IndexedRows:
    """The layout as an indexed template (:class:`~kvferry.transports.indexed.IndexedRows`): its units, in the
    same order, with each side's address left to a position in that side's id vector (:func:`id_vector`)."""
    # per side: each row's position in the id vector, its base and stride; and each position's limit
    columns: dict[bool, tuple[list[Int64Array], ...]] = {True: ([], [], [], []), False: ([], [], [], [])}
    for part in layout.parts:
        rows_of_part = part.where.stop - part.where.start
        for src in (True, False):
            side = part.side(src=src)
            slot, base, stride, limit = columns[src]
            at = sum(len(x) for x in limit)
            if side.page is None:  # a STATE group: one position, the slot
                slot.append(np.full(rows_of_part, at, dtype=np.int64))
                count = 1
            else:  # the pages holding [lo, hi): block table entries first..last
                first = part.lo // side.tokens_per_block
                slot.append(side.page - first + at)
                count = (part.hi - 1) // side.tokens_per_block - first + 1
            base.append(side.base)
            stride.append(side.stride)
            limit.append(np.full(count, side.num_slots, dtype=np.int64))

    def cat(arrays: list[Int64Array]) -> Int64Array:
        return np.concatenate(arrays) if arrays else EMPTY

    (ss, sb, st, sl), (ds, db, dt, dl) = ([cat(c) for c in columns[src]] for src in (True, False))
    return IndexedRows(ss, sb, st, ds, db, dt, layout.length, sl, dl)
