"""An Eagle-style drafter: attention layer(s) with their own paged KV, reading the target's hidden states.

Drafter position ``p`` reads ``fc([target hidden at p ; embedding of the token at p + 1])`` and predicts the
token at ``p + 2``: ``x = fc(...)``, then per layer ``x = x + attention(norm(x))`` over the drafter's own pages
(its own ``tokens_per_block``; layer ``i`` lives at global id ``DRAFT_LAYER_SHIFT + i`` of each rank's
cache), then ``logits = lm_head(norm_f(x))`` with the target's embedding and LM head. To draft further the
drafter feeds its own ``x`` back in place of the target's hidden state.

Draft KV is written for every position the drafter reads: the positions of the target's last step (catch-up)
and the speculative ones. Speculative positions are overwritten by the next catch-up, so rejected drafts
leave nothing behind that a later step reads. The default weights (:meth:`DrafterWeights.derived`) need
the draft KV of the whole context: without it (a generation engine that did not receive the prompt's draft
KV) fewer drafts are accepted, the tokens stay the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import torch
from attrs import define, frozen

from kvferry.errors import ConfigError
from kvferry.model.batch import Group as _Group
from kvferry.model.batch import plan_groups as _plan_groups
from kvferry.model.family import PagedModel, build_model
from kvferry.model.nemotron_h import (
    CacheViews,
    DenseCache,
    SequenceInput,
    _attention_block,
    _int_tuple,
    rms_norm,
)
from kvferry.model.tensor_parallel import all_reduce, shard_attention
from kvferry.model.weights import ModelWeights
from kvferry.pools.spec import DrafterSpec, ModelSpec, dtype_name

__all__ = ["DraftInput", "Drafter", "DrafterWeights", "Proposal"]

#: The default initialisation's mix of the target hidden state and the next token's embedding: through the
#: target's LM head this guesses "what the target says after this token" (the tests check that its drafts are
#: accepted often with the seeded targets).
DEFAULT_HIDDEN_MIX = 0.1
DEFAULT_EMBED_MIX = 1.0
#: How much of the target hidden states' common component (their projection on the mean hidden direction) the
#: default drafter's features carry along its seeded bias direction, for its attention to remove again.
DEFAULT_CONTEXT_GAIN = 2.0
#: Random sequences x tokens of the target run once by :meth:`DrafterWeights.derived` to find that direction.
_PROBE_SEQUENCES, _PROBE_TOKENS = 8, 48
#: Statistics from the probe are rounded to this many fractional bits, so that two processes that sum in a
#: different order (thread counts, kernels) still derive bit-identical drafters.
_PROBE_BITS = 16


def _expected_shapes(spec: DrafterSpec, hidden: int) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"fc.weight": (hidden, 2 * hidden), "norm_f.weight": (hidden,)}
    q, kv, d = spec.num_query_heads, spec.num_kv_heads, spec.head_dim
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes[p + "norm.weight"] = (hidden,)
        shapes[p + "mixer.q_proj.weight"] = (q * d, hidden)
        shapes[p + "mixer.k_proj.weight"] = (kv * d, hidden)
        shapes[p + "mixer.v_proj.weight"] = (kv * d, hidden)
        shapes[p + "mixer.o_proj.weight"] = (hidden, q * d)
    return shapes


@frozen
class DrafterWeights:
    """The drafter's own tensors (``fc``, per layer ``norm`` and ``mixer.{q,k,v,o}_proj``, ``norm_f``)."""

    spec: DrafterSpec
    hidden_size: int
    tensors: Mapping[str, torch.Tensor] = attrs.field(repr=lambda t: f"<{len(t)} tensors>")

    def __attrs_post_init__(self) -> None:
        for name, shape in _expected_shapes(self.spec, self.hidden_size).items():
            if name not in self.tensors:
                raise ConfigError(f"drafter weights are missing {name}")
            if tuple(self.tensors[name].shape) != shape:
                raise ConfigError(
                    f"drafter {name} has shape {tuple(self.tensors[name].shape)}, expected {shape}"
                )

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @classmethod
    def derived(
        cls,
        target: ModelWeights,
        spec: DrafterSpec,
        seed: int = 0,
        *,
        hidden_mix: float = DEFAULT_HIDDEN_MIX,
        embed_mix: float = DEFAULT_EMBED_MIX,
        context_gain: float = DEFAULT_CONTEXT_GAIN,
    ) -> DrafterWeights:
        """An untrained drafter that still guesses well, and whose attention needs the draft KV of the context.

        Features: ``fc`` passes ``embed_mix * embedding + hidden_mix * hidden`` through (through the target's
        LM head: "what the target says after this token", which a seeded target follows often but not always)
        plus ``context_gain * (u . hidden) * nu``: the target hidden state's component along ``u``, the
        direction of the target's mean hidden state (a large, nearly constant share of every hidden state),
        written along ``nu``, the LM head row of a seeded token (left in, it skews the drafts towards that
        token).

        Attention (layer 0) centres the features on the context: zero query and key projections attend
        uniformly to every position of the drafter's own KV, the values hold each position's ``nu``
        component and the output subtracts their average. With the whole context in the draft KV the average
        cancels the common component and leaves the guess above; with draft KV missing (zeros, e.g. a
        generation engine that did not receive the prompt's draft KV) it averages zeros, the component stays
        and the drafts skew towards ``nu``: fewer are accepted, the same way a trained drafter run without its
        context KV degrades. Further layers (if the spec has them) start as no-ops (zero projections).

        ``u`` and the features' typical RMS come from one probe run of the target (``8 x 48`` seeded random
        tokens, on the target's device, in its dtype), rounded so that every process derives bit-identical
        weights. ``norm_f`` is the target's. A pure function of ``target`` and ``seed``.
        """
        h = target.args.hidden_size
        q_heads, kv_heads, d = spec.num_query_heads, spec.num_kv_heads, spec.head_dim
        gen = torch.Generator().manual_seed(seed)
        probe = torch.randint(
            0, target.args.vocab_size, (_PROBE_SEQUENCES, _PROBE_TOKENS), generator=gen, dtype=torch.int64
        )
        skew = int(torch.randint(0, target.args.vocab_size, (1,), generator=gen))
        nu = target.lm_head[skew].to(dtype=torch.float64, device="cpu")
        nu = _rounded(nu / nu.norm())
        hidden = _probe_hidden(target, probe).to(dtype=torch.float64, device="cpu")  # [n, t, h]
        mean = hidden.mean((0, 1))
        u = _rounded(mean / mean.norm())
        eye = torch.eye(h, dtype=torch.float64)
        fc = torch.cat((hidden_mix * eye + context_gain * torch.outer(nu, u), embed_mix * eye), dim=1)
        embeddings = target.embeddings.to(dtype=torch.float64, device="cpu")[probe[:, 1:]]
        features = torch.cat((hidden[:, :-1], embeddings), dim=-1) @ fc.T
        rms = _rounded(features.pow(2).mean(-1).sqrt().mean())
        tensors: dict[str, torch.Tensor] = {
            "fc.weight": fc,
            "norm_f.weight": target.final_norm.to(dtype=torch.float64, device="cpu"),
        }
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            tensors[p + "norm.weight"] = torch.ones(h, dtype=torch.float64)
            tensors[p + "mixer.q_proj.weight"] = torch.zeros(q_heads * d, h, dtype=torch.float64)
            tensors[p + "mixer.k_proj.weight"] = torch.zeros(kv_heads * d, h, dtype=torch.float64)
            v = torch.zeros(kv_heads * d, h, dtype=torch.float64)
            o = torch.zeros(h, q_heads * d, dtype=torch.float64)
            if i == 0:
                # every kv head's first value channel: the normed feature's nu component; every query head
                # gives back (uniform mean of it) * rms along -nu, 1/q_heads each
                v[::d] = nu
                o[:, ::d] = (-float(rms) / q_heads) * nu[:, None]
            tensors[p + "mixer.v_proj.weight"] = v
            tensors[p + "mixer.o_proj.weight"] = o
        device = target.device
        return cls(spec, h, {k: v.to(dtype=target.dtype, device=device) for k, v in tensors.items()})

    @classmethod
    def from_state_dict(
        cls, spec: DrafterSpec, hidden_size: int, state: Mapping[str, torch.Tensor]
    ) -> DrafterWeights:
        """From tensors named as above (extra keys ignored)."""
        wanted = _expected_shapes(spec, hidden_size)
        return cls(spec, hidden_size, {k: v for k, v in state.items() if k in wanted})


def _rounded(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x * 2.0**_PROBE_BITS) / 2.0**_PROBE_BITS


def _probe_hidden(target: ModelWeights, tokens: torch.Tensor) -> torch.Tensor:
    """The target's hidden states ``[n, t, hidden]`` (pre-final-norm) over ``tokens`` ``[n, t]``, one prefill
    on a throw-away dense cache."""
    n, t = tokens.shape
    tpb = 16
    blocks = -(-t // tpb)
    spec = target.args.model_spec(tokens_per_block=tpb, dtype=dtype_name(target.dtype))
    cache = DenseCache(spec.shard(1, 0), num_pages=n * blocks, num_slots=n, device=target.device)
    model = build_model(target, spec, [cache])
    batch = [
        SequenceInput(
            tokens[i].tolist(),  # type: ignore[arg-type,unused-ignore]
            0,
            range(i * blocks, (i + 1) * blocks),  # type: ignore[arg-type,unused-ignore]
            i,
        )
        for i in range(n)
    ]
    with torch.no_grad():
        return torch.stack(list(model.step(batch).hidden))


@frozen
class DraftInput:
    """One sequence's catch-up for the drafter.

    :param hidden: ``[n, hidden]`` target hidden states (``StepOutput.hidden``) of positions ``start ..
        start + n - 1``.
    :param next_tokens: the token at position ``p + 1`` for each of those positions ``p`` (for the last one:
        the token the target just chose).
    :param start: drafter position of ``hidden[0]``.
    :param block_table: draft page ids (drafter ``tokens_per_block``) covering ``start + n - 1 + k`` positions
        when ``k`` tokens are proposed.
    """

    hidden: torch.Tensor
    next_tokens: tuple[int, ...] = attrs.field(converter=_int_tuple)
    start: int
    block_table: tuple[int, ...] = attrs.field(converter=_int_tuple)


@frozen
class Proposal:
    """``k`` greedy draft tokens and the drafter logits ``[k, vocab]`` that chose them."""

    tokens: tuple[int, ...]
    logits: torch.Tensor


@define(eq=False)
class _DraftRank:
    tensors: dict[str, torch.Tensor]
    cache: CacheViews


@define(eq=False)
class Drafter:
    """The drafter of one target :class:`~kvferry.model.family.PagedModel` (either family), over the same ranks
    and caches.

    Build with :meth:`build`. Not thread-safe. A failure inside :meth:`propose` may leave draft KV of the
    positions it was writing; those positions are rewritten by the next catch-up.
    """

    target: PagedModel
    weights: DrafterWeights
    spec: DrafterSpec
    _ranks: list[_DraftRank]
    _proposals: int = 0
    _drafted: int = 0

    @classmethod
    def build(cls, target: PagedModel, weights: DrafterWeights) -> Drafter:
        """A drafter for ``target``; each rank gets its draft-head shard and its cache's draft layers.

        :raises ~kvferry.errors.ConfigError: when the target spec has no drafter, shapes differ, or a cache
            has no draft pages.
        """
        spec: ModelSpec = target.spec
        if spec.drafter is None:
            raise ConfigError("the target spec has no drafter")
        if weights.spec.num_layers != spec.drafter.num_layers or weights.hidden_size != spec.hidden_size:
            raise ConfigError("drafter weights do not match the spec's drafter")
        ranks = []
        for r, cache in enumerate(target.caches):
            rank = spec.shard(target.tp_size, r)
            q, kv = rank.draft_query_heads, rank.draft_kv_heads
            assert q is not None and kv is not None
            tensors = {k: v for k, v in weights.tensors.items() if not k.startswith("layers.")}
            for i in range(spec.drafter.num_layers):
                p = f"layers.{i}."
                tensors[p + "norm.weight"] = weights[p + "norm.weight"]
                tensors.update(shard_attention(weights.tensors, p + "mixer.", q, kv, spec.drafter.head_dim))
            for layer in spec.drafter.global_layer_ids:
                k_cache, _ = cache.kv(layer)
                want = (kv.count, spec.drafter.tokens_per_block, spec.drafter.head_dim)
                if tuple(k_cache.shape[1:]) != want:
                    raise ConfigError(f"draft K/V shape {tuple(k_cache.shape)} does not match {want}")
            ranks.append(_DraftRank(tensors, cache))
        return cls(target=target, weights=weights, spec=spec.drafter, ranks=ranks)

    def rebind(self) -> None:
        """Follow the target's caches after :meth:`Model.rebind <kvferry.model.nemotron_h.Model.rebind>` (the
        draft layers live in the same caches); between steps only.

        :raises ~kvferry.errors.ConfigError: a cache's draft K/V shapes do not fit; nothing changed.
        """
        caches = self.target.caches
        kv = [self.target.spec.shard(self.target.tp_size, r).draft_kv_heads for r in range(len(caches))]
        for cache, heads in zip(caches, kv, strict=True):
            assert heads is not None
            want = (heads.count, self.spec.tokens_per_block, self.spec.head_dim)
            for layer in self.spec.global_layer_ids:
                if tuple(cache.kv(layer)[0].shape[1:]) != want:
                    raise ConfigError(
                        f"draft K/V shape {tuple(cache.kv(layer)[0].shape)} does not match {want}"
                    )
        for rank, cache in zip(self._ranks, caches, strict=True):
            rank.cache = cache

    def __repr__(self) -> str:
        return f"<Drafter layers={self.spec.num_layers} tp={len(self._ranks)} proposals={self._proposals}>"

    @property
    def num_pages(self) -> int:
        return int(self._ranks[0].cache.kv(self.spec.global_layer_ids[0])[0].shape[0])

    def statistics(self) -> dict[str, Any]:
        return {"proposals": self._proposals, "drafted_tokens": self._drafted}

    def _validate(self, inputs: Sequence[DraftInput], k: int) -> None:
        if not inputs:
            raise ConfigError("empty draft batch")
        if k < 1:
            raise ConfigError(f"k must be >= 1, got {k}")
        tpb = self.spec.tokens_per_block
        hidden = self.weights.hidden_size
        vocab = self.target.spec.vocab_size
        for d in inputs:
            n = len(d.next_tokens)
            if n == 0 or tuple(d.hidden.shape) != (n, hidden):
                raise ConfigError(
                    f"hidden {tuple(d.hidden.shape)} does not match {n} next tokens of width {hidden}"
                )
            if d.start < 0:
                raise ConfigError(f"negative start {d.start}")
            if not all(0 <= t < vocab for t in d.next_tokens):
                raise ConfigError("next token ids outside the vocabulary")
            needed = -(-(d.start + n - 1 + k) // tpb)
            if len(d.block_table) < needed:
                raise ConfigError(
                    f"draft block table of {len(d.block_table)} blocks cannot hold {needed} blocks"
                )
            if not all(0 <= p < self.num_pages for p in d.block_table[:needed]):
                raise ConfigError(f"draft page ids outside [0, {self.num_pages})")

    def _forward(self, h_in: torch.Tensor, tokens: torch.Tensor, groups: list[_Group]) -> torch.Tensor:
        # one drafter pass over flat rows; returns the pre-norm x
        w = self.weights
        embeddings = self.target.weights.embeddings[tokens]
        x = torch.cat((h_in, embeddings), dim=-1) @ w["fc.weight"].T
        eps = self.target.weights.args.norm_eps
        for i, layer in enumerate(self.spec.global_layer_ids):
            p = f"layers.{i}."
            h = rms_norm(x, w[p + "norm.weight"], eps)
            parts = []
            for rank in self._ranks:
                k_cache, v_cache = rank.cache.kv(layer)
                parts.append(
                    _attention_block(
                        rank.tensors, p + "mixer.", h, k_cache, v_cache, groups, self.spec.head_dim
                    )
                )
            x = x + all_reduce(parts)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.target.weights.args.norm_eps
        return rms_norm(x, self.weights["norm_f.weight"], eps) @ self.target.weights.lm_head.T

    @torch.no_grad()
    def propose(self, inputs: Sequence[DraftInput], k: int) -> list[Proposal]:
        """Catch up on each sequence's new positions, then draft ``k`` tokens greedily.

        Writes draft KV at positions ``start .. start + n - 2 + k`` of each sequence.
        :raises ~kvferry.errors.ConfigError: on a bad input, before anything is written.
        """
        self._validate(inputs, k)
        dev = self.target.device
        dtype = self.target.weights.dtype
        rows = [(len(d.next_tokens), d.start, d.block_table, i, False) for i, d in enumerate(inputs)]
        groups = _plan_groups(rows, dev)
        tokens = torch.tensor([t for d in inputs for t in d.next_tokens], dtype=torch.int64, device=dev)
        h_in = torch.cat([d.hidden.to(device=dev, dtype=dtype) for d in inputs])
        x = self._forward(h_in, tokens, groups)
        ends = torch.tensor([len(d.next_tokens) for d in inputs], device=dev).cumsum(0) - 1
        last = x[ends]  # [b, hidden]
        drafted: list[list[int]] = [[] for _ in inputs]
        logits: list[list[torch.Tensor]] = [[] for _ in inputs]
        for j in range(k):
            step_logits = self._logits(last)
            choice = step_logits.argmax(-1)
            for i in range(len(inputs)):
                drafted[i].append(int(choice[i]))
                logits[i].append(step_logits[i])
            if j == k - 1:
                break
            step_rows = [
                (1, d.start + len(d.next_tokens) + j, d.block_table, i, False) for i, d in enumerate(inputs)
            ]
            last = self._forward(last, choice, _plan_groups(step_rows, dev))
        self._proposals += len(inputs)
        self._drafted += len(inputs) * k
        return [Proposal(tuple(t), torch.stack(lg)) for t, lg in zip(drafted, logits, strict=True)]
