"""The span copy's Triton kernel, its three forms (fragment rows, grid, loop) and the shapes it is compiled in.

Triton is imported only when the kernel is first built (:func:`copy_kernel`), so importing this module costs
nothing where Triton is missing.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = [
    "BLOCK_WORDS",
    "GRID_NUM_WARPS",
    "LONG_BLOCK_WORDS",
    "LONG_NUM_WARPS",
    "LONG_PIECE_BYTES",
    "NUM_WARPS",
    "PROGRAMS_PER_SM",
    "ROTATE",
    "STREAMING",
    "available",
    "copy_kernel",
    "kernel_constants",
    "triton_imports",
]

#: Words one loop iteration of a program loads and stores.
BLOCK_WORDS = 2048
#: Warps per program.
NUM_WARPS = 8
#: Copies whose pieces average at least this many bytes use blocks of LONG_BLOCK_WORDS and LONG_NUM_WARPS warps:
#: long pieces move faster in short blocks of few warps, a writer's page mix in the default shape.
LONG_PIECE_BYTES = 512 << 10
LONG_BLOCK_WORDS = 512
LONG_NUM_WARPS = 4
#: Warps per program of the grid form.
GRID_NUM_WARPS = 4
#: Programs launched per multiprocessor, each looping over pieces; 0 launches one program per piece.
PROGRAMS_PER_SM = 0
#: Load with ``.cg`` and store with ``.cs`` (the bytes are not read again soon).
STREAMING = False
#: Program ``p`` starts at block ``p * ROTATE`` of its piece (mod its blocks); 0 starts every program at 0.
ROTATE = 7


def kernel_constants(
    *,
    word: int,
    align: int,
    block: int,
    num_warps: int,
    stream: bool = False,
    rotate: int = 0,
    indexed: bool = False,
    grid: bool = False,
    fragments: bool = False,
    rounds: int = 1,
) -> dict[str, Any]:
    """The compile-time constants of one form of :func:`copy_kernel` (its ``tl.constexpr`` parameters, in their
    order, then ``num_warps``): what a launch passes and what its compiled kernel is kept under."""
    return {
        "WORD": word,
        "ALIGN": align,
        "BLOCK": block,
        "STREAM": stream,
        "ROTATE": rotate,
        "INDEXED": indexed,
        "GRID": grid,
        "FRAGMENTS": fragments,
        "ROUNDS": rounds,
        "num_warps": num_warps,
    }


@functools.cache
def copy_kernel() -> Any:
    """The jitted kernel (built once per process; ``copy_kernel.cache_clear()`` builds it again, as after a
    failed launch or under ``TRITON_INTERPRET``).

    Its arguments: ``base_ptr`` (the address words are counted from), ``table_ptr`` (the piece table),
    ``ids_ptr`` (an indexed copy's ids, else unused), ``num_pieces``, then :func:`kernel_constants`."""
    import triton
    import triton.language as tl

    # No annotations but constexpr: Triton resolves a jitted function's annotations as globals.
    @triton.jit(do_not_specialize=["num_pieces"])  # type: ignore[untyped-decorator]
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
            # of 16-byte words only: a byte path beside it would cost every program registers, and with them
            # occupancy and bandwidth
            piece = tl.program_id(1) + tl.program_id(2) * tl.num_programs(1)
            if piece < num_pieces:
                row = table_ptr + 2 * piece.to(tl.int64)
                origin = base_ptr.to(tl.int64, bitcast=True)
                src = (tl.load(row) - origin) // 8
                count = tl.load(row + 1) // 8
                dst = (tl.load(row + 2 * num_pieces.to(tl.int64)) - origin) // 8
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
                    row = table_ptr + 7 * piece.to(tl.int64)
                    src = tl.load(row + 1) + tl.load(ids_ptr + tl.load(row)) * tl.load(row + 2)
                    dst = tl.load(row + 4) + tl.load(ids_ptr + tl.load(row + 3)) * tl.load(row + 5)
                    count = tl.load(row + 6)
                else:
                    row = table_ptr + 3 * piece.to(tl.int64)
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
def triton_imports() -> bool:
    """Whether Triton imports here (asked once per process)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def available(device: Any) -> bool:
    """True when ``device`` (a torch device) is a CUDA device and Triton imports."""
    return getattr(device, "type", None) == "cuda" and triton_imports()
