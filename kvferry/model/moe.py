"""KimiLinear's feed-forward blocks in plain torch: the dense SiLU-gated MLP and the routed MoE.

The MoE (transformers' ``KimiLinearMoE``): a sigmoid router whose choice adds ``e_score_correction_bias``;
experts in ``n_group`` groups, each group scored by the sum of its two best biased scores, only the
``topk_group`` best groups eligible; the ``num_experts_per_tok`` best eligible experts are chosen, weighted
by their *unbiased* scores (renormalised to sum 1 with ``norm_topk_prob``) times ``routed_scaling_factor``;
plus the shared experts (one SiLU-gated MLP of ``moe_intermediate_size * n_shared_experts``) on every token.
The router computes in at least float32 (transformers keeps it in float32 for bf16 models).

Tensor parallelism: every rank routes identically (the router is replicated) and holds every expert, each
expert's intermediate channels split over ranks (``gate_up_proj`` rows colwise, ``down_proj`` columns
rowwise), as the shared experts and the dense MLP are; each rank returns a partial sum over its channels.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

__all__ = ["gated_mlp", "moe_block", "route"]


def gated_mlp(w: Mapping[str, torch.Tensor], prefix: str, h: torch.Tensor) -> torch.Tensor:
    """``down_proj(silu(gate_proj(h)) * up_proj(h))`` (a rank's channels: a partial sum)."""
    gate = h @ w[prefix + "gate_proj.weight"].T
    up = h @ w[prefix + "up_proj.weight"].T
    return (F.silu(gate) * up) @ w[prefix + "down_proj.weight"].T


def route(
    h: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's choice for each row of ``h`` ``[rows, hidden]``: ``(weights, experts)``, both
    ``[rows, top_k]`` (weights in the router's dtype, at least float32)."""
    dtype = torch.promote_types(h.dtype, torch.float32)
    scores = (h.to(dtype) @ gate.to(dtype).T).sigmoid()
    num_experts = scores.shape[-1]
    choice = scores + bias.to(dtype)
    group_scores = choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    eligible = (
        group_mask.bool()[:, :, None].expand(-1, n_group, num_experts // n_group).reshape(-1, num_experts)
    )
    choice = choice.masked_fill(~eligible, float("-inf"))
    experts = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, experts)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, experts


def moe_block(
    w: Mapping[str, torch.Tensor],
    prefix: str,
    h: torch.Tensor,
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> torch.Tensor:
    """One rank's share of a MoE block over rows ``h`` ``[rows, hidden]``: routed experts plus shared experts.

    :param w: the rank's tensors under ``prefix``: ``gate.weight``, ``gate.e_score_correction_bias``
        (replicated), ``experts.gate_up_proj`` ``[E, 2 * I_rank, hidden]`` (the rank's gate rows, then its
        up rows), ``experts.down_proj`` ``[E, hidden, I_rank]``, ``shared_experts.*``.
    """
    weights, experts = route(
        h,
        w[prefix + "gate.weight"],
        w[prefix + "gate.e_score_correction_bias"],
        top_k=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm_topk_prob,
        scaling=scaling,
    )
    gate_up, down = w[prefix + "experts.gate_up_proj"], w[prefix + "experts.down_proj"]
    out = torch.zeros_like(h)
    # experts in ascending order, each over its tokens (transformers' eager order of accumulation)
    for expert in torch.unique(experts).tolist():
        token_idx, slot = torch.where(experts == expert)
        gate, up = (h[token_idx] @ gate_up[expert].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down[expert].T
        out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(out.dtype))
    return out + gated_mlp(w, prefix + "shared_experts.", h)
