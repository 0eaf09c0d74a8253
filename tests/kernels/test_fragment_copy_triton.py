"""The Triton fragment copy (CUDA only) against a per-fragment slice copy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvferry.kernels import fragment_copy_triton

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or not fragment_copy_triton.triton_imports(),
        reason="needs CUDA and Triton",
    ),
]


@pytest.mark.parametrize("alignment", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("max_length", [7, 4096, 300_000])
def test_copy_fragments_matches_slices(alignment: int, max_length: int) -> None:
    rng = np.random.default_rng(alignment * 1000 + max_length)
    n = 200
    lengths = rng.integers(1, max_length + 1, n) // alignment * alignment + alignment
    # disjoint source fragments in a shuffled order, packed destination (the gather of the bounce path)
    slots = rng.permutation(n)
    slot_bytes = int(lengths.max()) + alignment
    src_offsets = slots.astype(np.int64) * slot_bytes
    dst_offsets = np.cumsum(lengths) - lengths
    src = torch.randint(0, 256, (n * slot_bytes,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(int(lengths.sum()) + 64, dtype=torch.uint8, device="cuda")
    fragment_copy_triton.copy_fragments(src, src_offsets, dst, dst_offsets, lengths)
    torch.cuda.synchronize()
    expected = torch.zeros_like(dst)
    for s, d, length in zip(src_offsets.tolist(), dst_offsets.tolist(), lengths.tolist(), strict=True):
        expected[d : d + length] = src[s : s + length]
    assert torch.equal(dst, expected)
