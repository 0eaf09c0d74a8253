"""What a plan is made of: the bounce policy, a transfer's fragments, a staging layout, and their statistics.

A :class:`TransferPlan` is what one sender rank writes to one receiver rank for one request: the coalesced
fragments of a direct write and, when the :class:`BouncePolicy` finds a side fragmented, that side's runs in
canonical (staging) order. A :class:`StagingPlan` packs one side's runs back to back in a staging buffer;
sender and receiver compute theirs independently and list the same bytes in the same order. The functions
at the end turn a transfer's unit arrays (address and length per unit, one side) into fragments and plans.

Nothing here touches memory except :meth:`StagingPlan.gather` / :meth:`StagingPlan.scatter`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np
import torch
from attrs import frozen

from kvferry.disagg.mapping.arrays import EMPTY, Int64Array
from kvferry.disagg.mapping.request import non_negative
from kvferry.errors import ConfigError
from kvferry.kernels.copy import gather_fragments, scatter_fragments
from kvferry.transports.base import Fragments

__all__ = [
    "BouncePolicy",
    "MappingStatistics",
    "StagingPlan",
    "StagingSegment",
    "TransferPlan",
    "coalesced",
    "run_fragments",
    "run_starts",
    "staging_plan",
]


@frozen
class BouncePolicy:
    """When to stage a transfer: at least ``min_fragments`` fragments after coalescing whose mean length is
    below ``max_mean_bytes``. ``BouncePolicy(min_fragments=0, max_mean_bytes=2**62)`` always bounces (non-empty
    transfers), ``BouncePolicy.never()`` never does."""

    min_fragments: int = attrs.field(default=256, validator=non_negative)
    max_mean_bytes: int = attrs.field(default=16 << 10, validator=non_negative)

    @classmethod
    def never(cls) -> BouncePolicy:
        return cls(min_fragments=1 << 62, max_mean_bytes=0)

    @classmethod
    def always(cls) -> BouncePolicy:
        return cls(min_fragments=1, max_mean_bytes=1 << 62)

    def wants(self, fragments: int, nbytes: int) -> bool:
        return fragments > 0 and fragments >= self.min_fragments and nbytes < self.max_mean_bytes * fragments


@frozen
class MappingStatistics:
    """What one transfer (or a sum of them) moves.

    ``units``: pieces before coalescing (one per layer/role/head/token run, conv section run or SSM head run);
    ``fragments``: after merging units contiguous on both sides (what a direct write posts); ``posted``: what is
    actually written (1 per staged transfer); ``gather_fragments`` / ``scatter_fragments``: runs the staging
    kernels copy (0 unless bounced); ``bytes_per_group``: (group name, bytes) pairs.
    """

    nbytes: int = 0
    units: int = 0
    fragments: int = 0
    posted: int = 0
    bounced: int = 0
    gather_fragments: int = 0
    scatter_fragments: int = 0
    bytes_per_group: tuple[tuple[str, int], ...] = ()

    @property
    def bounce(self) -> bool:
        return self.bounced > 0

    def __add__(self, other: MappingStatistics) -> MappingStatistics:
        groups: dict[str, int] = dict(self.bytes_per_group)
        for name, nbytes in other.bytes_per_group:
            groups[name] = groups.get(name, 0) + nbytes
        return MappingStatistics(
            nbytes=self.nbytes + other.nbytes,
            units=self.units + other.units,
            fragments=self.fragments + other.fragments,
            posted=self.posted + other.posted,
            bounced=self.bounced + other.bounced,
            gather_fragments=self.gather_fragments + other.gather_fragments,
            scatter_fragments=self.scatter_fragments + other.scatter_fragments,
            bytes_per_group=tuple(groups.items()),
        )

    @classmethod
    def total(cls, items: Iterable[MappingStatistics]) -> MappingStatistics:
        out = cls()
        for item in items:
            out = out + item
        return out


@frozen(eq=False)
class StagingSegment:
    """``fragments`` (``(n, 2)`` int64 ``(offset in pool, length)``) of pool ``pool``, packed back to back at
    ``offset`` of the staging buffer (``nbytes`` in all)."""

    pool: str
    offset: int
    nbytes: int
    fragments: Int64Array


@frozen(eq=False)
class StagingPlan:
    """One side's staging layout of a bounced transfer: the bytes of its fragments, packed in canonical order.

    The sender's plan (:attr:`TransferPlan.gather`) and the receiver's
    (:meth:`~kvferry.disagg.mapping.RankMap.scatter_plan`) list the same bytes in the same order, so staging byte
    ``i`` of the sender lands at staging byte ``i`` of the receiver.
    """

    nbytes: int
    segments: tuple[StagingSegment, ...]

    @property
    def num_fragments(self) -> int:
        return sum(len(s.fragments) for s in self.segments)

    def _check(self, pools: Mapping[str, torch.Tensor], staging: torch.Tensor) -> None:
        missing = sorted({s.pool for s in self.segments} - set(pools))
        if missing:
            raise ConfigError(f"no pool tensors for {missing}")
        if staging.dim() != 1 or staging.dtype != torch.uint8 or staging.numel() < self.nbytes:
            raise ConfigError(f"staging must be a 1-D uint8 tensor of at least {self.nbytes} bytes")

    def gather(self, pools: Mapping[str, torch.Tensor], staging: torch.Tensor) -> torch.Tensor:
        """Pack the fragments' bytes of ``pools`` (``CacheArena.pool_tensors()``) into ``staging``; returns the
        first :attr:`nbytes` bytes of it. Reads only.

        :raises ~kvferry.errors.ConfigError: on a missing pool or a staging buffer too small (nothing written).
        """
        self._check(pools, staging)
        for segment in self.segments:
            out = staging[segment.offset : segment.offset + segment.nbytes]
            gather_fragments(pools[segment.pool], segment.fragments, out)
        return staging[: self.nbytes]

    def scatter(self, pools: Mapping[str, torch.Tensor], staging: torch.Tensor) -> None:
        """Unpack ``staging`` into the fragments of ``pools``: the inverse of :meth:`gather`.

        :raises ~kvferry.errors.ConfigError: on a missing pool or a staging buffer too small; nothing is written
            then. A failure inside a later segment leaves earlier segments written (they only touch the request's
            own pages and slot).
        """
        self._check(pools, staging)
        for segment in self.segments:
            scatter_fragments(
                pools[segment.pool],
                segment.fragments,
                staging[segment.offset : segment.offset + segment.nbytes],
            )


@frozen(eq=False)
class TransferPlan:
    """What sender rank ``src_rank`` writes to receiver rank ``dst_rank`` for one request.

    ``src`` / ``dst``: coalesced fragments (absolute addresses) of a direct write; empty when this sender is
    elected out of every byte (it still reports an empty write). ``gather``: set when the policy finds the
    sender's side fragmented (its runs, :attr:`src_runs`): pack with ``gather.gather(pools, staging)``; then
    write :meth:`staged_fragments` into the receiver's staging area (a bounce: the receiver unpacks with its own
    :meth:`~kvferry.disagg.mapping.RankMap.scatter_plan`) or the packed bytes into :attr:`dst_runs` (the
    receiver's side is not fragmented). ``src_runs`` / ``dst_runs``: each side's bytes in canonical (staging) order, merged where that
    side alone is contiguous (within one pool); None when the policy can never bounce. Writing ``src_runs`` into
    the receiver's staging area is the other half-bounce (only the receiver's side is fragmented).
    """

    src_rank: int
    dst_rank: int
    src: Fragments
    dst: Fragments
    gather: StagingPlan | None
    statistics: MappingStatistics
    src_runs: Fragments | None = None
    dst_runs: Fragments | None = None

    @property
    def empty(self) -> bool:
        return len(self.src) == 0

    @property
    def nbytes(self) -> int:
        return self.statistics.nbytes

    def staged_fragments(
        self, src_staging: int, dst_staging: int, *, chunk_bytes: int = 0
    ) -> tuple[Fragments, Fragments]:
        """The write of a bounced transfer: ``nbytes`` from address ``src_staging`` to ``dst_staging``, in chunks
        of ``chunk_bytes`` (0: one fragment)."""
        n = self.nbytes
        step = chunk_bytes if chunk_bytes > 0 else max(n, 1)
        offsets = np.arange(0, n, step, dtype=np.uint64)
        lengths = np.minimum(np.uint64(step), np.uint64(n) - offsets)
        src = np.stack([offsets + np.uint64(src_staging), lengths], axis=1)
        dst = np.stack([offsets + np.uint64(dst_staging), lengths], axis=1)
        return np.ascontiguousarray(src), np.ascontiguousarray(dst)


# --- from one transfer's unit arrays (address, length and pool per unit) ---------------------------------------


def coalesced(src: Int64Array, dst: Int64Array, length: Int64Array) -> tuple[Fragments, Fragments]:
    """``(address, length)`` fragments of both sides, consecutive units contiguous on both sides merged (what
    :func:`~kvferry.transports.base.coalesce` does, on the unit arrays)."""
    if len(length) > 1:
        joins = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
        if joins.any():
            starts = np.flatnonzero(np.concatenate(([True], ~joins)))
            src, dst, length = src[starts], dst[starts], np.add.reduceat(length, starts)
    out_src = np.empty((len(length), 2), dtype=np.uint64)
    out_dst = np.empty((len(length), 2), dtype=np.uint64)
    out_src[:, 0], out_src[:, 1] = src, length
    out_dst[:, 0], out_dst[:, 1] = dst, length
    return out_src, out_dst


def run_starts(address: Int64Array, length: Int64Array, pool: Int64Array) -> Int64Array:
    """Indices of the units that start a run of units contiguous on this side (and in one pool)."""
    if len(address) == 0:
        return EMPTY
    joins = (address[:-1] + length[:-1] == address[1:]) & (pool[:-1] == pool[1:])
    return np.flatnonzero(np.concatenate(([True], ~joins)))


def run_fragments(address: Int64Array, length: Int64Array, starts: Int64Array) -> Fragments:
    """``(address, length)`` of the runs of units beginning at ``starts``."""
    out = np.empty((len(starts), 2), dtype=np.uint64)
    if len(starts):
        out[:, 0], out[:, 1] = address[starts], np.add.reduceat(length, starts)
    return out


def staging_plan(
    address: Int64Array, length: Int64Array, pool: Int64Array, names: Sequence[str], bases: Int64Array
) -> StagingPlan:
    """Merge consecutive units contiguous on this side (and in one pool) and pack them into a staging layout."""
    n = len(address)
    if n == 0:
        return StagingPlan(nbytes=0, segments=())
    starts = run_starts(address, length, pool)
    run_address, run_pool = address[starts], pool[starts]
    run_length = np.add.reduceat(length, starts)
    staging = np.concatenate(([0], np.cumsum(run_length)))
    cuts = np.flatnonzero(np.concatenate(([True], run_pool[1:] != run_pool[:-1], [True])))
    segments: list[StagingSegment] = []
    for a, b in itertools.pairwise(cuts.tolist()):
        p = int(run_pool[a])
        fragments = np.stack([run_address[a:b] - bases[p], run_length[a:b]], axis=1).astype(np.int64)
        segments.append(
            StagingSegment(
                pool=names[p],
                offset=int(staging[a]),
                nbytes=int(staging[b] - staging[a]),
                fragments=np.ascontiguousarray(fragments),
            )
        )
    return StagingPlan(nbytes=int(staging[-1]), segments=tuple(segments))
