"""One (sender rank, receiver rank) pair: which bytes of the sender's pages go where in the receiver's.

:meth:`RankMap.build` pairs the layer groups of two page tables by their global layer ids and precomputes the
pieces of each pair (:mod:`.pieces`). Per request, :meth:`RankMap.plan` (sender) turns a token range's layout
(:mod:`.layout`, kept per range) and both sides' page ids into a :class:`~.plans.TransferPlan`;
:meth:`RankMap.scatter_plan`, :meth:`RankMap.destinations` and :meth:`RankMap.nbytes` (receiver) need only the
receiver's ids. :meth:`RankMap.indexed_rows` gives the same units as a template a transport checks once per
token range, :meth:`RankMap.indexed_write` one request's ids for it.

Groups: paired groups must agree on kind, roles, dtypes and whole-model shapes (else
:class:`~kvferry.errors.PeerIncompatible`); the page size (``tokens_per_block``) may differ: pages are mapped
by token ranges. Draft groups (ids from ``DRAFT_LAYER_SHIFT``) that only one side has are skipped (the
receiver's drafter then starts cold); a target layer only one side has is PeerIncompatible.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import numpy as np
from attrs import define

from kvferry.disagg.mapping.arrays import Int64Array
from kvferry.disagg.mapping.compat import check_peer
from kvferry.disagg.mapping.layout import (
    LAYOUTS_KEPT,
    Layout,
    build_layout,
    id_vector,
    indexed_template,
    unit_addresses,
)
from kvferry.disagg.mapping.pieces import GroupMap, group_map, is_draft
from kvferry.disagg.mapping.plans import (
    BouncePolicy,
    MappingStatistics,
    StagingPlan,
    TransferPlan,
    coalesced,
    run_fragments,
    run_starts,
    staging_plan,
)
from kvferry.disagg.mapping.ranks import overlapping_ranks
from kvferry.disagg.mapping.request import RequestCache, TokenRange
from kvferry.errors import PeerIncompatible
from kvferry.pools.pagetable import PageTable
from kvferry.transports.base import Fragments
from kvferry.transports.indexed import IndexedRows, IndexedWrite

__all__ = ["RankMap", "warn_skipped"]

log = logging.getLogger(__name__)


def warn_skipped(skipped: Sequence[str], src: PageTable, dst: PageTable) -> None:
    """Say once that the draft groups ``skipped`` exist on one side only."""
    log.warning(
        "draft KV groups %s exist on one side only (sender tp %d, receiver tp %d): skipped, the receiver's "
        "drafter starts without the prompt's draft KV",
        sorted(set(skipped)),
        src.tp_size,
        dst.tp_size,
    )


def _pools(table: PageTable) -> tuple[tuple[str, ...], Int64Array]:
    """Names and base addresses of a table's pools, by pool index."""
    flat = [p for g in table.pool_groups for p in g.pools]
    return tuple(p.name for p in flat), np.asarray([p.base for p in flat], dtype=np.int64)


@define(eq=False)
class RankMap:
    """The mapping from one sender rank's page table to one receiver rank's (build once per peer pair).

    Build with :meth:`build`; per request call :meth:`plan` on the sender and, for a bounced transfer,
    :meth:`scatter_plan` on the receiver. Pure computation: nothing here reads or writes cache memory.
    """

    src_rank: int
    dst_rank: int
    src_tp: int
    dst_tp: int
    overlaps: bool
    groups: tuple[GroupMap, ...]
    skipped: tuple[str, ...]
    _src_pools: tuple[str, ...]
    _dst_pools: tuple[str, ...]
    _src_bases: Int64Array
    _dst_bases: Int64Array
    _layouts: dict[tuple[int, int, int, bool], Layout] = attrs.field(factory=dict, init=False, repr=False)
    _indexed: dict[tuple[int, int, int, bool], IndexedRows] = attrs.field(
        factory=dict, init=False, repr=False
    )

    @classmethod
    def build(cls, src: PageTable, dst: PageTable, *, warn: bool = True) -> RankMap:
        """Pair sender table ``src`` with receiver table ``dst``.

        Draft groups only one side has are skipped (listed in :attr:`skipped`; one warning unless ``warn`` is
        False).

        :raises ~kvferry.errors.PeerIncompatible: on another wire version or model (the message names the first
            difference, :func:`.compat.explain`), paired groups whose shapes or dtypes differ, a target layer
            only one side holds, or head shards that do not follow the tables' TP sizes
            (:func:`.compat.check_shards`).
        """
        check_peer(src, dst, here="on the sender", there="on the receiver")
        groups: list[GroupMap] = []
        skipped: list[str] = []
        matched_dst: set[str] = set()
        for s_group in src.layer_groups:
            s_layers = set(s_group.layer_ids)
            matches = [g for g in dst.layer_groups if s_layers & set(g.layer_ids)]
            covered = set().union(*(set(g.layer_ids) for g in matches)) if matches else set()
            if not matches and is_draft(s_group):
                skipped.append(s_group.name)
                continue
            if covered != s_layers:
                raise PeerIncompatible(
                    f"receiver rank {dst.rank} lacks layers {sorted(s_layers - covered)} of group {s_group.name}"
                )
            for d_group in matches:
                matched_dst.add(d_group.name)
                groups.append(group_map(src, s_group, dst, d_group))
        for d_group in dst.layer_groups:
            if d_group.name in matched_dst:
                continue
            if not is_draft(d_group):
                raise PeerIncompatible(f"sender rank {src.rank} lacks the layers of group {d_group.name}")
            skipped.append(d_group.name)
        overlaps = dst.rank in overlapping_ranks(src.tp_size, src.rank, dst.tp_size)
        if not overlaps and any(g.num_pieces for g in groups):
            raise PeerIncompatible(
                f"head shards of ranks {src.rank}/{src.tp_size} and {dst.rank}/{dst.tp_size} share bytes "
                "although their shares of the model do not overlap"
            )
        if skipped and warn:
            warn_skipped(skipped, src, dst)
        src_pools, src_bases = _pools(src)
        dst_pools, dst_bases = _pools(dst)
        return cls(
            src_rank=src.rank,
            dst_rank=dst.rank,
            src_tp=src.tp_size,
            dst_tp=dst.tp_size,
            overlaps=overlaps,
            groups=tuple(groups),
            skipped=tuple(skipped),
            src_pools=src_pools,
            dst_pools=dst_pools,
            src_bases=src_bases,
            dst_bases=dst_bases,
        )

    def __repr__(self) -> str:
        groups = ", ".join(f"{g.src_group}->{g.dst_group}:{g.num_pieces}" for g in self.groups)
        skipped = f" skipped {list(self.skipped)}" if self.skipped else ""
        return (
            f"<RankMap {self.src_rank}/{self.src_tp} -> {self.dst_rank}/{self.dst_tp}"
            f"{'' if self.overlaps else ' (no overlap)'} pieces [{groups}]{skipped}>"
        )

    @property
    def writes(self) -> bool:
        """Whether this sender rank writes any byte to this receiver rank (False: it reports an empty write)."""
        return any(g.num_pieces for g in self.groups)

    @property
    def num_pieces(self) -> int:
        return sum(g.num_pieces for g in self.groups)

    def _layout(self, tokens: TokenRange) -> Layout:
        """The layout of a transfer of ``tokens`` (computed once per token range and kept, a few ranges at
        most)."""
        key = tokens.key
        layout = self._layouts.get(key)
        if layout is None:
            layout = build_layout(self.groups, tokens)
            if len(self._layouts) >= LAYOUTS_KEPT:
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[key] = layout
        return layout

    def plan(
        self,
        src: RequestCache,
        dst: RequestCache,
        tokens: TokenRange,
        *,
        policy: BouncePolicy | None = None,
    ) -> TransferPlan:
        """The fragments this sender rank writes to this receiver rank for one request.

        :param src: the sender's page ids and slot; ``dst``: the receiver's (from its receive request).
        :param policy: when to bounce (default :class:`~.plans.BouncePolicy`).
        :raises ~kvferry.errors.ConfigError: on a missing group, page ids that do not cover the range or lie out
            of range, repeated destination page ids, or a missing or out-of-range slot.
        """
        policy = BouncePolicy() if policy is None else policy
        layout = self._layout(tokens)
        src_address = self.source_addresses(src, tokens)
        dst_address = unit_addresses(layout, dst, src=False)
        length = layout.length
        src_frags, dst_frags = coalesced(src_address, dst_address, length)
        nbytes = layout.nbytes
        fragments = len(src_frags)
        gather: StagingPlan | None = None
        src_runs = dst_runs = None
        if len(length) >= policy.min_fragments:  # else no side can look fragmented enough to stage
            src_starts = run_starts(src_address, length, layout.src_pool)
            dst_starts = run_starts(dst_address, length, layout.dst_pool)
            src_runs = run_fragments(src_address, length, src_starts)
            dst_runs = run_fragments(dst_address, length, dst_starts)
            if policy.wants(len(src_starts), nbytes):
                gather = staging_plan(src_address, length, layout.src_pool, self._src_pools, self._src_bases)
        statistics = MappingStatistics(
            nbytes=nbytes,
            units=layout.count,
            fragments=fragments,
            posted=(1 if nbytes else 0) if gather is not None else fragments,
            bounced=int(gather is not None),
            gather_fragments=0 if gather is None else gather.num_fragments,
            scatter_fragments=0 if gather is None or dst_runs is None else len(dst_runs),
            bytes_per_group=layout.bytes_per_group,
        )
        return TransferPlan(
            src_rank=self.src_rank,
            dst_rank=self.dst_rank,
            src=src_frags,
            dst=dst_frags,
            gather=gather,
            statistics=statistics,
            src_runs=src_runs,
            dst_runs=dst_runs,
        )

    def source_addresses(self, src: RequestCache, tokens: TokenRange) -> Int64Array:
        """The sender's unit addresses of a transfer of ``tokens`` (kept in ``src`` for later plans of the same
        range: a sender may work them out before the receive request comes).

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`, for the sender's ids and slot.
        """
        return src.kept((self, tokens.key), lambda: unit_addresses(self._layout(tokens), src, src=True))

    def indexed_rows(self, tokens: TokenRange) -> IndexedRows:
        """The template of every request's transfer of ``tokens`` (:class:`~kvferry.transports.indexed.IndexedRows`:
        the units of :meth:`plan`, in the same order, with their addresses left to the page ids and slot of each
        side); computed once per token range and kept, so a transport checks it once
        (:meth:`indexed_write` gives one request's ids)."""
        key = tokens.key
        rows = self._indexed.get(key)
        if rows is None:
            rows = indexed_template(self._layout(tokens))
            if len(self._indexed) >= LAYOUTS_KEPT:
                self._indexed.pop(next(iter(self._indexed)))
            self._indexed[key] = rows
        return rows

    def source_ids(self, src: RequestCache, tokens: TokenRange) -> Int64Array:
        """The sender's id vector of :meth:`indexed_rows` for ``src`` (kept in ``src``, as
        :meth:`source_addresses` keeps its addresses).

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`, for the sender's ids and slot.
        """
        return id_vector(self._layout(tokens), src, src=True)

    def indexed_write(self, src: RequestCache, dst: RequestCache, tokens: TokenRange) -> IndexedWrite | None:
        """This sender rank's write for one request as an indexed write (:meth:`indexed_rows` with both sides'
        ids; its notification left to the caller), or None when it writes nothing. The same bytes in the same
        order as :meth:`plan`'s fragments.

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`.
        """
        rows = self.indexed_rows(tokens)
        if not len(rows):
            return None
        dst_ids = id_vector(self._layout(tokens), dst, src=False)
        return IndexedWrite(rows, self.source_ids(src, tokens), dst_ids)

    def scatter_plan(self, dst: RequestCache, tokens: TokenRange) -> StagingPlan:
        """The receiver's staging layout of a bounced transfer from this sender rank (needs no sender page ids).

        Its :attr:`~.plans.StagingPlan.nbytes` is what to reserve for this sender; unpack with
        ``plan.scatter(arena.pool_tensors(), staging)`` once the sender reports its staged write.

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`, for the receiver's ids.
        """
        layout = self._layout(tokens)
        address = unit_addresses(layout, dst, src=False)
        return staging_plan(address, layout.length, layout.dst_pool, self._dst_pools, self._dst_bases)

    def destinations(self, dst: RequestCache, tokens: TokenRange) -> Fragments:
        """The receiver's byte ranges this sender rank writes for a request (needs no sender ids): the runs of
        :meth:`indexed_rows`' template that stay contiguous on the receiver's side whatever the ids
        (:meth:`~kvferry.transports.indexed.IndexedRows.destination_runs`), at the request's ids. The same bytes
        as :meth:`plan`'s ``dst`` (and :meth:`indexed_write`'s rows): what the receiver grants the writer for
        the request (:func:`~kvferry.disagg.transfer.destinations`).

        :raises ~kvferry.errors.ConfigError: as :meth:`plan`, for the receiver's ids.
        """
        rows = self.indexed_rows(tokens)
        if not len(rows):
            return np.zeros((0, 2), dtype=np.uint64)
        return rows.destination_runs(id_vector(self._layout(tokens), dst, src=False))

    def nbytes(self, dst: RequestCache, tokens: TokenRange) -> int:
        """Bytes this sender rank writes for a request (from the receiver's side; no sender ids needed)."""
        layout = self._layout(tokens)
        unit_addresses(layout, dst, src=False)  # validates the ids
        return layout.nbytes
