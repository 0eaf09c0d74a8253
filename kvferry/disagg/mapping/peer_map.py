"""A whole peer pair: the rank maps between a sender (context) engine's ranks and a receiver (generation)
engine's ranks, built from the page tables the handshake exchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from attrs import define

from kvferry.disagg.mapping.compat import check_peer
from kvferry.disagg.mapping.rank_map import RankMap, warn_skipped
from kvferry.disagg.mapping.ranks import overlapping_ranks
from kvferry.disagg.mapping.request import RequestCache, TokenRange
from kvferry.errors import ConfigError, PeerIncompatible
from kvferry.pools.pagetable import PageTable

__all__ = ["PeerMap"]


def _by_rank(tables: Sequence[PageTable], side: str) -> dict[int, PageTable]:
    if not tables:
        raise ConfigError(f"no {side} page tables")
    sizes = {t.tp_size for t in tables}
    if len(sizes) != 1:
        raise PeerIncompatible(f"{side} page tables disagree on the TP size: {sorted(sizes)}")
    out: dict[int, PageTable] = {}
    for t in tables:
        if t.rank in out:
            raise ConfigError(f"two {side} page tables for rank {t.rank}")
        out[t.rank] = t
    return out


@define(eq=False)
class PeerMap:
    """The mapping between a sender (context) engine's ranks and a receiver (generation) engine's ranks.

    Build with :meth:`build` from the tables this process knows: a sender rank passes its own table and every
    receiver rank's, a receiver rank every sender rank's and its own (any subset works; pairs need both tables).
    Rank overlap needs only the TP sizes.
    """

    src_tp: int
    dst_tp: int
    _pairs: dict[tuple[int, int], RankMap]
    skipped: tuple[str, ...]

    @classmethod
    def build(cls, senders: Sequence[PageTable], receivers: Sequence[PageTable]) -> PeerMap:
        """Pair every overlapping (sender, receiver) rank of the given tables; one warning if draft groups are
        skipped.

        :raises ~kvferry.errors.PeerIncompatible: as :meth:`RankMap.build`, or tables of one side that disagree
            on the TP size. :raises ~kvferry.errors.ConfigError: on no tables or a rank given twice.
        """
        src = _by_rank(senders, "sender")
        dst = _by_rank(receivers, "receiver")
        src_tp = next(iter(src.values())).tp_size
        dst_tp = next(iter(dst.values())).tp_size
        first = next(iter(src.values()))
        for table in src.values():
            check_peer(
                first, table, here=f"on sender rank {first.rank}", there=f"on sender rank {table.rank}"
            )
        for table in dst.values():
            check_peer(first, table, here="on the sender", there="on the receiver")
        pairs: dict[tuple[int, int], RankMap] = {}
        skipped: list[str] = []
        for s, s_table in sorted(src.items()):
            for d in overlapping_ranks(src_tp, s, dst_tp):
                if d in dst:
                    pair = RankMap.build(s_table, dst[d], warn=False)
                    pairs[s, d] = pair
                    skipped.extend(n for n in pair.skipped if n not in skipped)
        # head shards that break the overlap rule would make a non-overlapping pair exchange bytes
        for s, s_table in sorted(src.items()):
            for d, d_table in sorted(dst.items()):
                if (s, d) not in pairs:
                    RankMap.build(s_table, d_table, warn=False)
        if skipped:
            warn_skipped(skipped, first, next(iter(dst.values())))
        return cls(src_tp=src_tp, dst_tp=dst_tp, pairs=pairs, skipped=tuple(skipped))

    def __repr__(self) -> str:
        senders = sorted({s for s, _ in self._pairs})
        receivers = sorted({d for _, d in self._pairs})
        skipped = f" skipped {list(self.skipped)}" if self.skipped else ""
        return f"<PeerMap tp {self.src_tp}->{self.dst_tp} senders {senders} receivers {receivers}{skipped}>"

    def targets(self, src_rank: int) -> tuple[int, ...]:
        """Receiver ranks sender ``src_rank`` reports to for every request (empty writes included)."""
        return tuple(overlapping_ranks(self.src_tp, src_rank, self.dst_tp))

    def expected_writers(self, dst_rank: int) -> tuple[int, ...]:
        """Sender ranks receiver ``dst_rank`` waits for (every overlapping rank, elected out or not)."""
        return tuple(overlapping_ranks(self.dst_tp, dst_rank, self.src_tp))

    def prepare_source(self, src_ranks: Sequence[int], src: RequestCache, tokens: TokenRange) -> None:
        """Work out the sender ranks ``src_ranks``' side of a transfer of ``tokens`` ahead of its receive request
        (kept in ``src``; a request for another token range works its own out when planned).

        :raises ~kvferry.errors.ConfigError: as :meth:`RankMap.plan`, for the sender's ids and slot.
        """
        for s in src_ranks:
            for d in self.targets(s):
                pair = self.pair(s, d)
                if pair.writes:
                    pair.source_addresses(src, tokens)
                    pair.source_ids(src, tokens)

    def pair(self, src_rank: int, dst_rank: int) -> RankMap:
        """:raises ~kvferry.errors.ConfigError: unless both tables were given and the ranks overlap."""
        try:
            return self._pairs[src_rank, dst_rank]
        except KeyError:
            raise ConfigError(f"no mapping for sender rank {src_rank} -> receiver rank {dst_rank}") from None

    def pairs(self) -> tuple[RankMap, ...]:
        return tuple(self._pairs.values())

    def writes(self, src_rank: int, dst_rank: int) -> bool:
        """Whether ``src_rank`` writes bytes to ``dst_rank`` (False for non-overlapping or elected-out pairs)."""
        pair = self._pairs.get((src_rank, dst_rank))
        return pair is not None and pair.writes

    def overlap_table(self) -> npt.NDArray[np.bool_]:
        """``[src_tp, dst_tp]`` booleans: which ranks overlap."""
        out = np.zeros((self.src_tp, self.dst_tp), dtype=np.bool_)
        for s in range(self.src_tp):
            out[s, list(self.targets(s))] = True
        return out

    def statistics(self) -> dict[str, Any]:
        return {
            "src_tp": self.src_tp,
            "dst_tp": self.dst_tp,
            "pairs": len(self._pairs),
            "writing_pairs": sum(p.writes for p in self._pairs.values()),
            "pieces": sum(p.num_pieces for p in self._pairs.values()),
            "skipped": list(self.skipped),
        }
