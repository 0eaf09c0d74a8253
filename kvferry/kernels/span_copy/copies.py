"""The span copy's launches of plain spans (:func:`copy_spans`) and of a transport's paired fragment rows
(:func:`copy_fragments`): the table built, placed where the kernel reads it, and the kernel launched on the
current stream.

Every function returns without synchronising and falls back (returns None, logged) when Triton cannot build or
launch the kernel: the caller then copies another way.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy.typing as npt

from kvferry.kernels.span_copy.buffers import pinned_table, pinned_words, upload, upload_held
from kvferry.kernels.span_copy.cuda import current_stream, multiprocessors, on_ordinal, ordinal
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
    copy_kernel,
    kernel_constants,
)
from kvferry.kernels.span_copy.launch import Launcher, launcher
from kvferry.kernels.span_copy.tables import (
    GRID,
    GRID_BLOCK_BYTES,
    PIECE_BYTES,
    fragment_table,
    grid_of,
    piece_table,
)

log = logging.getLogger("kvferry.kernels.span_copy")

__all__ = ["copy_fragments", "copy_spans", "fragment_launch"]


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

    ``grid``: pieces alike in length (:func:`~kvferry.kernels.span_copy.grid_of`) are copied one program per
    block of :data:`~kvferry.kernels.span_copy.GRID_BLOCK_BYTES` (the table then goes to device memory, held in
    ``keep`` with its pinned source); False always launches one program per piece.

    ``block_words`` / ``num_warps``: the kernel's shape; by default, for the grid ``GRID_BLOCK_BYTES`` x
    ``GRID_NUM_WARPS``, else ``BLOCK_WORDS`` x ``NUM_WARPS``, or ``LONG_BLOCK_WORDS`` x ``LONG_NUM_WARPS`` when
    the pieces average ``LONG_PIECE_BYTES`` or more.

    The caller has checked that every span lies in memory of ``device`` this process may touch, and that no
    destination overlaps another span. Returns without synchronising: the copy is done once the stream has
    passed it (a cancelled caller must still wait for that before it frees or reuses either side).
    """
    # built in ordinary memory, then copied into pinned memory in one pass: numpy's column by column writes
    # cost more straight into pinned memory
    pieces = piece_table(src, dst, lengths, piece_bytes)
    table, count = pieces.table, len(pieces.table)
    if not count:
        return 0
    if keep is not None:
        try:
            pinned = pinned_table(count)
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
        long_pieces = pieces.total >= LONG_PIECE_BYTES * count
        if block_words is None:
            block_words = LONG_BLOCK_WORDS if long_pieces else BLOCK_WORDS
        if num_warps is None:
            num_warps = LONG_NUM_WARPS if long_pieces else NUM_WARPS
        programs = count if programs_per_sm <= 0 else min(count, programs_per_sm * multiprocessors(device))
    constants = kernel_constants(
        word=pieces.word,
        align=pieces.align,
        block=block_words,
        num_warps=num_warps,
        stream=streaming,
        rotate=rotate,
        grid=launch is not None,
    )
    held: list[Any] = []
    try:
        index = ordinal(device)
        with on_ordinal(index):
            stream = current_stream(index)
            if keep is None:
                held.append(upload(table, device))
                address = held[-1].data_ptr()
            elif launch is not None:
                # the grid's programs each read their piece's row: from device memory, not over PCIe
                address = upload_held(table, index, stream, held)
            else:  # pinned: its host address is its device address
                held.append(table)
                address = table.ctypes.data
            programs_grid = launch or (programs, 1, 1)
            launcher.launch(device, programs_grid, address, count, pieces.base, constants, stream=stream)
    except Exception as exc:  # a compiler, driver or pinned-memory problem only costs the fast path
        log.warning("the batched span copy failed (%s); copying another way", exc)
        copy_kernel.cache_clear()
        return None
    if keep is not None:
        keep.extend(held)
    return count


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

    Rows of lengths near each other go to the kernel as they are
    (:func:`~kvferry.kernels.span_copy.fragment_table`): both arrays, one after the other, in pinned host
    memory, uploaded on the stream; each program copies blocks of its row in 16-byte words. The host does two
    copies and one pass over the rows (their alignment), far less than a piece table costs. Rows with an
    address or length that is not a multiple of 16, or of lengths too unlike, go to :func:`copy_spans`, which
    copies in the widest word they allow.

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
            fragment_table(src, dst, longest=longest, total=total, allocate=pinned_words) if GRID else None
        )
        if table is not None:
            index = ordinal(device)
            constants, key = fragment_launch(index, table.rounds)
            with on_ordinal(index):
                stream = current_stream(index)
                address = upload_held(table.words, index, stream, held)
                base = int(src[0, 0]) & ~255
                launcher.launch(
                    device, table.grid, address, table.rows, base, constants, key=key, stream=stream
                )
    except Exception as exc:  # a compiler, driver or pinned-memory problem only costs the fast path
        log.warning("the batched fragment copy failed (%s); copying another way", exc)
        copy_kernel.cache_clear()
        keep.extend(held)  # an upload queued before the failure still reads its table
        return None
    if table is None:
        return copy_spans(device, src[:, 0], dst[:, 0], src[:, 1], keep=keep)
    keep.extend(held)
    return count


@functools.cache
def fragment_launch(index: int, rounds: int) -> tuple[dict[str, Any], tuple[Any, ...]]:
    """The constants of :func:`copy_fragments`'s launch of ``rounds`` rounds on device ``index`` and their
    launcher key (made once per device and rounds)."""
    constants = kernel_constants(
        word=8,
        align=2,
        block=GRID_BLOCK_BYTES // 8,
        num_warps=GRID_NUM_WARPS,
        grid=True,
        fragments=True,
        rounds=rounds,
    )
    return constants, Launcher.key(index, constants)
