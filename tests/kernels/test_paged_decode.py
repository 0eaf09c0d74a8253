"""Paged decode attention (pages read in place) against the reference model's paged attention.

The torch form runs everywhere, the Triton kernel compiled on CUDA and in Triton's interpreter on the CPU
(:mod:`tests.support.triton_modes`).
"""

from __future__ import annotations

import pytest
import torch

from kvferry.kernels.paged_decode import paged_decode_attention
from kvferry.model.attention import paged_attention
from tests.support.triton_modes import CUDA, MODES, run_interpreted


def test_the_triton_kernel_interpreted() -> None:
    run_interpreted(__file__)


def _case(
    dev: torch.device, *, q_heads: int, kv_heads: int, tokens_per_block: int, head_dim: int
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    pages = 12
    # K and V interleaved by page, as an arena lays them out
    both = torch.randn(pages, 2, kv_heads, tokens_per_block, head_dim, generator=gen)
    keys, values = both[:, 0], both[:, 1]
    # strided, as a packed buffer gives them
    lengths = torch.tensor([[1, 3 * tokens_per_block, 2 * tokens_per_block + 3], [0, 0, 0]]).T[:, 0]
    tables = torch.tensor([[7, 0, 0, 0], [2, 9, 4, 0], [11, 1, 5, 0]])
    # garbage a query may not see: past each length in its own pages (no page is shared), and in page 0, which
    # pads the tables
    for row, length in enumerate(lengths.tolist()):
        for position in range(length, 4 * tokens_per_block):
            block, offset = divmod(position, tokens_per_block)
            keys[tables[row, block], :, offset] = float("nan")
            values[tables[row, block], :, offset] = float("inf")
    keys[0] = float("nan")
    values[0] = float("nan")
    query = torch.randn(3, q_heads + 1, head_dim, generator=gen)[:, 1:]  # strided rows
    both = both.to(dev)
    return [query.to(dev), both[:, 0], both[:, 1], tables.to(dev), lengths.to(dev)]


@pytest.mark.parametrize(
    "q_heads,kv_heads,tokens_per_block,head_dim", [(8, 2, 4, 16), (6, 6, 16, 8), (32, 8, 32, 128)]
)
@pytest.mark.parametrize("mode", MODES)
def test_matches_the_reference_attention(
    mode: str, q_heads: int, kv_heads: int, tokens_per_block: int, head_dim: int
) -> None:
    if mode != "torch":
        pytest.importorskip("triton")
    dev = torch.device("cuda" if mode == "cuda" else "cpu")
    query, keys, values, tables, lengths = _case(
        dev, q_heads=q_heads, kv_heads=kv_heads, tokens_per_block=tokens_per_block, head_dim=head_dim
    )
    scale = head_dim**-0.5
    expected = paged_attention(query[:, None], keys, values, tables, (lengths - 1)[:, None], scale)[:, 0]
    out = paged_decode_attention(query, keys, values, tables, lengths, scale, use_triton=mode != "torch")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_bfloat16_pages_on_cuda() -> None:
    pytest.importorskip("triton")
    query, keys, values, tables, lengths = _case(
        torch.device("cuda"), q_heads=32, kv_heads=8, tokens_per_block=32, head_dim=128
    )
    expected = paged_attention(
        query.double()[:, None], keys.double(), values.double(), tables, (lengths - 1)[:, None], 128**-0.5
    )[:, 0]
    out = paged_decode_attention(
        query.bfloat16(), keys.bfloat16(), values.bfloat16(), tables, lengths, 128**-0.5
    )
    torch.testing.assert_close(out.double(), expected, rtol=3e-2, atol=3e-2)
