"""KimiLinear (KDA + MLA + MoE, transformers' ``KimiLinearForCausalLM``) run through kvferry's pools.

The same interface as :class:`~kvferry.model.nemotron_h.Model` and the same rules (see its module docstring):
one :meth:`KimiLinearModel.step` runs a batch of :class:`~kvferry.model.nemotron_h.SequenceInput` (prefill
chunks, decode tokens, verify steps); ``start == 0`` resets the slot's KDA state and ``num_accepted``; a verify
step leaves the KDA state alone and stages its inputs in the replay buffer, which the slot's next step replays
``num_accepted`` tokens of. Each decoder layer is ``x += mixer(input_layernorm(x))`` then
``x += mlp(post_attention_layernorm(x))``:

- mixer: MLA (:mod:`kvferry.model.mla`, the latent per token in the paged group "attention") on
  ``full_attention`` layers, KDA (:func:`kvferry.model.kda.kda_block`, the state group "kda") on
  ``linear_attention`` layers;
- mlp: the routed MoE (:mod:`kvferry.model.moe`) on ``sparse`` layers, the dense SiLU-gated MLP on ``dense``.

Tensor parallelism over simulated ranks: MLA query heads split (the latent replicated), KDA heads split, every
MLP's (and every expert's) intermediate channels split; embedding, norms, router and LM head replicated; each
block's rank outputs are summed by :func:`~kvferry.model.tensor_parallel.all_reduce`. The fused decode path
(CUDA graphs) is NemotronH's only: :meth:`KimiLinearModel.enable_decode_graphs` refuses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from attrs import define

from kvferry.errors import ConfigError
from kvferry.kernels.norms import rms_norm
from kvferry.model.batch import Group, plan_groups
from kvferry.model.kda import kda_block, shard_kda_weights
from kvferry.model.kimi_args import KimiLinearArgs
from kvferry.model.mla import mla_block
from kvferry.model.moe import gated_mlp, moe_block
from kvferry.model.nemotron_h import (
    CacheViews,
    SequenceInput,
    StepOutput,
    validate_batch,
)
from kvferry.model.tensor_parallel import all_reduce
from kvferry.model.weights import ModelWeights
from kvferry.pools.spec import DRAFT_LAYER_SHIFT, HeadShard, LayerKind, ModelSpec, RankSpec, split_heads

if TYPE_CHECKING:
    from kvferry.model.decode_graph import DecodeGraphs

__all__ = ["KimiLinearModel", "LatentCacheViews", "shard_kimi_weights"]


class LatentCacheViews(CacheViews, Protocol):
    """A rank's cache views with MLA latent pages (:class:`~kvferry.pools.arena.CacheArena` has them)."""

    def latent(self, layer_id: int) -> torch.Tensor: ...


#: the forget gate's tensors, under ``self_attn.forget_gate.`` in transformers' modules
_FORGET_GATE = ("f_a_proj.weight", "f_b_proj.weight", "dt_bias", "A_log")


def _rows(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return t[first : first + count].contiguous()


def _cols(t: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return t[..., first : first + count].contiguous()


def _split(total: int, rank: RankSpec, what: str) -> HeadShard:
    shard = split_heads(total, rank.tp_size, rank.rank)
    if shard.is_duplicated:
        raise ConfigError(f"{what} {total} < tp_size {rank.tp_size}")
    return shard


def _shard_mlp(tensors: Mapping[str, torch.Tensor], m: str, shard: HeadShard) -> dict[str, torch.Tensor]:
    return {
        m + "gate_proj.weight": _rows(tensors[m + "gate_proj.weight"], shard.first, shard.count),
        m + "up_proj.weight": _rows(tensors[m + "up_proj.weight"], shard.first, shard.count),
        m + "down_proj.weight": _cols(tensors[m + "down_proj.weight"], shard.first, shard.count),
    }


def shard_kimi_weights(
    tensors: Mapping[str, torch.Tensor], rank: RankSpec, args: KimiLinearArgs
) -> dict[str, torch.Tensor]:
    """Slice a full KimiLinear state dict to one rank's shard (same names, the rank's rows / columns).

    :raises ~kvferry.errors.ConfigError: a head count or intermediate size does not split over the ranks.
    """
    out = {name: t for name, t in tensors.items() if not name.startswith("model.layers.")}
    for i, kind in enumerate(args.layer_kinds):
        p = f"model.layers.{i}."
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + norm] = tensors[p + norm]
        a = p + "self_attn."
        if kind == LayerKind.ATTENTION:
            q = rank.attention_query_heads
            assert q is not None
            if q.is_duplicated:  # a duplicated head's o_proj share would be summed twice
                raise ConfigError(f"MLA num_heads {q.total} < tp_size {rank.tp_size}")
            qk, kv = args.qk_head_dim, args.qk_nope_head_dim + args.v_head_dim
            q_name = "q_proj.weight" if args.q_lora_rank is None else "q_b_proj.weight"
            out[a + q_name] = _rows(tensors[a + q_name], q.first * qk, q.count * qk)
            if args.q_lora_rank is not None:
                for leaf in ("q_a_proj.weight", "q_a_layernorm.weight"):
                    out[a + leaf] = tensors[a + leaf]
            for leaf in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
                out[a + leaf] = tensors[a + leaf]  # the latent: replicated
            out[a + "kv_b_proj.weight"] = _rows(tensors[a + "kv_b_proj.weight"], q.first * kv, q.count * kv)
            v = args.v_head_dim
            out[a + "o_proj.weight"] = _cols(tensors[a + "o_proj.weight"], q.first * v, q.count * v)
        else:
            assert rank.kda_heads is not None
            # the KDA block reads the forget gate's tensors under self_attn (the checkpoint's names); the model
            # keeps transformers' module names (self_attn.forget_gate.*)
            named = {**tensors, **{a + leaf: tensors[a + "forget_gate." + leaf] for leaf in _FORGET_GATE}}
            out.update(shard_kda_weights(named, i, rank.kda_heads, args.linear_head_dim))
        m = p + "mlp."
        if args.moe_layers[i]:
            inter = args.moe_intermediate_size
            experts = _split(inter, rank, "moe_intermediate_size")
            shared = _split(inter * args.n_shared_experts, rank, "shared experts' intermediate size")
            for leaf in ("gate.weight", "gate.e_score_correction_bias"):
                out[m + leaf] = tensors[m + leaf]
            gate_up = tensors[m + "experts.gate_up_proj"]
            if experts.count < inter:  # one rank holds the experts whole: no copy of the largest tensors
                gate_up = torch.cat(
                    (
                        gate_up[:, experts.first : experts.first + experts.count],
                        gate_up[:, inter + experts.first : inter + experts.first + experts.count],
                    ),
                    dim=1,
                )
            out[m + "experts.gate_up_proj"] = gate_up
            out[m + "experts.down_proj"] = _cols(
                tensors[m + "experts.down_proj"], experts.first, experts.count
            )
            out.update(_shard_mlp(tensors, m + "shared_experts.", shared))
        else:
            out.update(_shard_mlp(tensors, m, _split(args.intermediate_size, rank, "intermediate_size")))
    return out


@define(eq=False)
class _Rank:
    tensors: dict[str, torch.Tensor]
    cache: LatentCacheViews


@define(eq=False)
class KimiLinearModel:
    """A KimiLinear model over ``tp`` simulated ranks, each with its weight shard and its own cache.

    Build with :meth:`build`. Not thread-safe; one step at a time. Statistics in :meth:`statistics`.
    """

    weights: ModelWeights
    args: KimiLinearArgs
    spec: ModelSpec
    _ranks: list[_Rank]
    device: torch.device
    _steps: int = 0
    _tokens: int = 0
    _verify_tokens: int = 0
    _replayed_tokens: int = 0

    @classmethod
    def build(
        cls, weights: ModelWeights, spec: ModelSpec, caches: Sequence[LatentCacheViews]
    ) -> KimiLinearModel:
        """A model over ``len(caches)`` tensor-parallel ranks (cache ``r`` belongs to rank ``r``).

        :param spec: cache shapes (``weights.args.model_spec(...)`` or the ``tiny-kimi`` preset).
        :raises ~kvferry.errors.ConfigError: when the spec, the weights and the caches' shapes disagree.
        """
        args = weights.args
        if not isinstance(args, KimiLinearArgs):
            raise ConfigError(f"KimiLinearModel needs KimiLinear weights, not {type(args).__name__}")
        if spec.layer_kinds != args.layer_kinds or spec.hidden_size != args.hidden_size:
            raise ConfigError("spec layer kinds / hidden size differ from the weights' config")
        if spec.vocab_size != args.vocab_size:
            raise ConfigError("spec vocab size differs from the weights' config")
        _check_dims(spec, args)
        if not caches:
            raise ConfigError("a model needs at least one rank's cache")
        tp = len(caches)
        ranks = []
        for r, cache in enumerate(caches):
            rank_spec = spec.shard(tp, r)
            shard = shard_kimi_weights(weights.tensors, rank_spec, args)
            _check_cache(rank_spec, cache)
            ranks.append(_Rank(shard, cache))
        return cls(weights=weights, args=args, spec=spec, ranks=ranks, device=weights.device)

    def rebind(self, caches: Sequence[LatentCacheViews]) -> None:
        """Run over new caches from now on, one per rank (a pool rebalance replaced them); between steps only.

        :raises ~kvferry.errors.ConfigError: another number of ranks, or a cache's shapes do not fit its rank;
            nothing changed.
        """
        if len(caches) != self.tp_size:
            raise ConfigError(f"{len(caches)} caches for {self.tp_size} ranks")
        for r, cache in enumerate(caches):
            _check_cache(self.spec.shard(self.tp_size, r), cache)
        for rank, cache in zip(self._ranks, caches, strict=True):
            rank.cache = cache

    def __repr__(self) -> str:
        return (
            f"<KimiLinearModel {self.spec.name} tp={self.tp_size} {self.weights.dtype} "
            f"layers={self.spec.num_layers} steps={self._steps} tokens={self._tokens}>"
        )

    @property
    def tp_size(self) -> int:
        return len(self._ranks)

    @property
    def caches(self) -> tuple[LatentCacheViews, ...]:
        return tuple(r.cache for r in self._ranks)

    @property
    def rank_tensors(self) -> tuple[Mapping[str, torch.Tensor], ...]:
        """Each rank's weight shard (transformers' names, the rank's rows / columns)."""
        return tuple(r.tensors for r in self._ranks)

    @property
    def num_pages(self) -> int:
        layers = self.spec.attention_layer_ids
        return int(self._ranks[0].cache.latent(layers[0]).shape[0]) if layers else 0

    @property
    def num_slots(self) -> int:
        return int(self._ranks[0].cache.num_accepted.shape[0])

    @property
    def max_replay_tokens(self) -> int:
        kda = self.spec.layer_ids(LayerKind.KDA)
        return int(self._ranks[0].cache.replay(kda[0]).shape[1]) if kda else 0

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """Always None: the fused decode path is NemotronH's."""
        return None

    def enable_decode_graphs(
        self, max_batch: int, *, capture: bool = True, use_triton: bool | None = None
    ) -> None:
        """Refused: the fused decode kernels and CUDA graphs exist for NemotronH only.

        :raises ~kvferry.errors.ConfigError: always; nothing changes.
        """
        raise ConfigError("decode graphs are not available for KimiLinear models (NemotronH only)")

    def statistics(self) -> dict[str, Any]:
        return {
            "steps": self._steps,
            "tokens": self._tokens,
            "verify_tokens": self._verify_tokens,
            "replayed_tokens": self._replayed_tokens,
            "tp_size": self.tp_size,
            "decode_graphs": None,
        }

    # --- the step --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, batch: Sequence[SequenceInput]) -> StepOutput:
        """Run one step for a batch of sequences; write their latents and advance (or stage) their KDA state.

        :raises ~kvferry.errors.ConfigError: on a bad input, before anything is written.
        An exception from inside the arithmetic (none expected) may leave this step's latent positions and the
        named slots partly written; slots of other sequences are never touched.
        """
        kda_layers = self.spec.layer_ids(LayerKind.KDA)
        validate_batch(
            batch,
            self.spec,
            num_pages=self.num_pages,
            num_slots=self.num_slots,
            max_replay_tokens=self.max_replay_tokens,
            num_accepted=self._ranks[0].cache.num_accepted if kda_layers else None,
        )
        dev = self.device
        groups = plan_groups(
            [(len(s.token_ids), s.start, s.block_table, s.slot, s.verify) for s in batch], dev
        )
        tokens = torch.tensor([t for s in batch for t in s.token_ids], dtype=torch.int64, device=dev)
        fresh = torch.tensor([s.slot for s in batch if s.start == 0], dtype=torch.int64, device=dev)
        resumed = torch.tensor([s.slot for s in batch if s.start > 0], dtype=torch.int64, device=dev)
        replay_counts = torch.zeros(0, dtype=torch.int64, device=dev)
        if kda_layers:
            for rank in self._ranks:
                for layer in kda_layers:
                    rank.cache.conv(layer)[fresh] = 0
                    rank.cache.ssm(layer)[fresh] = 0
                rank.cache.num_accepted[fresh] = 0
            replay_counts = self._ranks[0].cache.num_accepted[resumed].clone()

        args, eps = self.args, self.args.rms_norm_eps
        x = self.weights.embeddings[tokens]
        for layer, kind in enumerate(self.spec.layer_kinds):
            p = f"model.layers.{layer}."
            h = rms_norm(x, self.weights[p + "input_layernorm.weight"], eps)
            if kind == LayerKind.ATTENTION:
                x = x + all_reduce(
                    [
                        mla_block(r.tensors, p + "self_attn.", h, r.cache.latent(layer), groups, args)
                        for r in self._ranks
                    ]
                )
            else:
                x = x + all_reduce(
                    [self._kda(r, layer, h, groups, resumed, replay_counts) for r in self._ranks]
                )
            h = rms_norm(x, self.weights[p + "post_attention_layernorm.weight"], eps)
            if args.moe_layers[layer]:
                x = x + all_reduce(
                    [
                        moe_block(
                            r.tensors,
                            p + "mlp.",
                            h,
                            top_k=args.num_experts_per_tok,
                            n_group=args.n_group,
                            topk_group=args.topk_group,
                            norm_topk_prob=args.norm_topk_prob,
                            scaling=args.routed_scaling_factor,
                        )
                        for r in self._ranks
                    ]
                )
            else:
                x = x + all_reduce([gated_mlp(r.tensors, p + "mlp.", h) for r in self._ranks])
        if kda_layers:
            for rank in self._ranks:
                rank.cache.num_accepted[resumed] = 0

        hidden, logits = [], []
        offset = 0
        for s in batch:
            n = len(s.token_ids)
            rows = x[offset : offset + n]
            hidden.append(rows)
            wanted = rows if s.all_logits else rows[-1:]
            logits.append(rms_norm(wanted, self.weights.final_norm, eps) @ self.weights.lm_head.T)
            offset += n
        self._steps += 1
        self._tokens += sum(len(s.token_ids) for s in batch)
        self._verify_tokens += sum(len(s.token_ids) for s in batch if s.verify)
        self._replayed_tokens += int(replay_counts.sum()) if replay_counts.numel() else 0
        return StepOutput(logits=tuple(logits), hidden=tuple(hidden))

    def _kda(
        self,
        rank: _Rank,
        layer: int,
        h: torch.Tensor,
        groups: list[Group],
        resumed: torch.Tensor,
        replay_counts: torch.Tensor,
    ) -> torch.Tensor:
        cache = rank.cache
        return kda_block(
            rank.tensors,
            f"model.layers.{layer}.self_attn.",
            h,
            groups,
            cache.conv(layer),
            cache.ssm(layer),
            cache.replay(layer),
            resumed,
            replay_counts,
            head_dim=self.args.linear_head_dim,
            eps=self.args.rms_norm_eps,
        )

    def accept(self, slot: int, num_tokens: int) -> None:
        """Record the outcome of ``slot``'s last verify step: its first ``num_tokens`` tokens are accepted
        (``1 + accepted drafts``, 0 discards the step); the slot's next step replays them. Writes
        ``num_accepted[slot]`` on every rank; nothing else."""
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"slot {slot} outside [0, {self.num_slots})")
        if not 0 <= num_tokens <= self.max_replay_tokens:
            raise ConfigError(f"num_tokens {num_tokens} outside [0, {self.max_replay_tokens}]")
        for rank in self._ranks:
            rank.cache.num_accepted[slot] = num_tokens


def _check_dims(spec: ModelSpec, args: KimiLinearArgs) -> None:
    mla, kda = spec.mla, spec.kda
    if mla is not None and (
        mla.num_heads,
        mla.kv_lora_rank,
        mla.qk_rope_head_dim,
        mla.qk_nope_head_dim,
        mla.v_head_dim,
    ) != (
        args.num_attention_heads,
        args.kv_lora_rank,
        args.qk_rope_head_dim,
        args.qk_nope_head_dim,
        args.v_head_dim,
    ):
        raise ConfigError(f"spec MLA dims {mla} differ from the weights' config")
    if kda is not None and (kda.num_heads, kda.head_dim, kda.conv_kernel) != (
        args.linear_num_heads,
        args.linear_head_dim,
        args.linear_conv_kernel_dim,
    ):
        raise ConfigError(f"spec KDA dims {kda} differ from the weights' config")
    if LayerKind.ATTENTION in spec.layer_kinds and mla is None:
        raise ConfigError("a KimiLinear spec's attention layers need spec.mla")


def _check_cache(rank: RankSpec, cache: LatentCacheViews) -> None:
    spec = rank.model
    if spec.mla is not None:
        for layer in spec.attention_layer_ids:
            want = (spec.tokens_per_block, spec.mla.latent_dim)
            if tuple(cache.latent(layer).shape[1:]) != want:
                raise ConfigError(f"layer {layer}: latent shape {tuple(cache.latent(layer).shape)} vs {want}")
    kda, heads = spec.kda, rank.kda_heads
    if kda is not None and heads is not None:
        width = heads.count * kda.head_dim
        for layer in spec.layer_ids(LayerKind.KDA):
            if tuple(cache.conv(layer).shape[1:]) != (3 * width, kda.conv_kernel - 1):
                raise ConfigError(
                    f"layer {layer}: conv shape {tuple(cache.conv(layer).shape)} is not per contract"
                )
            if tuple(cache.ssm(layer).shape[1:]) != (heads.count, kda.head_dim, kda.head_dim):
                raise ConfigError(
                    f"layer {layer}: ssm shape {tuple(cache.ssm(layer).shape)} is not per contract"
                )
            if cache.replay(layer).shape[2] != 4 * width + heads.count:
                raise ConfigError(
                    f"layer {layer}: replay width {cache.replay(layer).shape[2]} is not per contract"
                )
    if spec.drafter is not None and rank.draft_kv_heads is not None:
        for layer in spec.drafter.global_layer_ids:
            try:
                k, _ = cache.kv(layer)
            except ConfigError:
                continue  # a cache without draft pages: the drafter cannot run, the target can
            draft = (rank.draft_kv_heads.count, spec.drafter.tokens_per_block, spec.drafter.head_dim)
            if tuple(k.shape[1:]) != draft:
                raise ConfigError(
                    f"draft layer {layer - DRAFT_LAYER_SHIFT}: K/V shape {tuple(k.shape)} vs {draft}"
                )
