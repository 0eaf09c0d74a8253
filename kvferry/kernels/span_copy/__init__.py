"""Batched device copies: any number of ``(source address, destination address, length)`` spans in one launch.

Used by :mod:`kvferry.kernels.copy` (the bounce path's gather and scatter) and the transports' CUDA paths (a
same-process copy, or a CUDA IPC mapping of a peer's memory). Addresses are absolute device addresses in this
process, so spans may join any allocations of one device (a pool and a staging buffer, or our pool and the
peer's mapped one) in a single launch: one launch costs the host far less than a ``copy_`` per span.

The spans are cut on the host (numpy) into pieces of at most :data:`PIECE_BYTES` (fewer bytes when that gives
about :data:`TARGET_PIECES` pieces, so that a few long spans do not keep a few programs busy after the rest
finished), copied in words of the widest size (8, 4, 2 or 1 bytes) that divides every address and length. When
every address and length is a multiple of 16 bytes the kernel is told so, and it moves 16 bytes per load and
store. One kernel has three forms:

- the *fragment rows* (:func:`copy_fragments`, what the transports' CUDA writes use): a transport's paired
  ``[n, 2]`` (address, length) arrays go to the device as they are, one after the other; one program per
  :data:`GRID_BLOCK_BYTES` block of the mean row, a row's programs taking one more round per multiple of it
  (merged neighbours), in 16-byte words. No piece table: the host copies the rows into pinned memory, checks
  their alignment and uploads them, the least host work any form needs;
- the *grid* (pieces alike in length, :func:`grid_of`): one program per :data:`GRID_BLOCK_BYTES` block of a
  piece, as a plain copy's programs, the shape that comes closest to the device's own ``copy_``; its table is
  in device memory (uploaded on the stream into a buffer kept per stream and thread);
- the *loop*: one program per piece, looping over its blocks, for pieces of mixed lengths; the kernel reads its
  table straight from pinned host memory when the caller holds it until the copy ran (a transport write), else
  uploaded.

Indexed copies (:func:`indexed_table`, :func:`copy_indexed`) are the same kernel reading a table of rows whose
addresses come from ids (a row's address at id 0 plus the id times its stride, on each side): the table is built
and uploaded once per template (an indexed write's, :mod:`kvferry.transports.indexed`) and every launch passes
only the ids, so a disaggregated writer's host work per request is a check of its ids and one launch.

Nothing here validates: callers check every span against what they own or registered first. An address outside
an allocation is a device fault that kills the process. Triton is imported lazily, when the kernel is first
built.

The parts, each importing only those above it:

- :mod:`~kvferry.kernels.span_copy.kernel`: the Triton kernel, its shapes and compile-time constants;
- :mod:`~kvferry.kernels.span_copy.tables`: the host tables (numpy) and the grid form's launch grid;
- :mod:`~kvferry.kernels.span_copy.cuda`: libcuda through ctypes, the current stream and device;
- :mod:`~kvferry.kernels.span_copy.buffers`: pinned and device buffers the tables and ids live in, and uploads;
- :mod:`~kvferry.kernels.span_copy.launch`: the compiled kernels' launches;
- :mod:`~kvferry.kernels.span_copy.copies` and :mod:`~kvferry.kernels.span_copy.indexed`: the public copies.
"""

from __future__ import annotations

from kvferry.kernels.span_copy.buffers import pinned_ids
from kvferry.kernels.span_copy.copies import copy_fragments, copy_spans
from kvferry.kernels.span_copy.cuda import on_device
from kvferry.kernels.span_copy.indexed import IndexedTable, copy_indexed, indexed_table
from kvferry.kernels.span_copy.kernel import (
    BLOCK_WORDS,
    GRID_NUM_WARPS,
    LONG_BLOCK_WORDS,
    LONG_NUM_WARPS,
    LONG_PIECE_BYTES,
    NUM_WARPS,
    PROGRAMS_PER_SM,
    ROTATE,
    STREAMING,
    available,
)
from kvferry.kernels.span_copy.tables import (
    FRAGMENT_ROUNDS,
    GRID,
    GRID_BLOCK_BYTES,
    GRID_RECUT,
    GRID_WASTE,
    MIN_PIECE_BYTES,
    PIECE_BYTES,
    TARGET_PIECES,
    FragmentTable,
    PieceTable,
    fragment_table,
    grid_of,
    piece_table,
)

__all__ = [
    "BLOCK_WORDS",
    "FRAGMENT_ROUNDS",
    "GRID",
    "GRID_BLOCK_BYTES",
    "GRID_NUM_WARPS",
    "GRID_RECUT",
    "GRID_WASTE",
    "LONG_BLOCK_WORDS",
    "LONG_NUM_WARPS",
    "LONG_PIECE_BYTES",
    "MIN_PIECE_BYTES",
    "NUM_WARPS",
    "PIECE_BYTES",
    "PROGRAMS_PER_SM",
    "ROTATE",
    "STREAMING",
    "TARGET_PIECES",
    "FragmentTable",
    "IndexedTable",
    "PieceTable",
    "available",
    "copy_fragments",
    "copy_indexed",
    "copy_spans",
    "fragment_table",
    "grid_of",
    "indexed_table",
    "on_device",
    "piece_table",
    "pinned_ids",
]
