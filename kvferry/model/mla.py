"""Multi-head latent attention (MLA, KimiLinear's full-attention layers) over paged latents, in plain torch.

A layer's cache is one tensor ``[num_pages, tokens_per_block, latent_dim]``: per token the latent
``[kv_a_layernorm(kv_nope) (kv_lora_rank) | k_rot (qk_rope_head_dim)]`` that every query head shares
(KimiLinear applies no rotary embedding: ``k_rot`` is stored and used as it is). A step writes its tokens'
latents into their pages first, then each query attends over its sequence's pages up to its own position.

The arithmetic *expands* the latent, as transformers does: ``kv_b_proj`` maps every visible cached latent to
that head's ``k_nope`` and ``v``, the key is ``[k_nope | k_rot]``, scores are scaled by ``qk_head_dim ** -0.5``.
(Absorbing ``kv_b_proj`` into the query and the output would read fewer bytes but sums in another order;
expansion keeps transformers' order, which is what float64 equality is checked against.) Positions a query may
not see are zeroed before any arithmetic, so stale or garbage bytes (NaN, inf) in pages never reach a result.

Tensor parallelism: query heads (and their rows of ``q_proj`` / ``kv_b_proj``, columns of ``o_proj``) split
over ranks; the latent is replicated, every rank writes and reads its own copy; the output is a partial sum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from kvferry.kernels.norms import rms_norm
from kvferry.model.attention import page_coordinates

#: transformers builds ``kv_a_layernorm`` and ``q_a_layernorm`` with RMSNorm's default epsilon, not the
#: config's ``rms_norm_eps``
LATENT_NORM_EPS = 1e-6

__all__ = ["MlaDims", "mla_block", "paged_mla"]


class MlaDims(Protocol):
    """The MLA dims a block needs (:class:`~kvferry.model.kimi_args.KimiLinearArgs` has them)."""

    @property
    def kv_lora_rank(self) -> int: ...

    @property
    def qk_rope_head_dim(self) -> int: ...

    @property
    def qk_nope_head_dim(self) -> int: ...

    @property
    def v_head_dim(self) -> int: ...

    @property
    def q_lora_rank(self) -> int | None: ...


class _Rows(Protocol):
    # what a batch group gives the block: its token rows, positions and block tables (``_Group``)
    @property
    def rows(self) -> torch.Tensor: ...

    @property
    def positions(self) -> torch.Tensor: ...

    @property
    def block_tables(self) -> torch.Tensor: ...


def paged_mla(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    dims: MlaDims,
) -> torch.Tensor:
    """Causal MLA of ``query`` over the paged latents.

    :param query: ``[batch, q, heads, qk_nope + qk_rope]``.
    :param latent_cache: ``[num_pages, tokens_per_block, kv_lora_rank + qk_rope]``.
    :param kv_b: ``kv_b_proj`` rows of these heads ``[heads * (qk_nope + v), kv_lora_rank]``.
    :param block_tables: ``[batch, max_blocks]`` int64 (entries past a sequence's pages: any valid page id).
    :param positions: ``[batch, q]`` position of each query; it sees cached positions ``<=`` its own.
    :return: ``[batch, q, heads, v_head_dim]``.
    """
    batch, _, heads, qk_dim = query.shape
    _, tokens_per_block, latent_dim = latent_cache.shape
    rank, nope, v_dim = dims.kv_lora_rank, dims.qk_nope_head_dim, dims.v_head_dim
    span = block_tables.shape[1] * tokens_per_block
    latents = latent_cache[block_tables].reshape(batch, span, latent_dim)
    kv_pos = torch.arange(span, device=query.device)
    visible = kv_pos[None, None, :] <= positions[:, :, None]  # [batch, q, span]
    any_visible = visible.any(dim=1)  # [batch, span]
    latents = torch.where(any_visible[:, :, None], latents.to(query.dtype), 0.0)
    kv = (latents[..., :rank] @ kv_b.T).reshape(batch, span, heads, nope + v_dim)
    k_nope, values = torch.split(kv, [nope, v_dim], dim=-1)
    k_rot = latents[..., rank:][:, :, None, :].expand(batch, span, heads, latent_dim - rank)
    keys = torch.cat((k_nope, k_rot), dim=-1)
    scores = torch.einsum("bqhd,bshd->bhqs", query, keys) * qk_dim**-0.5
    scores = scores.masked_fill(~visible[:, None, :, :], -math.inf)
    weights = torch.nan_to_num(torch.softmax(scores, dim=-1), nan=0.0)  # all-masked padding rows
    return torch.einsum("bhqs,bshd->bqhd", weights, values)


def mla_block(
    w: Mapping[str, torch.Tensor],
    prefix: str,
    h: torch.Tensor,
    latent_cache: torch.Tensor,
    groups: Sequence[_Rows],
    dims: MlaDims,
) -> torch.Tensor:
    """One rank's share of an MLA block: its heads' queries, the tokens' latents written into their pages,
    attention per group, its ``o_proj`` columns. Returns the partial output ``[rows, hidden]``.

    :param w: the rank's tensors under ``prefix`` (``q_proj`` or ``q_a_proj``/``q_a_layernorm``/``q_b_proj``,
        ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``).
    :param h: ``[rows, hidden]`` normed input rows; each group names its rows, positions and block tables.
    On failure part of the new tokens' latents may be written; those positions belong to this step only.
    """
    qk_dim = dims.qk_nope_head_dim + dims.qk_rope_head_dim
    if dims.q_lora_rank is None:
        q = h @ w[prefix + "q_proj.weight"].T
    else:
        q_a = rms_norm(
            h @ w[prefix + "q_a_proj.weight"].T, w[prefix + "q_a_layernorm.weight"], LATENT_NORM_EPS
        )
        q = q_a @ w[prefix + "q_b_proj.weight"].T
    compressed = h @ w[prefix + "kv_a_proj_with_mqa.weight"].T
    kv_nope, k_rot = torch.split(compressed, [dims.kv_lora_rank, dims.qk_rope_head_dim], dim=-1)
    latent = torch.cat(
        (rms_norm(kv_nope, w[prefix + "kv_a_layernorm.weight"], LATENT_NORM_EPS), k_rot), dim=-1
    )
    kv_b = w[prefix + "kv_b_proj.weight"]
    heads = q.shape[-1] // qk_dim
    out = torch.empty(h.shape[0], heads * dims.v_head_dim, dtype=q.dtype, device=q.device)
    tokens_per_block = latent_cache.shape[1]
    for g in groups:
        b, n = g.rows.shape
        page_ids, offsets = page_coordinates(g.block_tables, g.positions, tokens_per_block)
        latent_cache[page_ids.reshape(-1), offsets.reshape(-1)] = latent[g.rows.reshape(-1)].to(
            latent_cache.dtype
        )
        attn = paged_mla(
            q[g.rows].reshape(b, n, heads, qk_dim), latent_cache, kv_b, g.block_tables, g.positions, dims
        )
        out[g.rows.reshape(-1)] = attn.reshape(b * n, -1)
    return out @ w[prefix + "o_proj.weight"].T
