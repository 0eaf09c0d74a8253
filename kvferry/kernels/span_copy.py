"""Batched device copies: any number of ``(source address, destination address, length)`` spans in one launch.

Shared by :mod:`kvferry.kernels.copy` (the bounce path's gather and scatter) and the transports' CUDA paths
(a same-process copy, or a CUDA IPC mapping of a peer's memory). Addresses are absolute device addresses in this
process, so spans may join any allocations of one device (a pool and a staging buffer, or our pool and the
peer's mapped one) in a single launch.

The spans are cut on the host (numpy) into pieces of at most :data:`PIECE_BYTES` (fewer bytes when that gives
about :data:`TARGET_PIECES` pieces), copied in words of the widest size (8, 4, 2 or 1 bytes) that divides every
address and length. When every address and length is a multiple of 16 bytes the kernel is told so, and it moves
16 bytes per load and store. Three forms of one kernel:

- the *fragment rows* (:func:`copy_fragments`, what the transports' CUDA writes use): a transport's paired
  ``[n, 2]`` (address, length) arrays go to the device as they are, one after the other; one program per
  :data:`GRID_BLOCK_BYTES` block of the mean row, a row's programs taking one more round per multiple of it
  (merged neighbours), in 16-byte words. No piece table: the host copies the rows into pinned memory, checks
  their alignment and uploads them. On the H200 the kernel moves 1 GiB in 1-16 MiB rows at 0.90-0.94 of
  ``copy_`` (``benchmarks/grid_kernel_probe.py --library --burst 5``, ``fragment_copy_h200.json``);
- the *grid* (pieces alike in length, :func:`grid_of`): one program per :data:`GRID_BLOCK_BYTES` block of a
  piece, as a plain copy's programs; its table is in device memory (uploaded on the stream into a buffer kept
  per stream and thread). Its kernel alone runs at 0.93-0.98 of ``copy_`` on the H200
  (``grid_kernel_probe_h200.json``); CUDA events around a single call also count the host's table building
  and launch while the device waits, which is what made it look like 580-700 us for 1 GiB before (``copy_``:
  510-530 us);
- the *loop*: one program per piece, looping over its blocks, for pieces of mixed lengths; the kernel reads its
  table straight from pinned host memory when the caller holds it until the copy ran (a transport write), else
  uploaded.

Under Nsight Compute on one H200 (``benchmarks/ncu_probe.py``; ``benchmarks/results/span_copy_ncu_h200.json``) the
loop form moves 1 GiB in fragments of 1-16 MiB in 556-571 us (``copy_`` of one run: 515 us), whatever the piece
size; pieces of 256 KiB move a disaggregated writer's page mix in 74-92 us where 4 MiB pieces take 103-134 us.

Indexed copies (:func:`indexed_table`, :func:`copy_indexed`) are the same kernel reading a table of rows whose
addresses come from ids (a row's address at id 0 plus the id times its stride, on each side): the table is built
and uploaded once per template (an indexed write's, :mod:`kvferry.transports.indexed`) and every launch passes
only the ids, so a disaggregated writer's host work per request is a check of its ids and one launch.

Nothing here validates: callers check every span against what they own or registered first. An address outside
an allocation is a device fault that kills the process. Triton is imported lazily.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

log = logging.getLogger("kvferry.kernels.span_copy")

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

#: Largest number of bytes one program copies; spans are cut into pieces of at most this size ...
PIECE_BYTES = 4 << 20
#: ... or less, down to this, so that a copy has about :data:`TARGET_PIECES` pieces: a few long spans among many
#: short ones (a state run among pages) would otherwise keep a few programs busy long after the rest finished
MIN_PIECE_BYTES = 256 << 10
TARGET_PIECES = 1024
#: Words one loop iteration of a program loads and stores.
BLOCK_WORDS = 2048
#: Warps per program.
NUM_WARPS = 8
#: Copies whose pieces average at least this many bytes use blocks of LONG_BLOCK_WORDS and LONG_NUM_WARPS warps.
LONG_PIECE_BYTES = 512 << 10
LONG_BLOCK_WORDS = 512
LONG_NUM_WARPS = 4
#: Programs launched per multiprocessor, each looping over pieces; 0 launches one program per piece.
PROGRAMS_PER_SM = 0
#: Load with ``.cg`` and store with ``.cs`` (the bytes are not read again soon).
STREAMING = False
#: Program ``p`` starts at block ``p * ROTATE`` of its piece (mod its blocks); 0 starts every program at 0.
ROTATE = 7
#: Copies whose pieces are alike in length launch one program per block of each piece (a grid of blocks by
#: pieces, the table in device memory) instead of one program per piece looping over its blocks: a plain
#: copy's shape, which on the H200 moves 1 GiB as fast as ``copy_`` (``benchmarks/triton_copy_probe.py``)
#: where programs that loop reach 0.86-0.93 of it.
GRID = True
#: Bytes one program of the grid copies, ...
GRID_BLOCK_BYTES = 4096
#: ... with this many warps.
GRID_NUM_WARPS = 4
#: The grid is used when it launches at most this many programs per block there is to copy (a piece shorter
#: than the longest launches programs that do nothing).
GRID_WASTE = 1.25
#: An indexed table whose rows are too unlike for the grid is cut into shorter pieces (down to a block) where
#: that makes them alike enough (:func:`indexed_table`; built once per template).
GRID_RECUT = True
#: The driver's bound on a grid's second and third dimensions.
_GRID_ROWS = 65535
#: the most pieces a shorter cut may make (a table of 3.5 MiB)
_MAX_RECUT_PIECES = 1 << 16


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    # No annotations but constexpr: Triton resolves a jitted function's annotations as globals.
    @triton.jit(do_not_specialize=["num_pieces"])  # type: ignore[untyped-decorator,misc]
    def copy_pieces(  # type: ignore[no-untyped-def]
        base_ptr,
        table_ptr,
        ids_ptr,
        num_pieces,
        WORD: tl.constexpr,
        ALIGN: tl.constexpr,
        BLOCK: tl.constexpr,
        STREAM: tl.constexpr,
        ROTATE: tl.constexpr,
        INDEXED: tl.constexpr,
        GRID: tl.constexpr,
        FRAGMENTS: tl.constexpr,
        ROUNDS: tl.constexpr,
    ):
        if WORD == 8:
            words = base_ptr.to(tl.pointer_type(tl.int64))
        elif WORD == 4:
            words = base_ptr.to(tl.pointer_type(tl.int32))
        elif WORD == 2:
            words = base_ptr.to(tl.pointer_type(tl.int16))
        else:
            words = base_ptr
        if GRID and FRAGMENTS:
            # rows as a transport pairs them, every address and length a multiple of 16 bytes: the sources'
            # (address, bytes) rows, then the destinations'; a row's programs copy its blocks program_id(0),
            # + num_programs(0), ... (ROUNDS of them, unrolled: one for rows of the mean length). One code path
            # of 16-byte words only: a byte path beside it costs every program registers (occupancy), 25-50%
            # of the bandwidth on the H200
            piece = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
            if piece < num_pieces:
                row = table_ptr + 2 * piece.to(tl.int64)  # type: ignore[attr-defined]
                origin = base_ptr.to(tl.int64, bitcast=True)
                src = (tl.load(row) - origin) // 8
                count = tl.load(row + 1) // 8
                dst = (tl.load(row + 2 * num_pieces.to(tl.int64)) - origin) // 8  # type: ignore[attr-defined]
                first = tl.program_id(0).to(tl.int64) * BLOCK
                stride = tl.num_programs(0).to(tl.int64) * BLOCK
                for r in tl.static_range(ROUNDS):
                    start = first + r * stride
                    lanes = start + tl.arange(0, BLOCK)
                    if start + BLOCK <= count:
                        s = tl.max_contiguous(tl.multiple_of(src + lanes, 2), BLOCK)
                        d = tl.max_contiguous(tl.multiple_of(dst + lanes, 2), BLOCK)
                        tl.store(words + d, tl.load(words + s))
                    elif start < count:
                        mask = lanes < count
                        tl.store(words + dst + lanes, tl.load(words + src + lanes, mask=mask), mask=mask)
        elif GRID:
            # one program per block of a piece: block program_id(0) of piece program_id(1) (+ program_id(2)
            # times the pieces of one grid row, past the driver's 65535 in y), as a plain copy's programs each
            # copy one block; blocks past a shorter piece's end do nothing
            piece = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
            if piece < num_pieces:
                if INDEXED:
                    row = table_ptr + 7 * piece.to(tl.int64)  # type: ignore[attr-defined]
                    src = tl.load(row + 1) + tl.load(ids_ptr + tl.load(row)) * tl.load(row + 2)
                    dst = tl.load(row + 4) + tl.load(ids_ptr + tl.load(row + 3)) * tl.load(row + 5)
                    count = tl.load(row + 6)
                else:
                    row = table_ptr + 3 * piece.to(tl.int64)  # type: ignore[attr-defined]
                    src = tl.load(row)
                    dst = tl.load(row + 1)
                    count = tl.load(row + 2)
                start = tl.program_id(0).to(tl.int64) * BLOCK
                if start + BLOCK <= count:
                    lanes = start + tl.arange(0, BLOCK)
                    s = tl.max_contiguous(tl.multiple_of(src + lanes, ALIGN), BLOCK)
                    d = tl.max_contiguous(tl.multiple_of(dst + lanes, ALIGN), BLOCK)
                    tl.store(words + d, tl.load(words + s))
                elif start < count:
                    lanes = start + tl.arange(0, BLOCK)
                    mask = lanes < count
                    tl.store(words + dst + lanes, tl.load(words + src + lanes, mask=mask), mask=mask)
        else:
            # program p copies pieces p, p + G, p + 2G...: the programs running at one time work on neighbouring
            # pieces (neighbouring bytes of a span), as a plain copy would
            for piece in range(tl.program_id(0), num_pieces, tl.num_programs(0)):
                # tl.cast, not piece.to: Triton's interpreter gives the loop's index as a Python int
                if INDEXED:
                    # (source slot, source word at id 0, source stride, the same for the destination, words):
                    # the addresses come from the write's ids
                    row = table_ptr + 7 * tl.cast(piece, tl.int64)
                    src = tl.load(row + 1) + tl.load(ids_ptr + tl.load(row)) * tl.load(row + 2)
                    dst = tl.load(row + 4) + tl.load(ids_ptr + tl.load(row + 3)) * tl.load(row + 5)
                    count = tl.load(row + 6)
                else:
                    row = table_ptr + 3 * tl.cast(piece, tl.int64)
                    src = tl.load(row)
                    dst = tl.load(row + 1)
                    count = tl.load(row + 2)
                blocks = count // BLOCK
                full = blocks * BLOCK
                # programs start at different blocks of their pieces (and wrap around): with pieces at aligned
                # addresses, programs in lockstep would otherwise hit the same memory channels at once
                shift = (piece * ROTATE) % tl.maximum(blocks, 1)
                for i in range(0, blocks):
                    b = i + shift
                    b = tl.where(b >= blocks, b - blocks, b)
                    lanes = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
                    s = tl.max_contiguous(tl.multiple_of(src + lanes, ALIGN), BLOCK)
                    d = tl.max_contiguous(tl.multiple_of(dst + lanes, ALIGN), BLOCK)
                    if STREAM:
                        values = tl.load(words + s, cache_modifier=".cg")
                        tl.store(words + d, values, cache_modifier=".cs")
                    else:
                        tl.store(words + d, tl.load(words + s))
                if full < count:
                    lanes = full + tl.arange(0, BLOCK)
                    mask = lanes < count
                    tl.store(words + dst + lanes, tl.load(words + src + lanes, mask=mask), mask=mask)

    return copy_pieces


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: Any) -> bool:
    """True when ``device`` (a torch device) is a CUDA device and Triton imports."""
    return getattr(device, "type", None) == "cuda" and _triton_imports()


class _Pointer:
    """What Triton takes for a pointer argument: an address and an element type (bytes by default)."""

    __slots__ = ("address", "dtype")

    def __init__(self, address: int, dtype: Any = None) -> None:
        import torch

        self.address = address
        self.dtype = torch.uint8 if dtype is None else dtype

    def data_ptr(self) -> int:
        return self.address


def _word_and_align(combined: int) -> tuple[int, int]:
    for word in (8, 4, 2):
        if combined % word == 0:
            return word, (2 if word == 8 and combined % 16 == 0 else 1)
    return 1, 1


def piece_table(
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    lengths: npt.NDArray[Any],
    piece_bytes: int = PIECE_BYTES,
    *,
    table_of: Callable[[int], npt.NDArray[np.int64]] | None = None,
) -> PieceTable:
    """The kernel's table ``[pieces, 3]`` of (source word, destination word, words) relative to a base address,
    with the base, the word size and the alignment (in words) the kernel may assume. Empty spans are dropped.

    ``table_of(pieces)``: an empty int64 ``[pieces, 3]`` array to fill (say, a view of pinned host memory the
    kernel reads directly); by default a new numpy array."""
    table_of = _new_table if table_of is None else table_of
    # addresses and lengths as given (fragments are uint64): every value is below 2**63, so the unsigned
    # arithmetic below fills the int64 table with the same numbers, without a converted copy of each input
    src, dst, lengths = (np.asarray(a) for a in (src, dst, lengths))
    if src.dtype != np.uint64 or dst.dtype != np.uint64 or lengths.dtype != np.uint64:
        src, dst, lengths = (a.astype(np.int64, copy=False) for a in (src, dst, lengths))
    if not lengths.size:
        return PieceTable(np.zeros((0, 3), dtype=np.int64), 0, 1, 1, 0, 0)
    if int(lengths.min()) <= 0:
        keep = lengths > 0
        src, dst, lengths = src[keep], dst[keep], lengths[keep]
        if not lengths.size:
            return PieceTable(np.zeros((0, 3), dtype=np.int64), 0, 1, 1, 0, 0)
    base = min(int(src.min()), int(dst.min())) & ~255
    combined = (
        int(np.bitwise_or.reduce(src)) | int(np.bitwise_or.reduce(dst)) | int(np.bitwise_or.reduce(lengths))
    )
    word, align = _word_and_align(combined | base)
    longest = int(lengths.max())
    total = int(lengths.sum())
    if longest > MIN_PIECE_BYTES and piece_bytes > MIN_PIECE_BYTES:
        # the power of two near total / TARGET_PIECES, within [MIN_PIECE_BYTES, piece_bytes]
        share = total // TARGET_PIECES
        piece_bytes = min(piece_bytes, max(MIN_PIECE_BYTES, 1 << max(share - 1, 1).bit_length()))
    per_piece = max(word * align, piece_bytes // (word * align) * (word * align))
    if longest <= per_piece:  # one piece per span
        table = table_of(lengths.size)
        _whole(src, dst, lengths, base, word, table)
        return PieceTable(table, base, word, align, total, longest)
    # the first piece of every span in its row, in order; the other pieces of the long spans after them
    long = np.flatnonzero(lengths > per_piece)
    few = long.size <= _FEW_LONG_SPANS  # a state run among pages, say: a few calls per long span
    if few:
        spans = [(int(src[i]), int(dst[i]), int(lengths[i])) for i in long.tolist()]
        rests = [(n - 1) // per_piece for _, _, n in spans]  # pieces after the first
        table = table_of(lengths.size + sum(rests))
    else:
        len_l = lengths[long].astype(np.int64)
        rest = (len_l - 1) // per_piece
        table = table_of(lengths.size + int(rest.sum()))
    _whole(src, dst, np.minimum(lengths, lengths.dtype.type(per_piece)), base, word, table[: lengths.size])
    tail = table[lengths.size :]
    if few:
        at, step = 0, per_piece // word
        for (s, d, n), count in zip(spans, rests, strict=True):
            rows = tail[at : at + count]
            at += count
            rows[:, 2] = step
            rows[-1, 2] = (n - count * per_piece) // word  # the last piece: what is left
            offsets = np.arange(step, (count + 1) * step, step, dtype=np.int64)
            np.add(offsets, (s - base) // word, out=rows[:, 0])
            np.add(offsets, (d - base) // word, out=rows[:, 1])
        return PieceTable(table, base, word, align, total, per_piece)
    span_of_piece = np.repeat(np.arange(long.size), rest)
    # bytes from each long span's start: per_piece, 2 * per_piece... (its first piece is in its own row)
    within = (np.arange(span_of_piece.size) - (np.cumsum(rest) - rest)[span_of_piece] + 1) * per_piece
    tail[:, 0] = (src[long].astype(np.int64)[span_of_piece] + within - base) // word
    tail[:, 1] = (dst[long].astype(np.int64)[span_of_piece] + within - base) // word
    tail[:, 2] = np.minimum(len_l[span_of_piece] - within, per_piece) // word
    return PieceTable(table, base, word, align, total, per_piece)


class PieceTable(NamedTuple):
    """What :func:`piece_table` gives: the table, and what the kernel and its launch are chosen by."""

    #: ``[pieces, 3]`` int64: (source word, destination word, words), words relative to ``base``
    table: npt.NDArray[np.int64]
    #: the address the words are counted from (aligned to 256 bytes)
    base: int
    #: the word size in bytes (8, 4, 2 or 1), dividing every address and length
    word: int
    #: the alignment in words every piece's addresses have (2 for 16-byte aligned 8-byte words, else 1)
    align: int
    #: the bytes of every piece
    total: int
    #: the bytes of the longest piece
    longest: int


def grid_of(pieces: int, longest: int, total: int, block_bytes: int) -> tuple[int, int, int] | None:
    """The launch grid of the kernel's grid form for ``pieces`` pieces of ``total`` bytes, the longest
    ``longest`` bytes, copied in blocks of ``block_bytes``: (blocks of the longest piece, pieces, 1), the pieces
    folded into a third dimension past the driver's bound on the second; None when it would launch more than
    :data:`GRID_WASTE` programs per block there is to copy (pieces of very different lengths)."""
    if not pieces:
        return None
    blocks = -(-longest // block_bytes)
    if blocks * pieces > GRID_WASTE * (total // block_bytes + pieces):
        return None
    return _folded(blocks, pieces)


def _folded(x: int, rows: int) -> tuple[int, int, int]:
    """A launch grid of ``x`` programs for each of ``rows`` rows: the rows folded into a third dimension past
    the driver's bound on the second (the kernel's row is ``program_id(1) + program_id(2) * num_programs(1)``;
    rows past the last do nothing)."""
    folds = -(-rows // _GRID_ROWS)
    return x, -(-rows // folds), folds


#: up to this many spans longer than a piece are cut one by one (a few calls each), more all at once
_FEW_LONG_SPANS = 8


def _whole(
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    lengths: npt.NDArray[Any],
    base: int,
    word: int,
    table: npt.NDArray[np.int64],
) -> None:
    """Fill ``table`` with one piece per span (of one dtype, int64 or uint64: the table's bits are the same)."""
    into = table.view(src.dtype)
    np.subtract(src, src.dtype.type(base), out=into[:, 0])
    np.subtract(dst, src.dtype.type(base), out=into[:, 1])
    into[:, 2] = lengths
    if word > 1:
        np.right_shift(into, src.dtype.type(word.bit_length() - 1), out=into)


def _new_table(pieces: int) -> npt.NDArray[np.int64]:
    return np.empty((pieces, 3), dtype=np.int64)


class _PinnedTables:
    """Tables in pinned host memory, which the kernel reads directly (under unified addressing a pinned block's
    host address is also its device address), kept for reuse: a table is a view of a block of the next power of
    two rows, and the block goes back to the free blocks when the last view of the table is gone (so not before
    the caller let go of ``keep``, after the copy ran). Taking a free block costs a few microseconds where
    torch's pinned allocation costs 50-75 us of host time on the H200's host right after a wait.

    Blocks of more than :data:`_POOLED_ROWS` rows are not kept (torch's caching host allocator has them)."""

    __slots__ = ("_free", "_lock", "allocated")

    def __init__(self) -> None:
        self._free: dict[int, list[Any]] = {}
        self._lock = threading.Lock()
        #: blocks allocated (each kept for reuse once free)
        self.allocated = 0

    def take(self, rows: int) -> npt.NDArray[np.int64]:
        import torch

        capacity = 1 << max(rows - 1, 63).bit_length()
        if capacity > _POOLED_ROWS:
            return torch.empty((rows, 3), dtype=torch.int64, pin_memory=True).numpy()
        with self._lock:
            free = self._free.get(capacity)
            block = free.pop() if free else None
        if block is None:
            block = torch.empty((capacity, 3), dtype=torch.int64, pin_memory=True)
            self.allocated += 1
        # a new array over the block for each table: the base of the table and of every view made of it (numpy
        # refers a view to the array that holds the memory), so it dies with the last of them
        owner = block.numpy()
        weakref.finalize(owner, self._give_back, capacity, block)
        table: npt.NDArray[np.int64] = owner[:rows]
        return table

    def _give_back(self, capacity: int, block: Any) -> None:
        with self._lock:
            self._free.setdefault(capacity, []).append(block)

    def __repr__(self) -> str:
        with self._lock:
            free = sum(len(blocks) for blocks in self._free.values())
        return f"<_PinnedTables allocated={self.allocated} free={free}>"


#: the largest table block kept for reuse (1.5 MiB)
_POOLED_ROWS = 1 << 16
#: this process's pinned tables (pinned memory, like the compiled kernels, is per process)
_pinned_tables = _PinnedTables()


def _pinned_table(pieces: int) -> npt.NDArray[np.int64]:
    """An empty table in pinned host memory, which the kernel reads directly; not handed out again while the
    returned array (or a view of it) lives."""
    return _pinned_tables.take(pieces)


class _DriverLaunch:
    """``cuLaunchKernel`` of one compiled kernel whose arguments are three pointers and an int32, through ctypes:
    a few microseconds of host time, where Triton's launcher first builds its launch metadata and binds every
    argument in Python (0.1-0.2 ms on the H200's host right after a wait).

    Made only for a kernel whose parameters are exactly those four plus Triton's scratch pointers (which must be
    unused: no scratch memory, one CTA per program, no cooperative or programmatic launch), as the driver
    reports them (``cuFuncGetParamInfo``); anything else launches through Triton.
    """

    __slots__ = ("_block", "_function", "_launch", "_lock", "_params", "_shared", "_values")

    def __init__(self, launch: Any, function: int, block: int, shared: int, num_params: int) -> None:
        import ctypes

        self._launch, self._function, self._block, self._shared = launch, function, block, shared
        # the argument values, and the array of their addresses cuLaunchKernel reads (scratch pointers: NULL)
        scratch = [ctypes.c_uint64(0) for _ in range(num_params - _ARGUMENTS)]
        self._values = (ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int32(), *scratch)
        self._params = (ctypes.c_void_p * num_params)(*(ctypes.addressof(v) for v in self._values))
        # ctypes lets go of the GIL during the call: one launch at a time reads the shared argument values
        self._lock = threading.Lock()

    @classmethod
    def of(cls, compiled: Any) -> _DriverLaunch | None:
        """The driver launch of a kernel Triton compiled and loaded, or None when it does not qualify."""
        metadata = getattr(compiled, "metadata", None)
        function = getattr(compiled, "function", None)
        if metadata is None or not isinstance(function, int) or not function:
            return None
        if (
            getattr(metadata, "num_ctas", 1) != 1
            or getattr(metadata, "launch_cooperative_grid", False)
            or getattr(metadata, "launch_pdl", False)
            or getattr(metadata, "global_scratch_size", 0)
            or getattr(metadata, "profile_scratch_size", 0)
        ):
            return None
        driver = _cuda_driver()
        if driver is None:
            return None
        sizes = _param_sizes(driver, function)
        if (
            sizes is None
            or sizes[:_ARGUMENTS] != [8, 8, 8, 4]
            or len(sizes) > _ARGUMENTS + 2
            or any(n != 8 for n in sizes[_ARGUMENTS:])
        ):
            return None
        return cls(
            driver.cuLaunchKernel, function, 32 * int(metadata.num_warps), int(metadata.shared), len(sizes)
        )

    def __call__(
        self, grid: tuple[int, int, int], stream: int, base: int, table: int, ids: int, count: int
    ) -> bool:
        """Queue the kernel on ``stream`` over ``grid`` programs; False when the driver refused (nothing was
        queued)."""
        with self._lock:
            values = self._values
            values[0].value, values[1].value, values[2].value, values[3].value = base, table, ids, count
            status = self._launch(
                self._function, *grid, self._block, 1, 1, self._shared, stream, self._params, None
            )
        return int(status) == 0


#: the kernel's own parameters: the base, the table and the ids (pointers), the number of pieces (int32)
_ARGUMENTS = 4


@functools.cache
def _cuda_driver() -> Any:
    """libcuda through ctypes, with the signatures used here; None where it does not load."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
        launch = driver.cuLaunchKernel
        info = driver.cuFuncGetParamInfo
    except (OSError, AttributeError):
        return None
    launch.restype = ctypes.c_int
    launch.argtypes = [
        ctypes.c_void_p,
        *(ctypes.c_uint,) * 7,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_void_p,
    ]
    info.restype = ctypes.c_int
    info.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.POINTER(ctypes.c_size_t),
    ]
    upload = getattr(driver, "cuMemcpyHtoDAsync_v2", None)
    if upload is not None:
        upload.restype = ctypes.c_int
        upload.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return driver


def _upload_async(device_address: int, host_address: int, nbytes: int, stream: int) -> bool:
    """Queue a copy of ``nbytes`` from pinned host memory to device memory on ``stream`` (the driver's call: a
    few microseconds of host time); False when it could not be queued."""
    driver = _cuda_driver()
    upload = None if driver is None else getattr(driver, "cuMemcpyHtoDAsync_v2", None)
    return upload is not None and int(upload(device_address, host_address, nbytes, stream)) == 0


def _param_sizes(driver: Any, function: int) -> list[int] | None:
    """The byte size of each parameter of a loaded kernel, as the driver reports them."""
    import ctypes

    sizes: list[int] = []
    offset, size = ctypes.c_size_t(), ctypes.c_size_t()
    for index in range(16):
        if driver.cuFuncGetParamInfo(function, index, ctypes.byref(offset), ctypes.byref(size)) != 0:
            return sizes if sizes else None
        sizes.append(int(size.value))
    return None


class _Launcher:
    """Launches of the kernels, compiled once per configuration: the first launch of a configuration goes through
    Triton's JIT (which compiles and caches); later ones go straight to the driver (:class:`_DriverLaunch`), or
    where that does not qualify, call the compiled kernel directly, which saves the JIT's argument binding and
    cache lookup (about 0.1 ms of host time per launch on the H200's host).

    The compiled kernel was specialised on the alignment of its pointer arguments; every launch passes a base
    aligned to 256 bytes and a table from torch's device or pinned host allocator (aligned to 512), as the
    first did.
    """

    __slots__ = ("_compiled", "direct_launches", "driver_launches", "jit_launches")

    def __init__(self) -> None:
        self._compiled: dict[tuple[Any, ...], tuple[Any, _DriverLaunch | None] | None] = {}
        self.direct_launches = 0
        self.driver_launches = 0
        self.jit_launches = 0

    @staticmethod
    def key(ordinal: int, constants: dict[str, Any]) -> tuple[Any, ...]:
        """What one compiled kernel is kept under: the device and the constants."""
        return (ordinal, *sorted(constants.items()))

    def launch(
        self,
        device: Any,
        grid: tuple[int, int, int],
        table: int,
        count: int,
        base: int,
        constants: dict[str, Any],
        ids: int = 0,
        key: tuple[Any, ...] | None = None,
        stream: int | None = None,
    ) -> None:
        """Launch ``grid`` programs (x, y, z) over the ``count`` rows of the table at device address ``table``
        (and, for an indexed table, the ids at device address ``ids``). ``key``: :meth:`key` of the device and
        ``constants``, when the caller keeps it; ``stream``: the device's current stream, when the caller has
        it (and made the device current: :func:`_on_device`)."""
        import torch

        ordinal = _ordinal(device)
        key = self.key(ordinal, constants) if key is None else key
        entry = self._compiled.get(key)
        if entry is not None:
            compiled, driver = entry
            current = contextlib.nullcontext() if stream is not None else _on_device(ordinal)
            if stream is None:
                stream = _current_stream(ordinal)
            with current:
                if driver is not None and driver(grid, stream, base, table, ids, count):
                    self.driver_launches += 1
                    return
                try:
                    from triton import knobs

                    kernel_constants = {k: v for k, v in constants.items() if k != "num_warps"}
                    args = (
                        _Pointer(base),
                        _Pointer(table, torch.int64),
                        _Pointer(ids, torch.int64),
                        count,
                        *kernel_constants.values(),
                    )
                    compiled.run(
                        *grid,
                        stream,
                        compiled.function,
                        compiled.packed_metadata,
                        compiled.launch_metadata(grid, stream, *args),
                        knobs.runtime.launch_enter_hook,
                        knobs.runtime.launch_exit_hook,
                        *args,
                    )
                    self.direct_launches += 1
                    return
                except (ImportError, AttributeError, TypeError) as exc:
                    # another Triton: launch through its JIT from now on
                    log.info(
                        "direct launch of the span copy unavailable (%s); using Triton's JIT launch", exc
                    )
                    self._compiled[key] = None
        with _on_device(ordinal):
            launched = _kernel()[grid](
                _Pointer(base), _Pointer(table, torch.int64), _Pointer(ids, torch.int64), count, **constants
            )
        self.jit_launches += 1
        if key not in self._compiled and hasattr(launched, "run") and hasattr(launched, "packed_metadata"):
            self._compiled[key] = (launched, _DriverLaunch.of(launched))


def _current_stream(ordinal: int) -> int:
    """The handle of device ``ordinal``'s current stream (torch's raw query where it has one: no Stream object
    is made)."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return int(raw(ordinal))
    return int(torch.cuda.current_stream(ordinal).cuda_stream)


#: the compiled kernels of this process (Triton's JIT cache is per process too)
_launcher = _Launcher()


def _on_device(index: int) -> Any:
    """``torch.cuda.device(index)``, or nothing to do when it is current already (the common case)."""
    import contextlib

    import torch

    return contextlib.nullcontext() if torch.cuda.current_device() == index else torch.cuda.device(index)


def _ordinal(device: Any) -> int:
    """The ordinal of a torch CUDA device: its index, or the current device's."""
    import torch

    return int(device.index) if device.index is not None else int(torch.cuda.current_device())


def on_device(device: Any) -> Any:
    """:func:`_on_device` of a torch CUDA device (its index, or the current device)."""
    return _on_device(_ordinal(device))


def copy_spans(
    device: Any,
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    lengths: npt.NDArray[Any],
    *,
    keep: list[Any] | None = None,
    piece_bytes: int = PIECE_BYTES,
    block_words: int | None = None,
    num_warps: int | None = None,
    programs_per_sm: int = PROGRAMS_PER_SM,
    streaming: bool = STREAMING,
    rotate: int = ROTATE,
    grid: bool = GRID,
) -> int | None:
    """Queue ``lengths[i]`` bytes from address ``src[i]`` to address ``dst[i]`` for every ``i`` on the current
    stream of ``device`` (a CUDA torch device); returns the number of pieces launched (0: nothing to copy), or
    None when Triton could not build or launch the kernel (logged; nothing was queued: copy another way).

    ``keep``: a list the caller holds until the stream has passed this launch (it synchronises before it lets
    go, cancelled or not). The table is then copied into pinned host memory, which is appended to ``keep``: the
    loop form reads it there (no upload), the grid form's upload reads it from there. Without ``keep`` the
    table is uploaded on the stream from a block of torch's caching host allocator (nothing to hold; for copies
    that are not waited for).

    ``grid``: pieces alike in length (:func:`grid_of`) are copied one program per block of
    :data:`GRID_BLOCK_BYTES` (the table then goes to device memory, held in ``keep`` with its pinned source);
    False always launches one program per piece.

    ``block_words`` / ``num_warps``: the kernel's shape; by default, for the grid :data:`GRID_BLOCK_BYTES` x
    :data:`GRID_NUM_WARPS`, else :data:`BLOCK_WORDS` x :data:`NUM_WARPS`, or :data:`LONG_BLOCK_WORDS` x
    :data:`LONG_NUM_WARPS` when the pieces average :data:`LONG_PIECE_BYTES` or more.

    The caller has checked that every span lies in memory of ``device`` this process may touch, and that no
    destination overlaps another span. Returns without synchronising: the copy is done once the stream has
    passed it (a cancelled caller must still wait for that before it frees or reuses either side).
    """
    # built in ordinary memory, then copied into pinned memory in one pass: on the H200's host the table's
    # column by column writes straight into pinned memory cost 30-70 us more for 1024 pieces
    pieces = piece_table(src, dst, lengths, piece_bytes)
    table, count = pieces.table, len(pieces.table)
    if not count:
        return 0
    if keep is not None:
        try:
            pinned = _pinned_table(count)
        except RuntimeError as exc:  # no pinned memory to be had: the device table
            log.warning("no pinned memory for the span copy's table (%s); uploading it", exc)
            keep = None
        else:
            pinned[...] = table
            table = pinned
    block_bytes = GRID_BLOCK_BYTES if block_words is None else block_words * pieces.word
    launch = (
        grid_of(count, pieces.longest, pieces.total, block_bytes) if grid and programs_per_sm <= 0 else None
    )
    if launch is not None:
        block_words = block_bytes // pieces.word
        num_warps = GRID_NUM_WARPS if num_warps is None else num_warps
    else:
        # long pieces (1 GiB in 1-64 MiB spans): 546-549 us against 560-566 us with the default shape, which
        # moves a disaggregated writer's page mix 5-15% faster (Nsight Compute on the H200)
        long_pieces = pieces.total >= LONG_PIECE_BYTES * count
        if block_words is None:
            block_words = LONG_BLOCK_WORDS if long_pieces else BLOCK_WORDS
        if num_warps is None:
            num_warps = LONG_NUM_WARPS if long_pieces else NUM_WARPS
        programs = count if programs_per_sm <= 0 else min(count, programs_per_sm * _multiprocessors(device))
    constants = {
        "WORD": pieces.word,
        "ALIGN": pieces.align,
        "BLOCK": block_words,
        "STREAM": streaming,
        "ROTATE": rotate,
        "INDEXED": False,
        "GRID": launch is not None,
        "FRAGMENTS": False,
        "ROUNDS": 1,
        "num_warps": num_warps,
    }
    held: list[Any] = []
    try:
        ordinal = _ordinal(device)
        with _on_device(ordinal):
            stream = _current_stream(ordinal)
            if keep is None:
                held.append(_upload(table, device))
                address = held[-1].data_ptr()
            elif launch is not None:
                # the grid's programs each read their piece's row: from device memory, not over PCIe
                address = _upload_held(table, ordinal, stream, held)
            else:  # pinned: its host address is its device address
                held.append(table)
                address = table.ctypes.data
            programs_grid = launch or (programs, 1, 1)
            _launcher.launch(device, programs_grid, address, count, pieces.base, constants, stream=stream)
    except Exception as exc:  # a compiler, driver or pinned-memory problem only costs the fast path
        log.warning("the batched span copy failed (%s); copying another way", exc)
        _kernel.cache_clear()
        return None
    if keep is not None:
        keep.extend(held)
    return count


#: the most rounds a program of :func:`copy_fragments` makes over its row (a power of two: the kernel is
#: compiled for 1, 2 and 4)
FRAGMENT_ROUNDS = 4


class FragmentTable(NamedTuple):
    """What :func:`copy_fragments` launches: the table (the sources' (address, bytes) rows, then the
    destinations', as 64-bit words), its rows, the grid and the rounds the kernel is compiled for."""

    words: npt.NDArray[np.int64]
    rows: int
    grid: tuple[int, int, int]
    rounds: int


def fragment_table(
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    *,
    longest: int,
    total: int,
    allocate: Callable[[int], npt.NDArray[np.int64]],
) -> FragmentTable | None:
    """The table and launch of :func:`copy_fragments`'s kernel over the paired rows ``src``/``dst`` (``[n, 2]``
    (address, bytes), int64 or uint64; ``longest``/``total`` their longest row's and all rows' bytes), in
    words from ``allocate(n)``; None when a row is not in 16-byte words (an address or length), or when the
    rows are too unlike in length for the kernel.

    Every row has as many programs as the mean row has blocks (:data:`GRID_BLOCK_BYTES`, rounded up), each
    copying its row's blocks that far apart: a longer row (a run of merged neighbours) in more rounds, up to
    :data:`FRAGMENT_ROUNDS` (a few long rows among short ones: the piece table cuts those). The grid's rows
    are folded past the driver's bound.

    Cutting the few merged rows of a write of pages instead (one round for every program) made no difference
    on the H200 (``benchmarks/results/fragment_rounds_h200.json``): a second round that copies nothing costs
    no time there."""
    count = len(src)
    if not count:
        return None
    if (int(np.bitwise_or.reduce(src.reshape(-1))) | int(np.bitwise_or.reduce(dst.reshape(-1)))) % 16:
        return None  # the alignment read from ordinary memory: pinned reads cost twice as much
    per_row = max(1, -(-total // (count * GRID_BLOCK_BYTES)))
    rounds = -(-longest // (per_row * GRID_BLOCK_BYTES))
    if rounds > FRAGMENT_ROUNDS:
        return None
    words = allocate(4 * count)
    bits = words.view(np.uint64) if src.dtype == np.uint64 else words
    bits[: 2 * count] = src.reshape(-1)
    bits[2 * count :] = dst.reshape(-1)
    return FragmentTable(words, count, _folded(per_row, count), 1 << max(rounds - 1, 0).bit_length())


def _pinned_words(words: int) -> npt.NDArray[np.int64]:
    """An empty int64 vector of ``words`` in pinned host memory (a view of a pinned block of 3-word rows)."""
    return _pinned_table(-(-words // 3)).reshape(-1)[:words]


def copy_fragments(
    device: Any,
    src: npt.NDArray[Any],
    dst: npt.NDArray[Any],
    *,
    keep: list[Any],
    longest: int | None = None,
    total: int | None = None,
) -> int | None:
    """Queue the copy of every fragment row ``src[i]`` to ``dst[i]`` (``[n, 2]`` arrays of (address, length),
    the lengths equal row by row, as a transport's paired fragments are) on the current stream of ``device``;
    returns the number of rows launched, or None when Triton could not build or launch the kernel (logged;
    no byte was copied, only perhaps the table's upload queued, its memory in ``keep``: copy another way).
    ``longest``/``total``: the longest row's bytes and all rows' bytes, when the caller has them.

    Rows of lengths near each other go to the kernel as they are (:func:`fragment_table`): both arrays, one
    after the other, in pinned host memory, uploaded on the stream; each program copies blocks of its row in
    16-byte words (rows with an address or length that is not a multiple of 16 go to :func:`copy_spans`, which
    copies in the widest word they allow). The host does two copies and one pass over the rows (their
    alignment): on the H200's host each pass costs 10-50 us right after a write waited for its peer, and the
    piece table took 80-200 us there. Rows of lengths too unlike go to :func:`copy_spans` too.

    The caller's contract is :func:`copy_spans`'s (every span checked, no destination overlapping another);
    ``keep`` gets the pinned rows and the device buffer they are uploaded into, to hold until the stream has
    passed this launch (also when the caller is cancelled: nothing here waits)."""
    count = len(src)
    if not count:
        return 0
    if longest is None:
        longest = int(src[:, 1].max())
    if total is None:
        total = int(src[:, 1].sum())
    held: list[Any] = []
    try:
        table = (
            fragment_table(src, dst, longest=longest, total=total, allocate=_pinned_words) if GRID else None
        )
        if table is not None:
            ordinal = _ordinal(device)
            constants, key = _fragment_launch(ordinal, table.rounds)
            with _on_device(ordinal):
                stream = _current_stream(ordinal)
                address = _upload_held(table.words, ordinal, stream, held)
                base = int(src[0, 0]) & ~255
                _launcher.launch(
                    device, table.grid, address, table.rows, base, constants, key=key, stream=stream
                )
    except Exception as exc:  # a compiler, driver or pinned-memory problem only costs the fast path
        log.warning("the batched fragment copy failed (%s); copying another way", exc)
        _kernel.cache_clear()
        keep.extend(held)  # an upload queued before the failure still reads its table
        return None
    if table is None:
        return copy_spans(device, src[:, 0], dst[:, 0], src[:, 1], keep=keep)
    keep.extend(held)
    return count


@functools.cache
def _fragment_launch(ordinal: int, rounds: int) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The constants of :func:`copy_fragments`'s launch of ``rounds`` rounds and their launcher key (made once
    per device and rounds)."""
    constants = {
        "WORD": 8,
        "ALIGN": 2,
        "BLOCK": GRID_BLOCK_BYTES // 8,
        "STREAM": False,
        "ROTATE": 0,
        "INDEXED": False,
        "GRID": True,
        "FRAGMENTS": True,
        "ROUNDS": rounds,
        "num_warps": GRID_NUM_WARPS,
    }
    return constants, _Launcher.key(ordinal, constants)


def _upload_held(table: npt.NDArray[np.int64], ordinal: int, stream: int, held: list[Any]) -> int:
    """The device address of a copy of ``table`` (pinned host memory) queued on ``stream``, the current stream of
    device ``ordinal`` (the current device: :func:`_on_device`), in that stream's table buffer
    (:class:`_DeviceTables`); ``held`` gets the table and the buffer, to hold until the stream has passed what
    reads them."""
    import torch

    held.append(table)
    buffer = _device_tables.take(ordinal, stream, table.size)
    held.append(buffer)
    if not _upload_async(buffer.data_ptr(), table.ctypes.data, table.nbytes, stream):
        buffer[: table.size].copy_(torch.from_numpy(table.reshape(-1)), non_blocking=True)
    return int(buffer.data_ptr())


class _DeviceTables:
    """One device buffer per (device, stream, thread) that the grid form's tables are uploaded into, kept: an
    allocation per write costs 15-35 us of host time on the H200's host.

    Safe without waiting because every use of a buffer is on its one stream, by its one thread, which queues
    the upload and the kernel that reads it in one call: the upload of the next table is queued after the
    kernel that read the last, so it runs only once that kernel is done (two threads sharing a buffer could
    queue both uploads before either kernel). A buffer outgrown goes back to torch's caching allocator, which
    hands it out again only in that stream's order."""

    __slots__ = ("_buffers", "_lock", "allocated")

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int, int], Any] = {}
        self._lock = threading.Lock()
        #: buffers allocated (a stream's first, and each time one grows)
        self.allocated = 0

    def take(self, ordinal: int, stream: int, words: int) -> Any:
        """The calling thread's buffer of ``stream`` on device ``ordinal``, at least ``words`` int64 long."""
        import torch

        key = (ordinal, stream, threading.get_ident())
        with self._lock:
            buffer = self._buffers.get(key)
            if buffer is None or buffer.numel() < words:
                capacity = 1 << max(words - 1, 1023).bit_length()
                buffer = torch.empty(capacity, dtype=torch.int64, device=torch.device("cuda", ordinal))
                self._buffers[key] = buffer
                self.allocated += 1
            return buffer

    def __repr__(self) -> str:
        with self._lock:
            return f"<_DeviceTables {len(self._buffers)} buffers, {self.allocated} allocated>"


#: this process's device table buffers
_device_tables = _DeviceTables()


class IndexedTable:
    """The device-resident table of an indexed copy (:func:`indexed_table`): rows whose addresses come from ids,
    cut into pieces, built and uploaded once and launched for any number of writes by :func:`copy_indexed`.

    Per piece ``(source slot, source word at id 0, source stride in words, destination slot, destination word at
    id 0, destination stride in words, words)``, words relative to :attr:`base`; slots are positions in the one
    id vector a launch reads."""

    __slots__ = (
        "align",
        "base",
        "constants",
        "device",
        "grid",
        "grid_constants",
        "grid_key",
        "ids",
        "key",
        "nbytes",
        "pieces",
        "table",
        "word",
    )

    def __init__(
        self,
        table: Any,
        base: int,
        word: int,
        align: int,
        ids: int,
        nbytes: int,
        pieces: int,
        device: Any,
        longest: int = 0,
    ) -> None:
        self.table, self.base, self.word, self.align = table, base, word, align
        #: the length of the id vector a launch reads
        self.ids = ids
        self.nbytes, self.pieces, self.device = nbytes, pieces, device
        long_pieces = nbytes >= LONG_PIECE_BYTES * max(pieces, 1)
        #: the kernel's constants, and what its compiled form is kept under (worked out once per table)
        self.constants = {
            "WORD": word,
            "ALIGN": align,
            "BLOCK": LONG_BLOCK_WORDS if long_pieces else BLOCK_WORDS,
            "STREAM": STREAMING,
            "ROTATE": ROTATE,
            "INDEXED": True,
            "GRID": False,
            "FRAGMENTS": False,
            "ROUNDS": 1,
            "num_warps": LONG_NUM_WARPS if long_pieces else NUM_WARPS,
        }
        self.key = _Launcher.key(device.index, self.constants) if device.type == "cuda" else ()
        #: the launch of the grid form (pieces alike in length, :func:`grid_of`; its programs read the ids
        #: from device memory), or None; its constants and key
        self.grid = grid_of(pieces, longest, nbytes, GRID_BLOCK_BYTES) if GRID else None
        self.grid_constants = {
            **self.constants,
            "BLOCK": GRID_BLOCK_BYTES // word,
            "GRID": True,
            "num_warps": GRID_NUM_WARPS,
        }
        self.grid_key = _Launcher.key(device.index, self.grid_constants) if device.type == "cuda" else ()

    def __repr__(self) -> str:
        grid = f", grid {self.grid}" if self.grid else ""
        return (
            f"<IndexedTable {self.pieces} pieces, {self.nbytes} bytes, {self.ids} ids, word {self.word}{grid} "
            f"on {self.device}>"
        )


def indexed_table(
    device: Any,
    src_slot: npt.NDArray[np.int64],
    src_address: npt.NDArray[np.int64],
    src_stride: npt.NDArray[np.int64],
    dst_slot: npt.NDArray[np.int64],
    dst_address: npt.NDArray[np.int64],
    dst_stride: npt.NDArray[np.int64],
    length: npt.NDArray[np.int64],
    ids: int,
    piece_bytes: int = PIECE_BYTES,
) -> IndexedTable:
    """The :class:`IndexedTable` of rows ``i``: ``length[i]`` bytes from ``src_address[i] + id[src_slot[i]] *
    src_stride[i]`` to ``dst_address[i] + id[dst_slot[i]] * dst_stride[i]`` (addresses of this process on
    ``device``, ids from one vector of ``ids`` values). Long rows are cut into pieces as :func:`piece_table` cuts
    long spans. Nothing is checked here: the caller checked every address any allowed id can reach."""
    import torch

    if device.type == "cuda" and device.index is None:  # the ordinal the launcher keeps its kernels under
        device = torch.device("cuda", torch.cuda.current_device())
    length = np.asarray(length, dtype=np.int64)
    longest = int(length.max(initial=0))
    total = int(length.sum())
    if longest > MIN_PIECE_BYTES and piece_bytes > MIN_PIECE_BYTES:
        share = total // TARGET_PIECES
        piece_bytes = min(piece_bytes, max(MIN_PIECE_BYTES, 1 << max(share - 1, 1).bit_length()))
    # the lowest address (min(initial=0) would always give 0: words counted from address 0 instead)
    base = (min(int(src_address.min()), int(dst_address.min())) if len(length) else 0) & ~255
    combined = base | piece_bytes
    for column in (src_address, dst_address, src_stride, dst_stride, length):
        combined |= int(np.bitwise_or.reduce(column)) if len(column) else 0
    word, align = _word_and_align(combined)
    per_piece = max(word * align, piece_bytes // (word * align) * (word * align))
    count = -(-length // per_piece)
    if (
        GRID
        and GRID_RECUT
        and grid_of(int(count.sum()), min(longest, per_piece), total, GRID_BLOCK_BYTES) is None
    ):
        # rows of mixed lengths: cut shorter, where that makes the pieces alike enough for the grid (the table
        # is built once per template, so its size costs nothing per launch)
        cut = per_piece // 2
        while cut >= max(GRID_BLOCK_BYTES, word * align) and cut % (word * align) == 0:
            shorter = -(-length // cut)
            pieces = int(shorter.sum())
            if pieces > _MAX_RECUT_PIECES:
                break
            if grid_of(pieces, min(longest, cut), total, GRID_BLOCK_BYTES) is not None:
                per_piece, count = cut, shorter
                break
            cut //= 2
    row = np.repeat(np.arange(len(length), dtype=np.int64), count)
    within = (np.arange(len(row), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)) * per_piece
    host = np.empty((len(row), 7), dtype=np.int64)
    host[:, 0] = src_slot[row]
    host[:, 1] = (src_address[row] + within - base) // word
    host[:, 2] = src_stride[row] // word
    host[:, 3] = dst_slot[row]
    host[:, 4] = (dst_address[row] + within - base) // word
    host[:, 5] = dst_stride[row] // word
    host[:, 6] = np.minimum(length[row] - within, per_piece) // word
    table = torch.from_numpy(host).to(device)
    longest_piece = min(longest, per_piece)
    return IndexedTable(table, base, word, align, ids, total, len(row), device, longest_piece)


def pinned_ids(count: int) -> npt.NDArray[np.int64]:
    """An int64 vector of ``count`` values in pinned host memory, which :func:`copy_indexed` reads directly."""
    import torch

    vector: npt.NDArray[np.int64] = torch.empty(max(count, 1), dtype=torch.int64, pin_memory=True).numpy()
    return vector[:count]


def copy_indexed(
    table: IndexedTable,
    ids: npt.NDArray[np.int64],
    *,
    keep: list[Any],
    pinned: bool = False,
    device_ids: Any = None,
) -> bool:
    """Queue ``table``'s copy for the id vector ``ids`` (``table.ids`` int64 values, checked by the caller) on
    the current stream of its device; False when Triton could not build or launch the kernel (logged; nothing
    was queued: copy another way).

    The ids come from pinned host memory: ``ids`` itself when ``pinned`` (a :func:`pinned_ids` vector), else a
    pinned copy appended to ``keep``. With ``device_ids`` (an int64 tensor on the table's device, at least as
    long) they are copied there first, on the stream, and the kernel reads them from device memory: each of
    its programs reads two ids, which from host memory is a round trip over PCIe per program. Hold ``ids``,
    ``device_ids``, ``keep`` and ``table`` until the stream has passed this launch (the caller synchronises
    before it lets go, cancelled or not)."""
    if not table.pieces:
        return True
    try:
        if not pinned:
            copy = _pinned_words(len(ids))
            copy[...] = ids
            keep.append(copy)
            ids = copy
        address = ids.ctypes.data
        on_device = device_ids is not None and _upload_async(
            device_ids.data_ptr(), address, ids.nbytes, _current_stream(table.key[0])
        )
        if on_device:
            address = device_ids.data_ptr()
        # the grid form only with the ids in device memory (each of its many programs reads two)
        grid = table.grid if on_device else None
        _launcher.launch(
            table.device,
            grid or (table.pieces, 1, 1),
            table.table.data_ptr(),
            table.pieces,
            table.base,
            table.grid_constants if grid else table.constants,
            ids=address,
            key=table.grid_key if grid else table.key,
        )
    except Exception as exc:  # a compiler, driver or pinned-memory problem only costs the fast path
        log.warning("the indexed span copy failed (%s); copying another way", exc)
        _kernel.cache_clear()
        return False
    return True


def _upload(table: npt.NDArray[np.int64], device: Any) -> Any:
    """``table`` on ``device``, copied on its current stream from pinned host memory.

    The driver may stage a copy from pageable memory synchronously with the work queued on the stream before it
    (a write that first queued ``copy_`` of its long rows would wait for them on the host). The pinned block
    comes from torch's caching host allocator, which does not hand it out again before the copy from it ran."""
    import torch

    host = torch.empty(table.shape, dtype=torch.int64, pin_memory=True)
    host.numpy()[...] = table
    return host.to(device, non_blocking=True)


def _multiprocessors(device: Any) -> int:
    return _multiprocessors_of(_ordinal(device))


@functools.cache
def _multiprocessors_of(index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(index).multi_processor_count)
