"""Chunks: the unit of posting, reporting and cancellation of one writer's part of a transfer."""

from __future__ import annotations

import itertools

import numpy as np
from attrs import frozen

from kvferry.disagg.staging import StagedWrite
from kvferry.transports import Fragments, coalesce, total_bytes
from kvferry.transports.indexed import IndexedWrite

__all__ = ["Chunk", "split_chunks"]

#: the rows of an indexed chunk's plain fragments (its rows are its template's)
_NO_ROWS: Fragments = np.zeros((0, 2), dtype=np.uint64)
_NO_ROWS.flags.writeable = False


@frozen(eq=False)
class Chunk:
    """One write of one writer: ``src`` fragments (the writer's memory) into ``dst`` (rank ``dst_rank``'s).

    ``staged``: the writer's packing this chunk reads (``src`` lies in its lease); the chunk's bytes are packed
    right before it is posted. All chunks of a packed writer share one. ``area_offset``: ``dst`` lies in the
    receiver's staging area of this writer, from this offset on (the receiver scatters it); None: ``dst`` are
    the receiver's pages. A bounce has both, a writer whose fragments are small on one side only one of them.

    ``indexed``: the chunk is one indexed write (a direct writer's whole transfer as a template and the
    request's ids; ``src``/``dst`` are empty then), posted by ``transport.write_indexed``.
    """

    dst_rank: int
    src: Fragments
    dst: Fragments
    staged: StagedWrite | None = None
    area_offset: int | None = None
    indexed: IndexedWrite | None = None

    @classmethod
    def of_indexed(cls, dst_rank: int, write: IndexedWrite) -> Chunk:
        return cls(dst_rank, _NO_ROWS, _NO_ROWS, indexed=write)

    @property
    def nbytes(self) -> int:
        return total_bytes(self.src) if self.indexed is None else self.indexed.nbytes

    def fragments(self) -> tuple[Fragments, Fragments]:
        """The chunk's rows as plain ``(src, dst)`` fragments (an indexed chunk's expanded from its ids)."""
        return (self.src, self.dst) if self.indexed is None else self.indexed.expand()

    @property
    def num_fragments(self) -> int:
        """Rows the write posts (an indexed write's template rows)."""
        return len(self.src) if self.indexed is None else len(self.indexed.rows)

    def __repr__(self) -> str:
        kind = " packed" if self.staged is not None else ""
        kind += f" into the area at +{self.area_offset}" if self.area_offset is not None else ""
        kind += " indexed" if self.indexed is not None else ""
        return f"<Chunk -> rank {self.dst_rank}{kind}: {self.num_fragments} fragments, {self.nbytes} bytes>"


def split_chunks(dst_rank: int, src: Fragments, dst: Fragments, *, max_bytes: int) -> list[Chunk]:
    """Coalesce ``src -> dst`` and cut it into chunks of at most ``max_bytes`` (a longer fragment is one chunk).

    Chunks are the unit of posting, of reporting and of cancellation.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    src, dst = coalesce(src, dst)
    if not len(src):
        return []
    ends = np.cumsum(src[:, 1].astype(np.int64))
    chunk_of = (ends - 1) // max_bytes
    # a new chunk starts where the running total crosses a max_bytes boundary
    starts = np.flatnonzero(np.concatenate(([True], chunk_of[1:] != chunk_of[:-1])))
    bounds = [*starts.tolist(), len(src)]
    return [
        Chunk(dst_rank, np.ascontiguousarray(src[a:b]), np.ascontiguousarray(dst[a:b]))
        for a, b in itertools.pairwise(bounds)
    ]
