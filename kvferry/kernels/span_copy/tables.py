"""The span copy's tables, built on the host with numpy: spans cut into pieces (:func:`piece_table`), a
transport's paired fragment rows as they are (:func:`fragment_table`), rows whose addresses come from ids
(:func:`indexed_pieces`), and the launch grid of the kernel's grid form (:func:`grid_of`).

Nothing here touches a device or imports torch; nothing validates (the callers checked every span).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

__all__ = [
    "FEW_LONG_SPANS",
    "FRAGMENT_ROUNDS",
    "GRID",
    "GRID_BLOCK_BYTES",
    "GRID_RECUT",
    "GRID_ROWS",
    "GRID_WASTE",
    "MAX_RECUT_PIECES",
    "MIN_PIECE_BYTES",
    "PIECE_BYTES",
    "TARGET_PIECES",
    "FragmentTable",
    "IndexedPieces",
    "PieceTable",
    "folded",
    "fragment_table",
    "grid_of",
    "indexed_pieces",
    "piece_table",
    "word_and_align",
]

#: Largest number of bytes one program copies; spans are cut into pieces of at most this size ...
PIECE_BYTES = 4 << 20
#: ... or less, down to this, so that a copy has about :data:`TARGET_PIECES` pieces: a few long spans among many
#: short ones (a state run among pages) would otherwise keep a few programs busy long after the rest finished
MIN_PIECE_BYTES = 256 << 10
TARGET_PIECES = 1024
#: Copies whose pieces are alike in length launch one program per block of each piece (a grid of blocks by
#: pieces, the table in device memory) instead of one program per piece looping over its blocks: the shape of a
#: plain copy's programs, which programs that loop do not reach.
GRID = True
#: Bytes one program of the grid copies.
GRID_BLOCK_BYTES = 4096
#: The grid is used when it launches at most this many programs per block there is to copy (a piece shorter
#: than the longest launches programs that do nothing).
GRID_WASTE = 1.25
#: An indexed table whose rows are too unlike for the grid is cut into shorter pieces (down to a block) where
#: that makes them alike enough (:func:`indexed_pieces`; built once per template).
GRID_RECUT = True
#: The driver's bound on a grid's second and third dimensions.
GRID_ROWS = 65535
#: The most pieces a shorter cut may make (a table of 3.5 MiB).
MAX_RECUT_PIECES = 1 << 16
#: Up to this many spans longer than a piece are cut one by one (a few calls each), more all at once.
FEW_LONG_SPANS = 8
#: The most rounds a program of the fragment rows' form makes over its row (a power of two: the kernel is
#: compiled for 1, 2 and 4).
FRAGMENT_ROUNDS = 4


def word_and_align(combined: int) -> tuple[int, int]:
    """The widest word (8, 4, 2 or 1 bytes) dividing ``combined`` (every address and length OR-ed together),
    and the alignment in words the kernel may assume (2 for 16-byte aligned 8-byte words, else 1)."""
    for word in (8, 4, 2):
        if combined % word == 0:
            return word, (2 if word == 8 and combined % 16 == 0 else 1)
    return 1, 1


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


def _share(longest: int, total: int, piece_bytes: int) -> int:
    """``piece_bytes``, or the power of two near ``total / TARGET_PIECES`` within [MIN_PIECE_BYTES,
    piece_bytes] when some span is longer than :data:`MIN_PIECE_BYTES`."""
    if longest > MIN_PIECE_BYTES and piece_bytes > MIN_PIECE_BYTES:
        share = total // TARGET_PIECES
        piece_bytes = min(piece_bytes, max(MIN_PIECE_BYTES, 1 << max(share - 1, 1).bit_length()))
    return piece_bytes


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
    word, align = word_and_align(combined | base)
    longest = int(lengths.max())
    total = int(lengths.sum())
    piece_bytes = _share(longest, total, piece_bytes)
    per_piece = max(word * align, piece_bytes // (word * align) * (word * align))
    if longest <= per_piece:  # one piece per span
        table = table_of(lengths.size)
        _whole(src, dst, lengths, base, word, table)
        return PieceTable(table, base, word, align, total, longest)
    # the first piece of every span in its row, in order; the other pieces of the long spans after them
    long = np.flatnonzero(lengths > per_piece)
    few = long.size <= FEW_LONG_SPANS  # a state run among pages, say: a few calls per long span
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
    return folded(blocks, pieces)


def folded(x: int, rows: int) -> tuple[int, int, int]:
    """A launch grid of ``x`` programs for each of ``rows`` rows: the rows folded into a third dimension past
    the driver's bound on the second (the kernel's row is ``program_id(1) + program_id(2) * num_programs(1)``;
    rows past the last do nothing)."""
    folds = -(-rows // GRID_ROWS)
    return x, -(-rows // folds), folds


class FragmentTable(NamedTuple):
    """What the fragment rows' form launches: the table (the sources' (address, bytes) rows, then the
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
    """The table and launch of the fragment rows' kernel over the paired rows ``src``/``dst`` (``[n, 2]``
    (address, bytes), int64 or uint64; ``longest``/``total`` their longest row's and all rows' bytes), in
    words from ``allocate(n)``; None when a row is not in 16-byte words (an address or length), or when the
    rows are too unlike in length for the kernel.

    Every row has as many programs as the mean row has blocks (:data:`GRID_BLOCK_BYTES`, rounded up), each
    copying its row's blocks that far apart: a longer row (a run of merged neighbours) in more rounds, up to
    :data:`FRAGMENT_ROUNDS` (a few long rows among short ones: the piece table cuts those). The grid's rows
    are folded past the driver's bound. The few merged rows of a write of pages are not cut to spare their
    programs a round: a round that copies nothing costs no measurable time."""
    count = len(src)
    if not count:
        return None
    if (int(np.bitwise_or.reduce(src.reshape(-1))) | int(np.bitwise_or.reduce(dst.reshape(-1)))) % 16:
        return None  # the alignment read from ordinary memory, which numpy reads faster than pinned memory
    per_row = max(1, -(-total // (count * GRID_BLOCK_BYTES)))
    rounds = -(-longest // (per_row * GRID_BLOCK_BYTES))
    if rounds > FRAGMENT_ROUNDS:
        return None
    words = allocate(4 * count)
    bits = words.view(np.uint64) if src.dtype == np.uint64 else words
    bits[: 2 * count] = src.reshape(-1)
    bits[2 * count :] = dst.reshape(-1)
    return FragmentTable(words, count, folded(per_row, count), 1 << max(rounds - 1, 0).bit_length())


class IndexedPieces(NamedTuple):
    """What :func:`indexed_pieces` gives: the host table of an indexed copy and what its launch is chosen by."""

    #: ``[pieces, 7]`` int64: (source slot, source word at id 0, source stride in words, destination slot,
    #: destination word at id 0, destination stride in words, words), words relative to ``base``
    table: npt.NDArray[np.int64]
    #: the address the words are counted from (aligned to 256 bytes)
    base: int
    #: the word size in bytes, dividing every address, stride and length
    word: int
    #: the alignment in words every piece's addresses have
    align: int
    #: the bytes of every row
    total: int
    #: the bytes of the longest piece
    longest: int


def indexed_pieces(
    src_slot: npt.NDArray[np.int64],
    src_address: npt.NDArray[np.int64],
    src_stride: npt.NDArray[np.int64],
    dst_slot: npt.NDArray[np.int64],
    dst_address: npt.NDArray[np.int64],
    dst_stride: npt.NDArray[np.int64],
    length: npt.NDArray[np.int64],
    piece_bytes: int = PIECE_BYTES,
) -> IndexedPieces:
    """The pieces of rows ``i``: ``length[i]`` bytes from ``src_address[i] + id[src_slot[i]] * src_stride[i]``
    to ``dst_address[i] + id[dst_slot[i]] * dst_stride[i]``. Long rows are cut into pieces as :func:`piece_table`
    cuts long spans; rows too unlike for the grid are cut shorter where that makes them alike enough
    (:data:`GRID_RECUT`: the table is built once per template, so its size costs nothing per launch)."""
    length = np.asarray(length, dtype=np.int64)
    longest = int(length.max(initial=0))
    total = int(length.sum())
    piece_bytes = _share(longest, total, piece_bytes)
    # the lowest address (min(initial=0) would always give 0: words counted from address 0 instead)
    base = (min(int(src_address.min()), int(dst_address.min())) if len(length) else 0) & ~255
    combined = base | piece_bytes
    for column in (src_address, dst_address, src_stride, dst_stride, length):
        combined |= int(np.bitwise_or.reduce(column)) if len(column) else 0
    word, align = word_and_align(combined)
    per_piece = max(word * align, piece_bytes // (word * align) * (word * align))
    count = -(-length // per_piece)
    if (
        GRID
        and GRID_RECUT
        and grid_of(int(count.sum()), min(longest, per_piece), total, GRID_BLOCK_BYTES) is None
    ):
        cut = per_piece // 2
        while cut >= max(GRID_BLOCK_BYTES, word * align) and cut % (word * align) == 0:
            shorter = -(-length // cut)
            pieces = int(shorter.sum())
            if pieces > MAX_RECUT_PIECES:
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
    return IndexedPieces(host, base, word, align, total, min(longest, per_piece))
