"""Paged attention over head-major (HND) pages, in plain torch (device-agnostic).

A layer's cache is two tensors ``K, V`` of shape ``[num_pages, kv_heads, tokens_per_block, head_dim]`` (one
page id = one block of ``tokens_per_block`` consecutive positions of one sequence). A sequence's
*block table* lists its page ids in position order, so position ``p`` lives in page ``block_table[p //
tokens_per_block]`` at offset ``p % tokens_per_block``.

One kernel serves every step shape: a prefill chunk, a decode token and a multi-token verify are all "these
queries at these positions attend to every cached position up to and including their own". The new tokens'
K/V are written into their pages first (:func:`write_kv`), then :func:`paged_attention` reads everything from
the pages. Positions past a query's own are masked out *before* they touch the arithmetic, so stale or
garbage bytes (even NaN) in free pages or in the unused tail of the last block never change a result.
"""

from __future__ import annotations

import math

import torch
from attrs import frozen

from kvferry.errors import ConfigError

__all__ = ["Rope", "attention_step", "page_coordinates", "paged_attention", "write_kv"]


@frozen
class Rope:
    """Rotary position embedding (NeoX "rotate half" form) on the first ``rotary_dim`` channels of a head.

    NemotronH attention has none; the argument exists for models that do (KimiLinear's MLA rotary part).
    """

    rotary_dim: int
    theta: float = 10000.0

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` ``[..., heads, head_dim]`` by ``positions`` ``[...]`` (same leading shape)."""
        if self.rotary_dim % 2 or self.rotary_dim > x.shape[-1]:
            raise ConfigError(f"rotary_dim {self.rotary_dim} must be even and <= head_dim {x.shape[-1]}")
        half = self.rotary_dim // 2
        exponent = torch.arange(half, device=x.device, dtype=torch.float64) * (2.0 / self.rotary_dim)
        inv_freq = (1.0 / (self.theta**exponent)).to(x.dtype)
        angles = positions.to(x.dtype)[..., None] * inv_freq  # [..., half]
        cos = torch.cos(angles)[..., None, :]
        sin = torch.sin(angles)[..., None, :]
        x1 = x[..., :half]
        x2 = x[..., half : self.rotary_dim]
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return torch.cat((rotated, x[..., self.rotary_dim :]), dim=-1)


def page_coordinates(
    block_tables: torch.Tensor, positions: torch.Tensor, tokens_per_block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Page id and in-page offset of each position.

    :param block_tables: ``[batch, max_blocks]`` int64 page ids.
    :param positions: ``[batch, q]`` int64 positions (each must be covered by its row's block table).
    :return: ``(page_ids, offsets)``, both ``[batch, q]``.
    """
    blocks = torch.div(positions, tokens_per_block, rounding_mode="floor")
    page_ids = torch.gather(block_tables, 1, blocks)
    return page_ids, positions - blocks * tokens_per_block


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    page_ids: torch.Tensor,
    offsets: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[tokens, kv_heads, head_dim]`` into their pages, in place.

    :param page_ids: ``[tokens]`` page of each token; :param offsets: ``[tokens]`` offset inside the page.
    Two tokens must not name the same (page, offset); nothing else in the caches is touched.
    """
    key_cache[page_ids, :, offsets] = key.to(key_cache.dtype)
    value_cache[page_ids, :, offsets] = value.to(value_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of ``query`` over the paged cache.

    :param query: ``[batch, q, q_heads, head_dim]``; ``q_heads`` a multiple of the cache's kv heads (query
        head ``h`` reads kv head ``h // (q_heads // kv_heads)``).
    :param key_cache: ``[num_pages, kv_heads, tokens_per_block, head_dim]`` (``value_cache`` alike).
    :param block_tables: ``[batch, max_blocks]`` int64; entries past a sequence's last block may hold any
        valid page id (their positions are masked).
    :param positions: ``[batch, q]`` int64 position of each query; it attends to cached positions ``<=`` its
        own, which must already be written. A negative position marks a padding query (output zeros).
    :return: ``[batch, q, q_heads, head_dim]``.
    """
    batch, num_q, q_heads, head_dim = query.shape
    _, kv_heads, tokens_per_block, _ = key_cache.shape
    if q_heads % kv_heads:
        raise ConfigError(f"{q_heads} query heads are not a multiple of {kv_heads} kv heads")
    group = q_heads // kv_heads
    max_blocks = block_tables.shape[1]
    span = max_blocks * tokens_per_block
    # [batch, blocks, kv, tpb, d] -> [batch, kv, blocks*tpb, d]
    keys = key_cache[block_tables].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim)
    values = value_cache[block_tables].permute(0, 2, 1, 3, 4).reshape(batch, kv_heads, span, head_dim)
    kv_pos = torch.arange(span, device=query.device)
    visible = kv_pos[None, None, :] <= positions[:, :, None]  # [batch, q, span]
    # Any position a query may not see is zeroed before the arithmetic: garbage (NaN, inf) stays out.
    any_visible = visible.any(dim=1)  # [batch, span]
    keys = torch.where(any_visible[:, None, :, None], keys.to(query.dtype), 0.0)
    values = torch.where(any_visible[:, None, :, None], values.to(query.dtype), 0.0)
    q = query.reshape(batch, num_q, kv_heads, group, head_dim)
    scores = torch.einsum("bqkgd,bksd->bkgqs", q, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None, :, :], -math.inf)
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nan_to_num(weights, nan=0.0)  # all-masked padding rows
    out = torch.einsum("bkgqs,bksd->bqkgd", weights, values)
    return out.reshape(batch, num_q, q_heads, head_dim)


def attention_step(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    rope: Rope | None = None,
) -> torch.Tensor:
    """Write the new tokens' K/V into their pages, then attend (prefill chunk, decode or verify).

    :param query: ``[batch, q, q_heads, head_dim]``; ``key``/``value`` ``[batch, q, kv_heads, head_dim]``.
    :param positions: ``[batch, q]`` positions of the new tokens (no padding: every row is written).
    :param rope: rotary embedding applied to query and key first (None for NemotronH).
    On failure part of the new tokens' K/V may have been written; those positions belong to this step only.
    """
    if rope is not None:
        query = rope.apply(query, positions)
        key = rope.apply(key, positions)
    tokens_per_block = key_cache.shape[2]
    page_ids, offsets = page_coordinates(block_tables, positions, tokens_per_block)
    write_kv(
        key_cache,
        value_cache,
        key.reshape(-1, *key.shape[2:]),
        value.reshape(-1, *value.shape[2:]),
        page_ids.reshape(-1),
        offsets.reshape(-1),
    )
    return paged_attention(query, key_cache, value_cache, block_tables, positions, scale)
