"""Tensor parallelism, simulated faithfully inside one process.

Each rank holds only its head shard of every weight (:func:`shard_weights`, from ``spec.shard(tp, rank)``)
and its own cache pools; the only communication is :func:`all_reduce`, a sum over ranks in a fixed order, so
a run is deterministic for a given TP size. Splits follow Megatron: attention by query heads (kv heads split,
or duplicated when ``tp`` exceeds them), Mamba2 by heads (B and C by groups, duplicated when ``tp`` exceeds
them), the MLP by intermediate channels; the output projections are row-parallel (partial sums, then
all-reduce). Embedding, norms and the LM head are replicated. The Mamba2 gated RMSNorm normalises over groups
of ``intermediate / n_groups`` channels; when a group spans ranks its sum of squares is all-reduced too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from attrs import frozen

from kvferry.errors import ConfigError
from kvferry.pools.spec import HeadShard, LayerKind, RankSpec, split_heads

__all__ = ["RankWeights", "all_reduce", "shard_attention", "shard_weights"]


def all_reduce(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Sum the ranks' partial results in rank order (``((p0 + p1) + p2) + ...``); one part is returned as is."""
    if not parts:
        raise ConfigError("all_reduce of no parts")
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


@frozen
class RankWeights:
    """One rank's shard of the model: its spec and the sliced tensors (same names as the full state dict)."""

    rank: RankSpec
    tensors: Mapping[str, torch.Tensor]
    #: MLP intermediate channels of this rank.
    mlp_shard: HeadShard | None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)


def _rows(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return t[first : first + count].contiguous()


def _cols(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return t[:, first : first + count].contiguous()


def _check_heads_in(shard: HeadShard, per: int, outer: HeadShard, what: str) -> None:
    # The rank's inner heads (query heads, Mamba heads) must all read the outer heads (kv heads, groups) it holds.
    first, last = shard.first // per, (shard.first + shard.count - 1) // per
    if first < outer.first or last >= outer.first + outer.count:
        raise ConfigError(
            f"{what}: heads {shard.first}..{shard.first + shard.count - 1} read outside this rank's shard"
        )


def shard_attention(
    tensors: Mapping[str, torch.Tensor], prefix: str, q: HeadShard, kv: HeadShard, head_dim: int
) -> dict[str, torch.Tensor]:
    """One rank's slice of an attention block's ``q/k/v/o_proj`` (names under ``prefix``)."""
    _check_heads_in(q, q.total // kv.total, kv, prefix + "attention")
    d = head_dim
    return {
        prefix + "q_proj.weight": _rows(tensors[prefix + "q_proj.weight"], q.first * d, q.count * d),
        prefix + "k_proj.weight": _rows(tensors[prefix + "k_proj.weight"], kv.first * d, kv.count * d),
        prefix + "v_proj.weight": _rows(tensors[prefix + "v_proj.weight"], kv.first * d, kv.count * d),
        prefix + "o_proj.weight": _cols(tensors[prefix + "o_proj.weight"], q.first * d, q.count * d),
    }


def shard_weights(
    tensors: Mapping[str, torch.Tensor],
    rank: RankSpec,
    *,
    layer_kinds: Sequence[LayerKind],
    head_dim: int,
    mlp_intermediate: int,
) -> RankWeights:
    """Slice a full NemotronH state dict to one rank's shard.

    :param head_dim: attention head dim; :param mlp_intermediate: MLP intermediate size (split over ranks).
    :raises ~kvferry.errors.ConfigError: when a dimension does not split over ``rank.tp_size``.
    """
    spec = rank.model
    # embedding, final norm and LM head: replicated
    out = {name: t for name, t in tensors.items() if not name.startswith("model.layers.")}
    mlp_shard = (
        split_heads(mlp_intermediate, rank.tp_size, rank.rank) if LayerKind.MLP in layer_kinds else None
    )
    if mlp_shard is not None and mlp_shard.is_duplicated:
        raise ConfigError(f"MLP intermediate size {mlp_intermediate} < tp_size {rank.tp_size}")
    for i, kind in enumerate(layer_kinds):
        m = f"model.layers.{i}.mixer."
        out[f"model.layers.{i}.norm.weight"] = tensors[f"model.layers.{i}.norm.weight"]
        if kind == LayerKind.ATTENTION:
            q, kv = rank.attention_query_heads, rank.attention_kv_heads
            assert q is not None and kv is not None
            out.update(shard_attention(tensors, m, q, kv, head_dim))
        elif kind == LayerKind.MAMBA2:
            heads, groups, mamba = rank.mamba2_heads, rank.mamba2_groups, spec.mamba2
            assert heads is not None and groups is not None and mamba is not None
            _check_heads_in(heads, mamba.num_heads // mamba.num_groups, groups, "mamba2")
            p, n = mamba.head_dim, mamba.state_size
            inter, gn = mamba.intermediate_size, mamba.num_groups * n
            x0, xc = heads.first * p, heads.count * p
            b0, bc = groups.first * n, groups.count * n
            in_proj = tensors[m + "in_proj.weight"]
            out[m + "in_proj.weight"] = torch.cat(
                (
                    _rows(in_proj, x0, xc),  # z
                    _rows(in_proj, inter + x0, xc),  # x
                    _rows(in_proj, 2 * inter + b0, bc),  # B
                    _rows(in_proj, 2 * inter + gn + b0, bc),  # C
                    _rows(in_proj, 2 * inter + 2 * gn + heads.first, heads.count),  # dt
                )
            )
            conv_w = tensors[m + "conv1d.weight"][:, 0, :]
            out[m + "conv1d.weight"] = torch.cat(
                (_rows(conv_w, x0, xc), _rows(conv_w, inter + b0, bc), _rows(conv_w, inter + gn + b0, bc))
            )
            bias = tensors.get(m + "conv1d.bias")
            if bias is not None:
                out[m + "conv1d.bias"] = torch.cat(
                    (_rows(bias, x0, xc), _rows(bias, inter + b0, bc), _rows(bias, inter + gn + b0, bc))
                )
            for leaf in ("dt_bias", "A_log", "D"):
                out[m + leaf] = _rows(tensors[m + leaf], heads.first, heads.count)
            out[m + "norm.weight"] = _rows(tensors[m + "norm.weight"], x0, xc)
            out[m + "out_proj.weight"] = _cols(tensors[m + "out_proj.weight"], x0, xc)
        elif kind == LayerKind.MLP:
            assert mlp_shard is not None
            out[m + "up_proj.weight"] = _rows(tensors[m + "up_proj.weight"], mlp_shard.first, mlp_shard.count)
            out[m + "down_proj.weight"] = _cols(
                tensors[m + "down_proj.weight"], mlp_shard.first, mlp_shard.count
            )
        else:
            raise ConfigError(f"layer {i}: {kind.value} blocks are not supported")
    return RankWeights(rank=rank, tensors=out, mlp_shard=mlp_shard)
