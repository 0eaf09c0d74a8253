"""The span copy's kernel run by Triton's interpreter (``TRITON_INTERPRET=1``, on the CPU): every form of it
(fragment rows, grid, loop, indexed) over the tables the library builds, with the bytes checked against slices.

These run wherever Triton is installed, CUDA or not (CI installs it with the test extra), so the kernel's
address arithmetic is checked on every run; the GPU tests in ``test_span_copy.py`` check the compiled kernel and
its launch on a device. The interpreter takes tensors, not raw addresses: every address here lies in one
buffer whose start, aligned to 256 bytes, is the base the kernel counts from.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from kvferry.kernels import span_copy
from kvferry.kernels.span_copy.copies import fragment_launch
from kvferry.kernels.span_copy.kernel import copy_kernel

pytest.importorskip("triton")

BYTES = 1 << 19


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The kernel as Triton's interpreter runs it (compiled again as usual afterwards)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    copy_kernel.cache_clear()
    yield copy_kernel()
    copy_kernel.cache_clear()


def _loops_over_program_ids() -> bool:
    """Whether this Triton's interpreter runs a loop that starts at a program id (the loop form's): older
    interpreters give ``program_id`` as a one-element array, which numpy 2.5 no longer turns into an int
    (Triton 3.6 with numpy 2.5.2 on the H200 machine)."""
    import triton
    import triton.language as tl

    @triton.jit
    def strided(out_ptr, n):  # type: ignore[no-untyped-def]
        for i in range(tl.program_id(0), n, tl.num_programs(0)):
            tl.store(out_ptr + i, i)

    out = torch.zeros(6, dtype=torch.int64)
    try:
        strided[(2,)](out, 6)
    except Exception:  # the interpreter's error (InterpreterError wrapping numpy's TypeError)
        return False
    return out.tolist() == list(range(6))


@pytest.fixture
def loop_form(kernel: Any) -> None:
    """Skips a test of the loop form where this Triton's interpreter cannot run it (its compiled kernel is
    tested on CUDA in test_span_copy.py)."""
    if not _loops_over_program_ids():
        pytest.skip(f"Triton {__import__('triton').__version__}'s interpreter cannot loop from a program id")


@pytest.fixture
def buffer() -> torch.Tensor:
    """A buffer of random bytes starting at a multiple of 256 bytes."""
    whole = torch.randint(0, 256, (BYTES + 256,), dtype=torch.uint8)
    start = (-whole.data_ptr()) % 256
    return whole[start : start + BYTES]


def _layout(
    buffer: torch.Tensor, lengths: np.ndarray, seed: int, gap: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Source offsets packed in order in the lower half, destination offsets in a permuted order in the upper
    half (``gap`` bytes after each row)."""
    order = np.random.default_rng(seed).permutation(len(lengths))
    src = np.cumsum(lengths) - lengths
    dst = np.empty_like(src)
    dst[order] = BYTES // 2 + np.cumsum(lengths[order] + gap) - lengths[order] - gap
    assert int((dst + lengths).max()) <= BYTES and int((src + lengths).max()) <= BYTES // 2
    return src, dst


def _expected(buffer: torch.Tensor, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
    expected = buffer.clone()
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        expected[d : d + n] = buffer[s : s + n]
    return expected


@pytest.mark.parametrize("case", ["alike", "merged", "empty rows"])
def test_fragment_rows(kernel: Any, buffer: torch.Tensor, case: str) -> None:
    """copy_fragments' form over fragment_table's table: both fragment arrays one after the other, the kernel's
    words worked out from the absolute addresses (destinations below and above the first source), merged rows
    in more rounds."""
    block = span_copy.GRID_BLOCK_BYTES
    lengths = np.full(24, 2 * block, dtype=np.int64)
    if case == "merged":
        lengths[[3, 9]] = 7 * block  # three rounds of the mean row's programs, launched as four
    elif case == "empty rows":
        lengths[[0, 5]] = (0, 48)
    src, dst = _layout(buffer, lengths, seed=len(case))
    # sources in the upper half too, below some destinations: offsets of both signs from the origin
    src, dst = (src, dst) if case != "alike" else (dst, src)
    base = buffer.data_ptr()
    s_rows = np.stack([base + src, lengths], axis=1).astype(np.uint64)
    d_rows = np.stack([base + dst, lengths], axis=1).astype(np.uint64)
    table = span_copy.fragment_table(
        s_rows,
        d_rows,
        longest=int(lengths.max()),
        total=int(lengths.sum()),
        allocate=lambda words: np.empty(words, dtype=np.int64),
    )
    assert table is not None
    assert (table.rows, table.rounds) == (24, 4 if case == "merged" else 1)
    constants, _ = fragment_launch(0, table.rounds)
    origin = int(s_rows[0, 0]) & ~255
    expected = _expected(buffer, src, dst, lengths)
    whole = buffer[origin - base :]
    words = torch.from_numpy(table.words)
    kernel[table.grid](whole, words, words, table.rows, **constants)
    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("form", ["grid", "loop"])
@pytest.mark.parametrize("alignment", [1, 4, 16])
def test_piece_table_forms(
    kernel: Any, buffer: torch.Tensor, form: str, alignment: int, request: pytest.FixtureRequest
) -> None:
    """copy_spans' forms over its piece table: the grid (one program per block of a piece) and the loop (one
    program per piece), in the widest word the spans allow, masked tails included (spans cut into pieces of
    at most 1 KiB)."""
    if form == "loop":
        request.getfixturevalue("loop_form")
    rng = np.random.default_rng(alignment)
    lengths = (rng.integers(1, 3000, 40) // alignment + 1) * alignment
    src, dst = _layout(buffer, lengths, seed=alignment, gap=alignment)
    base = buffer.data_ptr()
    pieces = span_copy.piece_table(base + src, base + dst, lengths, piece_bytes=1024)
    assert pieces.base == base
    block_bytes = span_copy.GRID_BLOCK_BYTES
    # the loop form takes any table; the grid form a table of pieces alike in length
    grid = span_copy.grid_of(len(pieces.table), pieces.longest, pieces.total, block_bytes)
    if form == "grid":
        assert grid is not None
    else:
        grid = None
    block = block_bytes // pieces.word if grid else 64
    constants = {
        "WORD": pieces.word,
        "ALIGN": pieces.align,
        "BLOCK": block,
        "STREAM": False,
        "ROTATE": span_copy.ROTATE,
        "INDEXED": False,
        "GRID": grid is not None,
        "FRAGMENTS": False,
        "ROUNDS": 1,
    }
    expected = _expected(buffer, src, dst, lengths)
    table = torch.from_numpy(np.ascontiguousarray(pieces.table))
    kernel[grid or (len(pieces.table), 1, 1)](buffer, table, table, len(pieces.table), **constants)
    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("grid", [False, True])
def test_indexed_rows(kernel: Any, buffer: torch.Tensor, grid: bool, request: pytest.FixtureRequest) -> None:
    """copy_indexed's table: each row's addresses are its address at id 0 plus an id (from the launch's id
    vector) times its stride, on each side."""
    if not grid:
        request.getfixturevalue("loop_form")
    slot = 2048
    ids = torch.tensor([3, 0, 5, 1], dtype=torch.int64)  # source page, destination page, twice
    base = buffer.data_ptr()
    table = span_copy.indexed_table(
        torch.device("cpu"),
        src_slot=np.array([0, 2]),
        src_address=base + np.array([0, 16 * slot]),
        src_stride=np.array([slot, slot]),
        dst_slot=np.array([1, 3]),
        dst_address=base + BYTES // 2 + np.array([0, 16 * slot]),
        dst_stride=np.array([slot, slot]),
        length=np.array([slot, slot]),
        ids=len(ids),
        piece_bytes=1024,
    )
    expected = buffer.clone()
    for (s_slot, d_slot), at in zip(((0, 1), (2, 3)), (0, 16 * slot), strict=True):
        s = at + int(ids[s_slot]) * slot
        d = BYTES // 2 + at + int(ids[d_slot]) * slot
        expected[d : d + slot] = buffer[s : s + slot]
    assert table.base == base
    launch = table.grid if grid else None
    if grid:
        assert launch is not None
    constants = {
        k: v for k, v in (table.grid_constants if launch else table.constants).items() if k != "num_warps"
    }
    kernel[launch or (table.pieces, 1, 1)](buffer, table.table, ids, table.pieces, **constants)
    assert torch.equal(buffer, expected)
