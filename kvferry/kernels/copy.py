"""Copies over byte arenas: fixed-size blocks by index, and (offset, length) fragments to and from staging.

Everything here is plain torch on ``torch.uint8`` tensors, so it runs on any device (cpu in CI, cuda:N on a GPU);
fragment gathers and scatters on CUDA use the batched Triton copy of :mod:`kvferry.kernels.span_copy`.
Elsewhere they copy large fragments as slices and small ones by rows of ``g`` bytes (``g`` = gcd of every offset
and length; :mod:`kvferry.kernels.rows`, see :data:`SLICE_ROWS_HOST`): no index entry per byte, so the copy runs
near memory bandwidth whatever the alignment.
A *block view* is a 2-D strided view ``[count, block_bytes]`` of an arena whose rows start ``stride`` bytes
apart (a pool's slots or pages); ``gather``/``scatter``/``copy``/``zero`` act on its rows by an index tensor.

Every function validates its indices and fragments before it writes anything: a bad input raises
:class:`~kvferry.errors.ConfigError` and leaves the arena unchanged (an out-of-range index would be a device
assert on CUDA, which kills the process).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from kvferry.errors import ConfigError
from kvferry.kernels import span_copy
from kvferry.kernels.rows import as_rows, copy_rows, granularity, row_dtype, row_indices

__all__ = [
    "CHUNK_ROWS",
    "SLICE_BYTES",
    "SLICE_ROWS_DEVICE",
    "SLICE_ROWS_HOST",
    "as_index",
    "block_view",
    "copy_blocks",
    "fragments_tensor",
    "gather_blocks",
    "gather_fragments",
    "scatter_blocks",
    "scatter_fragments",
    "zero_blocks",
]

IndexLike = torch.Tensor | Sequence[int] | np.ndarray
FragmentsLike = torch.Tensor | np.ndarray | Sequence[tuple[int, int]]


def _check_arena(arena: torch.Tensor) -> None:
    if arena.dtype != torch.uint8 or arena.dim() != 1 or not arena.is_contiguous():
        raise ConfigError(
            f"an arena is a contiguous 1-D torch.uint8 tensor, got {arena.dtype} {tuple(arena.shape)}"
        )


def block_view(
    arena: torch.Tensor, *, count: int, stride: int, block_bytes: int, offset: int = 0
) -> torch.Tensor:
    """The ``[count, block_bytes]`` view of ``arena`` whose row ``i`` starts at ``offset + i * stride``.

    :raises ~kvferry.errors.ConfigError: if the rows do not fit in the arena.
    """
    _check_arena(arena)
    if count < 0 or block_bytes < 0 or offset < 0 or stride < 0:
        raise ConfigError("count, block_bytes, offset and stride must be non-negative")
    if count > 1 and stride < block_bytes:
        raise ConfigError(f"stride {stride} < block_bytes {block_bytes}: rows would overlap")
    if count and offset + (count - 1) * stride + block_bytes > arena.numel():
        raise ConfigError(
            f"{count} blocks of {block_bytes} bytes at stride {stride} from {offset} exceed the arena "
            f"({arena.numel()} bytes)"
        )
    return arena.as_strided((count, block_bytes), (stride, 1), arena.storage_offset() + offset)


def as_index(ids: IndexLike, *, count: int, device: torch.device, unique: bool = False) -> torch.Tensor:
    """``ids`` as an int64 index tensor on ``device``, checked to lie in ``[0, count)`` (and to be unique).

    :raises ~kvferry.errors.ConfigError: on a non-integer, out-of-range or (with ``unique``) repeated id.
    """
    if isinstance(ids, torch.Tensor):
        index = ids
    else:
        try:
            array = np.asarray(ids)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"ids must be integers: {exc}") from None
        if array.size == 0:
            array = np.zeros(0, dtype=np.int64)
        if not np.issubdtype(array.dtype, np.integer) or array.dtype == np.uint64:
            raise ConfigError(f"ids must be integers, got {array.dtype}")
        index = torch.from_numpy(np.ascontiguousarray(array.reshape(-1), dtype=np.int64))
    if index.dtype.is_floating_point or index.dtype.is_complex or index.dtype == torch.bool:
        raise ConfigError(f"ids must be an integer tensor, got {index.dtype}")
    index = index.reshape(-1).to(device=device, dtype=torch.int64)
    if index.numel():
        low, high = int(index.min()), int(index.max())
        if low < 0 or high >= count:
            raise ConfigError(f"ids must lie in [0, {count}), got range [{low}, {high}]")
        if unique and torch.unique(index).numel() != index.numel():
            raise ConfigError("destination ids must not repeat")
    return index


def gather_blocks(view: torch.Tensor, ids: IndexLike, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` of a block view, as a new (or the given) contiguous ``[len(ids), block_bytes]`` tensor."""
    index = as_index(ids, count=view.shape[0], device=view.device)
    if out is None:
        return view.index_select(0, index)
    if out.shape != (index.numel(), view.shape[1]) or out.dtype != view.dtype:
        raise ConfigError(
            f"out must be {view.dtype} [{index.numel()}, {view.shape[1]}], got {tuple(out.shape)}"
        )
    return torch.index_select(view, 0, index, out=out)


def scatter_blocks(view: torch.Tensor, ids: IndexLike, data: torch.Tensor) -> None:
    """Write ``data[i]`` into row ``ids[i]`` of a block view. ``data`` may live on another device."""
    index = as_index(ids, count=view.shape[0], device=view.device, unique=True)
    if data.dtype != view.dtype or tuple(data.shape) != (index.numel(), view.shape[1]):
        raise ConfigError(
            f"data must be {view.dtype} [{index.numel()}, {view.shape[1]}], got {data.dtype} {tuple(data.shape)}"
        )
    view.index_copy_(0, index, data.to(view.device, non_blocking=True))


def copy_blocks(view: torch.Tensor, src: IndexLike, dst: IndexLike) -> None:
    """Row ``src[i]`` -> row ``dst[i]``; every read happens before any write (overlapping src/dst is fine)."""
    src_index = as_index(src, count=view.shape[0], device=view.device)
    dst_index = as_index(dst, count=view.shape[0], device=view.device, unique=True)
    if src_index.numel() != dst_index.numel():
        raise ConfigError(f"{src_index.numel()} source ids but {dst_index.numel()} destination ids")
    view.index_copy_(0, dst_index, view.index_select(0, src_index))


def zero_blocks(view: torch.Tensor, ids: IndexLike) -> None:
    """Zero rows ``ids`` of a block view."""
    index = as_index(ids, count=view.shape[0], device=view.device)
    view.index_fill_(0, index, 0)


def fragments_tensor(fragments: FragmentsLike) -> torch.Tensor:
    """Fragments ``[n, 2]`` of ``(offset, length)`` as an int64 CPU tensor.

    :raises ~kvferry.errors.ConfigError: on a wrong shape, a non-integer, a negative offset or length.
    """
    if isinstance(fragments, torch.Tensor):
        table = fragments.detach().to("cpu")
        if table.numel() == 0:
            table = torch.zeros((0, 2), dtype=torch.int64)
        elif table.dtype.is_floating_point or table.dtype.is_complex or table.dtype == torch.bool:
            raise ConfigError(f"fragments must be integers, got {table.dtype}")
        table = table.to(torch.int64)
    else:
        try:
            array = np.asarray(fragments)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ConfigError(f"fragments must be an [n, 2] integer array: {exc}") from None
        if array.size == 0:
            array = np.zeros((0, 2), dtype=np.int64)
        if not np.issubdtype(array.dtype, np.integer) or array.dtype == np.uint64:
            raise ConfigError(f"fragments must be int64, got {array.dtype}")
        table = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))
    if table.dim() != 2 or table.shape[1] != 2:
        raise ConfigError(f"fragments must be [n, 2] (offset, length), got {tuple(table.shape)}")
    if table.numel() and int(table.min()) < 0:
        raise ConfigError("fragment offsets and lengths must be non-negative")
    return table


def _checked_fragments(
    arena: torch.Tensor, fragments: FragmentsLike, *, disjoint: bool
) -> tuple[torch.Tensor, int]:
    """Validate fragments against ``arena``; return the ``[n, 2]`` table and the total length."""
    _check_arena(arena)
    table = fragments_tensor(fragments)
    offsets, lengths = table[:, 0], table[:, 1]
    total = int(lengths.sum()) if table.numel() else 0
    if table.numel():
        if int((offsets + lengths).max()) > arena.numel():
            raise ConfigError(f"a fragment ends past the arena ({arena.numel()} bytes)")
        if disjoint:
            nonempty = lengths > 0
            starts, lens = offsets[nonempty], lengths[nonempty]
            order = torch.argsort(starts)
            starts, ends = starts[order], (starts + lens)[order]
            if starts.numel() > 1 and bool((ends[:-1] > starts[1:]).any()):
                raise ConfigError("destination fragments overlap")
    return table, total


#: A fragment of at least this many rows (of the granularity ``g``) or :data:`SLICE_BYTES` bytes is copied as one
#: slice; smaller ones go through one indexed copy over ``[rows, g]`` views. An indexed row costs a little more
#: than its bytes, a slice one copy call: a numpy call on the host, a kernel launch on a GPU without Triton
#: (dearer, so it takes more rows to pay for it).
SLICE_ROWS_HOST = 32
SLICE_ROWS_DEVICE = 256
#: Indexed copies of rows this long run far below memcpy on the host (torch's index_select), so fragments this
#: long are always slices; indexed rows therefore stay shorter.
SLICE_BYTES = 256 << 10
#: Indexed copies run in chunks of at most about this many rows, bounding the int64 index (8 bytes a row).
CHUNK_ROWS = 1 << 22


def _torch_copy(
    src: torch.Tensor,
    src_offsets: np.ndarray,
    dst: torch.Tensor,
    dst_offsets: np.ndarray,
    lengths: np.ndarray,
) -> None:
    """Copy ``lengths[i]`` bytes ``src[src_offsets[i]:]`` -> ``dst[dst_offsets[i]:]`` (1-D uint8, one device,
    validated, destinations disjoint and not overlapping the sources).

    Rows: ``g`` = gcd of every offset and length, so every fragment is whole ``[g]`` rows of both tensors, viewed
    as the widest integer dtype that divides ``g`` and both starts. Fragments of at least
    :data:`SLICE_ROWS_HOST` rows (:data:`SLICE_ROWS_DEVICE` on a GPU) or :data:`SLICE_BYTES` bytes are one slice
    copy each (numpy on the host: a torch call costs more); the others are indexed row copies, in chunks of
    about :data:`CHUNK_ROWS` rows.
    """
    keep = lengths > 0
    src_offsets, dst_offsets, lengths = src_offsets[keep], dst_offsets[keep], lengths[keep]
    if not lengths.size:
        return
    g = granularity(src_offsets, dst_offsets, lengths)
    counts = lengths // g
    host = src.device.type == "cpu" and dst.device.type == "cpu"
    big = (counts >= (SLICE_ROWS_HOST if host else SLICE_ROWS_DEVICE)) | (lengths >= SLICE_BYTES)
    slices = zip(src_offsets[big].tolist(), dst_offsets[big].tolist(), lengths[big].tolist(), strict=True)
    if host:
        s_host, d_host = src.numpy(), dst.numpy()  # a numpy slice copy costs less host time than torch's
        for s, d, n in slices:
            d_host[d : d + n] = s_host[s : s + n]
    else:
        for s, d, n in slices:
            dst[d : d + n].copy_(src[s : s + n])
    small = np.flatnonzero(~big)
    if not small.size:
        return
    dtype = row_dtype(g, src, dst)
    s_rows, d_rows = as_rows(src, g, dtype), as_rows(dst, g, dtype)
    s_first, d_first, counts = src_offsets[small] // g, dst_offsets[small] // g, counts[small]
    # cut between fragments every ~CHUNK_ROWS rows (each fragment has < SLICE_ROWS_* rows)
    ends = np.cumsum(counts)
    cuts = np.searchsorted(ends, np.arange(CHUNK_ROWS, int(ends[-1]), CHUNK_ROWS), side="left") + 1
    for lo, hi in itertools.pairwise([0, *np.unique(cuts).tolist(), small.size]):
        if lo < hi:
            copy_rows(
                s_rows,
                row_indices(s_first[lo:hi], counts[lo:hi]),
                d_rows,
                row_indices(d_first[lo:hi], counts[lo:hi]),
            )


def _triton_copy(
    src: torch.Tensor,
    src_offsets: np.ndarray,
    dst: torch.Tensor,
    dst_offsets: np.ndarray,
    lengths: np.ndarray,
) -> bool:
    """Copy with the Triton kernel when both tensors are on one CUDA device; False when it does not apply."""
    if not (src.is_cuda and dst.device == src.device and span_copy.available(src.device)):
        return False
    s_base, d_base = src.data_ptr(), dst.data_ptr()
    return span_copy.copy_spans(src.device, s_base + src_offsets, d_base + dst_offsets, lengths) is not None


def gather_fragments(
    arena: torch.Tensor, fragments: FragmentsLike, staging: torch.Tensor | None = None
) -> torch.Tensor:
    """Concatenate the bytes of ``fragments`` (``(offset, length)`` into ``arena``) into one staging buffer.

    :param staging: a 1-D uint8 tensor of at least the total length on the arena's device; a new one is made
        when None. The result is its first ``total`` bytes.
    :raises ~kvferry.errors.ConfigError: on a fragment outside the arena or a staging buffer too small.
    """
    table, total = _checked_fragments(arena, fragments, disjoint=False)
    if staging is None:
        staging = torch.empty(total, dtype=torch.uint8, device=arena.device)
    _check_arena(staging)
    if staging.numel() < total or staging.device != arena.device:
        raise ConfigError(f"staging must hold {total} bytes on {arena.device}")
    out = staging[:total]
    offsets, lengths = table[:, 0].numpy(), table[:, 1].numpy()
    firsts = np.cumsum(lengths) - lengths
    if not _triton_copy(arena, offsets, out, firsts, lengths):
        _torch_copy(arena, offsets, out, firsts, lengths)
    return out


def scatter_fragments(arena: torch.Tensor, fragments: FragmentsLike, staging: torch.Tensor) -> None:
    """Write the staging buffer back into ``fragments`` of ``arena``: the inverse of :func:`gather_fragments`.

    :raises ~kvferry.errors.ConfigError: on overlapping destination fragments, a fragment outside the arena or
        a staging buffer too small; nothing is written then.
    """
    table, total = _checked_fragments(arena, fragments, disjoint=True)
    _check_arena(staging)
    if staging.numel() < total:
        raise ConfigError(f"staging holds {staging.numel()} bytes, fragments need {total}")
    source = staging[:total].to(arena.device, non_blocking=True)
    offsets, lengths = table[:, 0].numpy(), table[:, 1].numpy()
    firsts = np.cumsum(lengths) - lengths
    if not _triton_copy(source, firsts, arena, offsets, lengths):
        _torch_copy(source, firsts, arena, offsets, lengths)
