"""Indexed copies: the span copy's kernel reading a table of rows whose addresses come from ids (a row's address
at id 0 plus the id times its stride, on each side).

The table is built and uploaded once per template (:func:`indexed_table`; an indexed write's,
:mod:`kvferry.transports.indexed`) and every launch passes only the ids (:func:`copy_indexed`), so a
disaggregated writer's host work per request is a check of its ids and one launch.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import numpy.typing as npt

from kvferry.kernels.span_copy.buffers import pinned_words
from kvferry.kernels.span_copy.cuda import current_stream, upload_async
from kvferry.kernels.span_copy.kernel import (
    BLOCK_WORDS,
    GRID_NUM_WARPS,
    LONG_BLOCK_WORDS,
    LONG_NUM_WARPS,
    LONG_PIECE_BYTES,
    NUM_WARPS,
    ROTATE,
    STREAMING,
    copy_kernel,
    kernel_constants,
)
from kvferry.kernels.span_copy.launch import Launcher, launcher
from kvferry.kernels.span_copy.tables import GRID, GRID_BLOCK_BYTES, PIECE_BYTES, grid_of, indexed_pieces

log = logging.getLogger("kvferry.kernels.span_copy")

__all__ = ["IndexedTable", "copy_indexed", "indexed_table"]


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
        self.constants = kernel_constants(
            word=word,
            align=align,
            block=LONG_BLOCK_WORDS if long_pieces else BLOCK_WORDS,
            num_warps=LONG_NUM_WARPS if long_pieces else NUM_WARPS,
            stream=STREAMING,
            rotate=ROTATE,
            indexed=True,
        )
        self.key = Launcher.key(device.index, self.constants) if device.type == "cuda" else ()
        #: the launch of the grid form (pieces alike in length, :func:`~kvferry.kernels.span_copy.grid_of`; its
        #: programs read the ids from device memory), or None; its constants and key
        self.grid = grid_of(pieces, longest, nbytes, GRID_BLOCK_BYTES) if GRID else None
        self.grid_constants = {
            **self.constants,
            "BLOCK": GRID_BLOCK_BYTES // word,
            "GRID": True,
            "num_warps": GRID_NUM_WARPS,
        }
        self.grid_key = Launcher.key(device.index, self.grid_constants) if device.type == "cuda" else ()

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
    ``device``, ids from one vector of ``ids`` values). Long rows are cut into pieces as
    :func:`~kvferry.kernels.span_copy.piece_table` cuts long spans
    (:func:`~kvferry.kernels.span_copy.tables.indexed_pieces`). Nothing is checked here: the caller checked
    every address any allowed id can reach."""
    import torch

    if device.type == "cuda" and device.index is None:  # the ordinal the launcher keeps its kernels under
        device = torch.device("cuda", torch.cuda.current_device())
    host = indexed_pieces(
        src_slot, src_address, src_stride, dst_slot, dst_address, dst_stride, length, piece_bytes
    )
    table = torch.from_numpy(host.table).to(device)
    return IndexedTable(
        table, host.base, host.word, host.align, ids, host.total, len(host.table), device, host.longest
    )


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

    The ids come from pinned host memory: ``ids`` itself when ``pinned`` (a
    :func:`~kvferry.kernels.span_copy.pinned_ids` vector), else a pinned copy appended to ``keep``. With
    ``device_ids`` (an int64 tensor on the table's device, at least as long) they are copied there first, on
    the stream, and the kernel reads them from device memory: each of its programs reads two ids, which from
    host memory is a round trip over PCIe per program. Hold ``ids``, ``device_ids``, ``keep`` and ``table``
    until the stream has passed this launch (the caller synchronises before it lets go, cancelled or not)."""
    if not table.pieces:
        return True
    try:
        if not pinned:
            copy = pinned_words(len(ids))
            copy[...] = ids
            keep.append(copy)
            ids = copy
        address = ids.ctypes.data
        on_device = device_ids is not None and upload_async(
            device_ids.data_ptr(), address, ids.nbytes, current_stream(table.key[0])
        )
        if on_device:
            address = device_ids.data_ptr()
        # the grid form only with the ids in device memory (each of its many programs reads two)
        grid = table.grid if on_device else None
        launcher.launch(
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
        copy_kernel.cache_clear()
        return False
    return True
