"""The batched span copy: its piece table (numpy, everywhere) and its Triton kernel (CUDA only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvferry import span_copy

cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or not span_copy.available(torch.device("cuda")),
    reason="needs CUDA and Triton",
)


def _spans(
    rng: np.random.Generator, n: int, alignment: int, max_length: int, base: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Disjoint source spans in shuffled order and destination spans packed, at offsets from ``base``."""
    lengths = rng.integers(1, max_length + 1, n) // alignment * alignment + alignment
    slot = int(lengths.max()) + alignment
    src = base + rng.permutation(n).astype(np.int64) * slot
    dst = base + n * slot + np.cumsum(lengths) - lengths
    return src, dst, lengths, n * slot + int(lengths.sum())


def _apply(memory: np.ndarray, base: int, table: np.ndarray, word_base: int, word: int) -> None:
    """What the kernel does with the table, in numpy: word offsets relative to ``word_base``."""
    for s, d, n in table.tolist():
        a, b = word_base + s * word - base, word_base + d * word - base
        memory[b : b + n * word] = memory[a : a + n * word]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    alignment=st.sampled_from([1, 2, 4, 8, 16, 64]),
    max_length=st.sampled_from([7, 300, 5000]),
    piece=st.sampled_from([16, 64, 4096]),
    base_offset=st.sampled_from([0, 1, 8, 16, 256]),
)
def test_piece_table_moves_exactly_the_spans(
    seed: int, alignment: int, max_length: int, piece: int, base_offset: int
) -> None:
    rng = np.random.default_rng(seed)
    base = (1 << 40) + base_offset * alignment
    src, dst, lengths, size = _spans(rng, int(rng.integers(1, 40)), alignment, max_length, base)
    memory = rng.integers(0, 256, size, dtype=np.uint8)
    expected = memory.copy()
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        expected[d - base : d - base + n] = memory[s - base : s - base + n]
    table, word_base, word, align = span_copy.piece_table(src, dst, lengths, piece)
    assert word_base % 256 == 0 and word_base <= base
    # the word divides every address and length; the alignment hint holds for every piece
    assert (table % align == 0).all()
    assert (table[:, 2] * word <= max(piece, word * align)).all()
    assert table[:, 2].sum() * word == lengths.sum()
    _apply(memory, base, table, word_base, word)
    assert np.array_equal(memory, expected)


def test_piece_table_word_and_alignment() -> None:
    def word_align(*values: int) -> tuple[int, int]:
        a = np.array(values, dtype=np.int64)
        _, _, word, align = span_copy.piece_table(a + (1 << 20), a + (1 << 21), np.full(len(a), 32))
        return word, align

    assert word_align(0, 16, 32) == (8, 2)
    assert word_align(0, 8) == (8, 1)
    assert word_align(0, 4) == (4, 1)
    assert word_align(0, 6) == (2, 1)
    assert word_align(0, 3) == (1, 1)
    table, *_ = span_copy.piece_table(np.array([64]), np.array([128]), np.array([0]))
    assert table.shape == (0, 3)


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("alignment", [1, 2, 4, 8, 16, 64])
@pytest.mark.parametrize("max_length", [7, 4096, 300_000])
def test_copy_spans_matches_slices(alignment: int, max_length: int) -> None:
    rng = np.random.default_rng(alignment * 1000 + max_length)
    n = 200
    lengths = rng.integers(1, max_length + 1, n) // alignment * alignment + alignment
    slot = int(lengths.max()) + alignment
    src = torch.randint(0, 256, (n * slot,), dtype=torch.uint8, device="cuda")
    # the destination in another allocation: one launch spans both
    dst = torch.zeros(int(lengths.sum()) + 64, dtype=torch.uint8, device="cuda")
    src_offsets = rng.permutation(n).astype(np.int64) * slot
    dst_offsets = np.cumsum(lengths) - lengths
    pieces = span_copy.copy_spans(
        src.device, src.data_ptr() + src_offsets, dst.data_ptr() + dst_offsets, lengths
    )
    assert pieces >= n
    torch.cuda.synchronize()
    expected = torch.zeros_like(dst)
    for s, d, length in zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist(), strict=True):
        expected[d : d + length] = src[s : s + length]
    assert torch.equal(dst, expected)


@cuda
@pytest.mark.gpu
def test_repeated_launches_skip_the_jit_and_copy_the_same() -> None:
    """The second launch of a configuration calls the compiled kernel directly; its bytes are as right."""
    src = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda")
    lengths = np.full(64, 4096, dtype=np.int64)
    src_addr = src.data_ptr() + np.arange(64, dtype=np.int64)[::-1] * 4096
    for _ in range(3):
        dst = torch.zeros(64 * 4096, dtype=torch.uint8, device="cuda")
        direct = span_copy._launcher.direct_launches
        dst_addr = dst.data_ptr() + np.arange(64, dtype=np.int64) * 4096
        assert span_copy.copy_spans(src.device, src_addr, dst_addr, lengths) == 64
        torch.cuda.synchronize()
        assert torch.equal(dst.view(64, 4096), src[: 64 * 4096].view(64, 4096).flip(0))
    assert span_copy._launcher.direct_launches >= direct + 1
