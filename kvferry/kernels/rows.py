"""Copies of byte ranges as rows: every range cut into rows of ``g`` bytes (``g`` the gcd of every offset and
length, so each range is whole rows on both sides), the rows viewed as the widest integer that divides ``g``,
and copied as one slice where both sides are one run of rows, else by an index of rows.

One index entry per row, not per byte, so the copy runs near memory bandwidth whatever the alignment. This is
the copy wherever the batched span copy (:mod:`kvferry.kernels.span_copy`) does not apply: the pools' fragment
gathers and scatters off CUDA or without Triton (:mod:`kvferry.kernels.copy`), and the transports' device copies
without Triton (:mod:`kvferry.transports._memory`).

Nothing here validates: callers check every range against the tensors first, and that no destination overlaps
another range. Torch is imported when a copy runs, so a module that imports this one does not load it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    import torch

__all__ = [
    "GATHER_CHUNK_BYTES",
    "as_rows",
    "copy_by_rows",
    "copy_rows",
    "granularity",
    "row_dtype",
    "row_indices",
    "run_start",
]

#: Bound on the temporary buffer of a copy scattered on both sides (rows gathered, then scattered).
GATHER_CHUNK_BYTES = 256 << 20

Int64Array = npt.NDArray[np.int64]


def granularity(*arrays: npt.NDArray[np.integer]) -> int:
    """The gcd of every value given (offsets and lengths): the largest row size that cuts every range; 1 when
    nothing (or only zeros) is given."""
    values = [np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays]
    combined = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
    return max(int(np.gcd.reduce(combined)), 1) if combined.size else 1


def row_indices(starts: Int64Array, counts: Int64Array) -> Int64Array:
    """``concat(arange(s, s + c) for s, c)`` as int64, without a Python loop."""
    firsts = np.cumsum(counts) - counts
    return np.repeat(starts - firsts, counts) + np.arange(int(counts.sum()), dtype=np.int64)


def row_dtype(g: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest integer dtype whose size divides ``g`` and the start of every tensor (wider elements: fewer of
    them per row to index)."""
    import torch

    for width, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if g % width == 0 and all(
            t.data_ptr() % width == 0 and t.storage_offset() % width == 0 for t in tensors
        ):
            return dtype
    return torch.uint8


def as_rows(tensor: torch.Tensor, g: int, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` (1-D uint8) as ``[numel // g, g]`` rows of ``dtype`` elements (the tail shorter than a row
    dropped)."""
    usable = tensor.numel() // g * g
    return tensor[:usable].view(dtype).view(-1, g // dtype.itemsize)


def run_start(index: Int64Array) -> int | None:
    """The first value when ``index`` is one run ``a, a+1, ...``; else None."""
    n = index.size
    if n and int(index[-1]) - int(index[0]) == n - 1 and bool(np.all(np.diff(index) == 1)):
        return int(index[0])
    return None


def copy_rows(src: torch.Tensor, src_index: Int64Array, dst: torch.Tensor, dst_index: Int64Array) -> None:
    """``dst[dst_index[i]] = src[src_index[i]]`` over row views (:func:`as_rows`) of one device, queued on its
    current stream: a slice copy where both sides are one run, an ``index_select`` into a run, an
    ``index_copy_`` from a run, else rows gathered into a temporary (at most :data:`GATHER_CHUNK_BYTES` at a
    time) and scattered. Destinations are distinct and do not overlap the sources."""
    import torch

    n = src_index.size
    a, b = run_start(src_index), run_start(dst_index)

    def index(values: Int64Array) -> torch.Tensor:
        return torch.from_numpy(values).to(src.device, non_blocking=True)

    if a is not None and b is not None:
        dst[b : b + n].copy_(src[a : a + n], non_blocking=True)
    elif b is not None:
        torch.index_select(src, 0, index(src_index), out=dst[b : b + n])
    elif a is not None:
        dst.index_copy_(0, index(dst_index), src[a : a + n])
    else:
        step = max(1, GATHER_CHUNK_BYTES // max(src.shape[1] * src.element_size(), 1))
        for lo in range(0, n, step):
            staged = src.index_select(0, index(src_index[lo : lo + step]))
            dst.index_copy_(0, index(dst_index[lo : lo + step]), staged)


def copy_by_rows(
    src: torch.Tensor,
    src_offsets: Int64Array,
    dst: torch.Tensor,
    dst_offsets: Int64Array,
    lengths: Int64Array,
) -> None:
    """Queue ``lengths[i]`` bytes ``src[src_offsets[i]:]`` -> ``dst[dst_offsets[i]:]`` (1-D uint8 tensors of one
    device; every length positive) on the current stream: one slice copy for one range, else the ranges cut
    into rows of their :func:`granularity` and copied by :func:`copy_rows`. Returns at once; the caller
    synchronises."""
    if len(lengths) == 1:
        a, b, n = int(src_offsets[0]), int(dst_offsets[0]), int(lengths[0])
        dst[b : b + n].copy_(src[a : a + n], non_blocking=True)
        return
    g = granularity(src_offsets, dst_offsets, lengths)
    dtype = row_dtype(g, src, dst)
    counts = lengths // g
    copy_rows(
        as_rows(src, g, dtype),
        row_indices(src_offsets // g, counts),
        as_rows(dst, g, dtype),
        row_indices(dst_offsets // g, counts),
    )
