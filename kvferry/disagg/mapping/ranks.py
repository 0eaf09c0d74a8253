"""Tensor-parallel shard maths: which ranks of two TP groups exchange bytes, and who writes a duplicated head.

Rank ``r`` of a TP group of size ``T`` holds the share ``[r/T, (r+1)/T)`` of the model; a sender rank and a
receiver rank *overlap* when their shares intersect (:func:`overlapping_ranks`). A receiver expects a result
from every overlapping sender rank, including ranks that hold nothing it needs (an empty write). The bytes of a
head (kv head, SSM head, conv channel) that several ranks hold (duplicated when the TP size exceeds the head
count) are written by exactly one sender rank per receiver rank (:func:`elected`).
"""

from __future__ import annotations

from kvferry.errors import ConfigError
from kvferry.pools.spec import HeadShard

__all__ = ["elected", "head_overlap", "overlapping_ranks"]


def overlapping_ranks(tp_size: int, rank: int, peer_tp_size: int) -> range:
    """Ranks of a peer of ``peer_tp_size`` whose share of the model intersects the share of ``rank``.

    Symmetric: a sender's receivers are ``overlapping_ranks(src_tp, src_rank, dst_tp)`` and a receiver's expected
    writers ``overlapping_ranks(dst_tp, dst_rank, src_tp)``. TP 1->2: rank 0 -> (0, 1); TP 4->2: receiver 1 <- (2, 3).

    :raises ~kvferry.errors.ConfigError: on a non-positive size or a rank out of range.
    """
    if tp_size <= 0 or peer_tp_size <= 0 or not 0 <= rank < tp_size:
        raise ConfigError(f"bad TP geometry: rank {rank} of {tp_size}, peer size {peer_tp_size}")
    return range(rank * peer_tp_size // tp_size, -(-(rank + 1) * peer_tp_size // tp_size))


def elected(src: HeadShard, src_rank: int, dst: HeadShard, dst_rank: int) -> bool:
    """Whether sender ``src_rank`` writes the heads it shares with receiver ``dst_rank``.

    Ranks holding the same heads are *replicas*; ``rank % replicas`` is a rank's replica index. Receiver replica
    ``j`` of ``R`` reads from sender replica ``j * S // R`` of ``S``: the sender replica whose share of the model
    holds the start of the receiver's, so each receiver byte has exactly one writer, the writer always overlaps
    the receiver (:func:`overlapping_ranks`), equal TP sizes pair rank ``r`` with rank ``r``, and fan-out spreads
    over the sender's replicas. Without duplication on the sender side (``S == 1``) every holder is elected.
    """
    return src_rank % src.replicas == (dst_rank % dst.replicas) * src.replicas // dst.replicas


def head_overlap(src: HeadShard, dst: HeadShard) -> tuple[int, int]:
    """The heads ``[lo, hi)`` both shards hold (``lo >= hi``: none)."""
    return max(src.first, dst.first), min(src.first + src.count, dst.first + dst.count)
