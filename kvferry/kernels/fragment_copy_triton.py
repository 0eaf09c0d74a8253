"""Triton kernels for the bounce path on CUDA: gather ``(offset, length)`` fragments into staging and back.

The torch path in :mod:`kvferry.kernels.copy` copies rows of the fragments' common granularity with one indexed
copy (or one slice per large fragment); on CUDA that is one index entry per row and a launch per large fragment.
Here the fragments are cut on the host (numpy) into pieces of at most ``PIECE_BYTES`` and each Triton program
copies one piece with the widest word (8, 4, 2 or 1 bytes) that divides every address and length: one launch
for any number of fragments, with no index tensor in device memory.

These functions do no validation: :mod:`kvferry.kernels.copy` checks bounds and overlaps first and calls them only
for CUDA tensors when Triton imports. Triton is imported lazily, so importing this module is free.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

__all__ = ["PIECE_BYTES", "available", "copy_fragments", "triton_imports"]

#: Largest number of bytes one program copies; fragments are cut into pieces of at most this size.
PIECE_BYTES = 1 << 16
_WORDS_PER_ITERATION = 1024


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # No annotations but constexpr: Triton resolves a jitted function's annotations as globals.
    @triton.jit  # type: ignore[untyped-decorator,misc]
    def copy_pieces(  # type: ignore[no-untyped-def]
        src_ptr, dst_ptr, src_words, dst_words, num_words, WORD: tl.constexpr, BLOCK: tl.constexpr
    ):
        piece = tl.program_id(0)
        src_start = tl.load(src_words + piece)
        dst_start = tl.load(dst_words + piece)
        count = tl.load(num_words + piece)
        if WORD == 8:
            src = src_ptr.to(tl.pointer_type(tl.int64))
            dst = dst_ptr.to(tl.pointer_type(tl.int64))
        elif WORD == 4:
            src = src_ptr.to(tl.pointer_type(tl.int32))
            dst = dst_ptr.to(tl.pointer_type(tl.int32))
        elif WORD == 2:
            src = src_ptr.to(tl.pointer_type(tl.int16))
            dst = dst_ptr.to(tl.pointer_type(tl.int16))
        else:
            src = src_ptr
            dst = dst_ptr
        for start in range(0, count, BLOCK):
            lanes = start + tl.arange(0, BLOCK)
            mask = lanes < count
            values = tl.load(src + src_start + lanes, mask=mask)
            tl.store(dst + dst_start + lanes, values, mask=mask)

    return copy_pieces


@functools.cache
def triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives on CUDA and Triton can be imported."""
    return tensor.is_cuda and triton_imports()


def _word_size(*values: np.ndarray | int) -> int:
    combined = 0
    for value in values:
        if isinstance(value, np.ndarray):
            if value.size:
                combined |= int(np.bitwise_or.reduce(value.astype(np.int64)))
        else:
            combined |= int(value)
    for word in (8, 4, 2):
        if combined % word == 0:
            return word
    return 1


def copy_fragments(
    src: torch.Tensor,
    src_offsets: np.ndarray,
    dst: torch.Tensor,
    dst_offsets: np.ndarray,
    lengths: np.ndarray,
) -> None:
    """Copy ``lengths[i]`` bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]`` for every ``i``.

    ``src`` and ``dst`` are 1-D uint8 CUDA tensors on one device; offsets are relative to each tensor's first
    element. The caller has validated every range. Runs on the current stream; returns without synchronising.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    keep = lengths > 0
    if not keep.any():
        return
    src_offsets = np.asarray(src_offsets, dtype=np.int64)[keep]
    dst_offsets = np.asarray(dst_offsets, dtype=np.int64)[keep]
    lengths = lengths[keep]
    word = _word_size(src_offsets, dst_offsets, lengths, src.data_ptr(), dst.data_ptr())
    pieces_per_fragment = (lengths + PIECE_BYTES - 1) // PIECE_BYTES
    fragment_of_piece = np.repeat(np.arange(lengths.size), pieces_per_fragment)
    first_piece = np.cumsum(pieces_per_fragment) - pieces_per_fragment
    within = (np.arange(fragment_of_piece.size) - first_piece[fragment_of_piece]) * PIECE_BYTES
    piece_lengths = np.minimum(lengths[fragment_of_piece] - within, PIECE_BYTES)
    table = np.stack(
        [
            (src_offsets[fragment_of_piece] + within) // word,
            (dst_offsets[fragment_of_piece] + within) // word,
            piece_lengths // word,
        ]
    )
    device_table = torch.from_numpy(np.ascontiguousarray(table)).to(src.device, non_blocking=True)
    _kernel()[(table.shape[1],)](
        src,
        dst,
        device_table[0],
        device_table[1],
        device_table[2],
        WORD=word,
        BLOCK=_WORDS_PER_ITERATION,
    )
