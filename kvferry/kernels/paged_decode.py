"""Paged attention of one decode token per sequence, reading the pages in place (Triton), with a torch form.

The cache layout is the reference model's (:mod:`kvferry.model.attention`): per layer ``K, V`` of shape
``[num_pages, kv_heads, tokens_per_block, head_dim]``, a sequence's pages listed by its block table. The new
token's K/V must already be in its page. Each query attends to positions ``< length`` of its sequence; nothing
past them is read, so whatever bytes free pages or the tail of the last block hold never reach a result.

The kernel needs no host synchronisation and allocates only its output, so a CUDA graph can hold it.
Kernels import nothing from the rest of kvferry.
"""

from __future__ import annotations

import math

import torch

from kvferry.kernels.mamba_decode import next_power_of_2, triton_available

__all__ = ["paged_decode_attention", "paged_decode_attention_torch"]


def paged_decode_attention_torch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The torch form of :func:`paged_decode_attention` (gathers every listed page; for tests and the CPU)."""
    batch, q_heads, head_dim = query.shape
    _, kv_heads, tokens_per_block, _ = key_cache.shape
    group = q_heads // kv_heads
    span = block_tables.shape[1] * tokens_per_block
    keys = key_cache[block_tables].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim)
    values = value_cache[block_tables].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim)
    visible = torch.arange(span, device=query.device)[None, :] < lengths[:, None]  # [batch, span]
    keys = torch.where(visible[:, None, :, None], keys.to(query.dtype), 0.0)
    values = torch.where(visible[:, None, :, None], values.to(query.dtype), 0.0)
    q = query.reshape(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bkgd,bksd->bkgs", q, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
    out = torch.einsum("bkgs,bksd->bkgd", torch.softmax(scores, dim=-1), values)
    return out.reshape(batch, q_heads, head_dim)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """GQA attention of one query token per sequence over its pages.

    :param query: ``[batch, q_heads, head_dim]`` (rows may be strided; heads and channels contiguous);
        query head ``h`` reads kv head ``h // (q_heads // kv_heads)``.
    :param key_cache: ``[num_pages, kv_heads, tokens_per_block, head_dim]``, channels contiguous, any other
        strides (an arena interleaves K and V by page); ``value_cache`` alike.
    :param block_tables: ``[batch, max_blocks]`` int page ids; only the first ``ceil(length / tokens_per_block)``
        of a row are read. :param lengths: ``[batch]`` visible positions per sequence (>= 1).
    :param use_triton: None: Triton where available on the device; True/False forces the choice.
    :return: ``[batch, q_heads, head_dim]`` in the query's dtype.
    """
    if use_triton is None:
        use_triton = triton_available(query.device)
    if not use_triton:
        return paged_decode_attention_torch(query, key_cache, value_cache, block_tables, lengths, scale)
    batch, q_heads, head_dim = query.shape
    _, kv_heads, tokens_per_block, _ = key_cache.shape
    if query.stride(2) != 1 or query.stride(1) != head_dim:
        raise ValueError("paged_decode_attention needs each query row's heads and channels contiguous")
    if key_cache.stride(3) != 1 or value_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("paged_decode_attention needs contiguous channels and block table rows")
    from kvferry.kernels import decode_triton

    lengths = lengths.contiguous()  # the kernel reads length i at lengths_ptr + i
    out = torch.empty(batch, q_heads, head_dim, dtype=query.dtype, device=query.device)
    group = q_heads // kv_heads
    decode_triton.paged_decode_kernel()[(batch, kv_heads)](
        query,
        query.stride(0),
        key_cache,
        value_cache,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables,
        block_tables.stride(0),
        lengths,
        out,
        out.stride(0),
        float(scale),
        group,
        head_dim,
        TOKENS_PER_BLOCK=tokens_per_block,
        BLOCK_T=max(16, next_power_of_2(tokens_per_block)),
        BLOCK_G=max(16, next_power_of_2(group)),
        BLOCK_D=max(16, next_power_of_2(head_dim)),
    )
    return out
