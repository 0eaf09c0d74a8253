"""The reference model: NemotronH (Mamba2 + GQA attention + MLP blocks) run through kvferry's pools and kernels.

One :meth:`Model.step` runs a batch of sequences; each brings the token ids of this step, the position of its
first token, its block table (attention page ids in position order) and its state slot. The same step serves
prefill chunks, decode tokens and speculative verification (``verify=True``, ``k + 1`` tokens).

Cache memory is whatever the caller hands in, one :class:`CacheViews` per tensor-parallel rank (a
:class:`kvferry.pools.arena.CacheArena` or a :class:`DenseCache`). Rules the model keeps:

- ``start == 0`` means a fresh sequence: its slot's conv window, SSM state and ``num_accepted`` are reset
  first, so whatever a previous owner left there never leaks in. With ``start > 0`` the slot is read as is
  (e.g. a prefix-reuse snapshot copied in by the manager).
- Attention reads only positions ``<=`` each query's own; pages past the sequence are never read.
- Speculative decoding: a verify step does not advance the recurrent state. The slot keeps the state as of the
  last committed token; the replay buffer gets the step's raw per-token inputs (pre-conv ``[x|B|C]`` and raw
  ``dt``). :meth:`Model.accept` records how many of those tokens were accepted in ``num_accepted[slot]``;
  the next step of that slot first replays them onto the slot, then runs. The real recurrent state of a
  request is therefore ``slot + replay buffer + num_accepted``, and all three travel together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import torch
import torch.nn.functional as F
from attrs import define, frozen

from kvferry.errors import ConfigError
from kvferry.kernels.norms import rms_norm
from kvferry.model.attention import attention_step
from kvferry.model.batch import Group as _Group
from kvferry.model.batch import plan_groups as _plan_groups
from kvferry.model.decode_graph import is_decode_row
from kvferry.model.mamba2 import causal_conv1d, mamba2_replay, ssm_chunk_scan, ssm_step
from kvferry.model.tensor_parallel import RankWeights, all_reduce, shard_weights
from kvferry.model.weights import ModelWeights, NemotronHArgs
from kvferry.pools.spec import DRAFT_LAYER_SHIFT, LayerKind, ModelSpec, RankSpec, dtype_from_name

if TYPE_CHECKING:
    from kvferry.model.decode_batch import DecodeBatch
    from kvferry.model.decode_graph import DecodeGraphs

__all__ = [
    "CacheViews",
    "DenseCache",
    "Model",
    "RowViews",
    "SequenceInput",
    "StepOutput",
    "rms_norm",
    "validate_batch",
]


class CacheViews(Protocol):
    """Typed views of one rank's cache memory (what :class:`~kvferry.pools.arena.CacheArena` provides)."""

    @property
    def num_accepted(self) -> torch.Tensor: ...

    def kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def conv(self, layer_id: int) -> torch.Tensor: ...

    def ssm(self, layer_id: int) -> torch.Tensor: ...

    def replay(self, layer_id: int) -> torch.Tensor: ...


@define(eq=False)
class DenseCache:
    """A rank's cache as plain tensors of the contract shapes (for tests and tools without a CacheArena).

    Shapes: ``kv`` ``[pages, kv_heads_rank, tokens_per_block, head_dim]`` (drafter layers at
    ``DRAFT_LAYER_SHIFT + i`` with the drafter's), ``latent`` (MLA) ``[pages, tokens_per_block, latent_dim]``,
    ``conv`` ``[slots, conv_dim_rank, kernel - 1]``, ``ssm`` ``[slots, heads_rank, head_dim, state]`` (KDA:
    ``state`` = head_dim), ``replay`` ``[slots, max_replay_tokens, width]`` (Mamba2: ``conv_dim_rank +
    heads_rank``; KDA: ``conv_dim_rank + heads_rank * head_dim + heads_rank``), ``num_accepted`` ``[slots]``
    int64. Everything starts zeroed.
    """

    rank: RankSpec
    num_pages: int
    num_slots: int
    num_draft_pages: int = 0
    max_replay_tokens: int = 0
    device: torch.device = attrs.field(default=torch.device("cpu"), converter=torch.device)
    _tensors: dict[tuple[str, int], torch.Tensor] = attrs.field(init=False, factory=dict)
    num_accepted: torch.Tensor = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        spec = self.rank.model
        dev = self.device
        self.num_accepted = torch.zeros(self.num_slots, dtype=torch.int64, device=dev)
        if spec.attention is not None and self.rank.attention_kv_heads is not None:
            shape = (
                self.num_pages,
                self.rank.attention_kv_heads.count,
                spec.tokens_per_block,
                spec.attention.head_dim,
            )
            dtype = dtype_from_name(spec.attention.dtype)
            for layer in spec.attention_layer_ids:
                self._tensors["k", layer] = torch.zeros(shape, dtype=dtype, device=dev)
                self._tensors["v", layer] = torch.zeros(shape, dtype=dtype, device=dev)
        if spec.mla is not None:
            latent = (self.num_pages, spec.tokens_per_block, spec.mla.latent_dim)
            for layer in spec.attention_layer_ids:
                self._tensors["latent", layer] = torch.zeros(
                    latent, dtype=dtype_from_name(spec.mla.dtype), device=dev
                )
        if spec.drafter is not None and self.rank.draft_kv_heads is not None and self.num_draft_pages:
            d = spec.drafter
            shape = (self.num_draft_pages, self.rank.draft_kv_heads.count, d.tokens_per_block, d.head_dim)
            for layer in d.global_layer_ids:
                self._tensors["k", layer] = torch.zeros(shape, dtype=dtype_from_name(d.dtype), device=dev)
                self._tensors["v", layer] = torch.zeros(shape, dtype=dtype_from_name(d.dtype), device=dev)
        m, heads = spec.mamba2, self.rank.mamba2_heads
        if m is not None and heads is not None:
            conv_dim = sum(self.rank.mamba2_conv_sections)
            for layer in spec.layer_ids(LayerKind.MAMBA2):
                self._tensors["conv", layer] = torch.zeros(
                    self.num_slots,
                    conv_dim,
                    m.conv_kernel - 1,
                    dtype=dtype_from_name(m.conv_dtype),
                    device=dev,
                )
                self._tensors["ssm", layer] = torch.zeros(
                    self.num_slots,
                    heads.count,
                    m.head_dim,
                    m.state_size,
                    dtype=dtype_from_name(m.ssm_dtype),
                    device=dev,
                )
                self._tensors["replay", layer] = torch.zeros(
                    self.num_slots,
                    self.max_replay_tokens,
                    conv_dim + heads.count,
                    dtype=dtype_from_name(m.ssm_dtype),
                    device=dev,
                )
        kda, kda_heads = spec.kda, self.rank.kda_heads
        if kda is not None and kda_heads is not None:
            conv_dim = sum(self.rank.kda_conv_sections)
            width = conv_dim + kda_heads.count * kda.head_dim + kda_heads.count
            for layer in spec.layer_ids(LayerKind.KDA):
                self._tensors["conv", layer] = torch.zeros(
                    self.num_slots,
                    conv_dim,
                    kda.conv_kernel - 1,
                    dtype=dtype_from_name(kda.conv_dtype),
                    device=dev,
                )
                self._tensors["ssm", layer] = torch.zeros(
                    self.num_slots,
                    kda_heads.count,
                    kda.head_dim,
                    kda.head_dim,
                    dtype=dtype_from_name(kda.ssm_dtype),
                    device=dev,
                )
                self._tensors["replay", layer] = torch.zeros(
                    self.num_slots,
                    self.max_replay_tokens,
                    width,
                    dtype=dtype_from_name(kda.conv_dtype),
                    device=dev,
                )

    def __repr__(self) -> str:
        return (
            f"<DenseCache rank {self.rank.rank}/{self.rank.tp_size} pages={self.num_pages} "
            f"slots={self.num_slots} draft_pages={self.num_draft_pages} replay={self.max_replay_tokens}>"
        )

    def _get(self, role: str, layer_id: int) -> torch.Tensor:
        try:
            return self._tensors[role, layer_id]
        except KeyError:
            raise ConfigError(f"layer {layer_id} has no {role} buffer") from None

    def kv(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._get("k", layer_id), self._get("v", layer_id)

    def latent(self, layer_id: int) -> torch.Tensor:
        return self._get("latent", layer_id)

    def conv(self, layer_id: int) -> torch.Tensor:
        return self._get("conv", layer_id)

    def ssm(self, layer_id: int) -> torch.Tensor:
        return self._get("ssm", layer_id)

    def replay(self, layer_id: int) -> torch.Tensor:
        return self._get("replay", layer_id)

    def fill_garbage(self, seed: int = 0) -> None:
        """Overwrite every buffer (and ``num_accepted``) with seeded garbage, NaN and inf included (tests)."""
        gen = torch.Generator().manual_seed(seed)
        for t in self._tensors.values():
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float64) * 1e3
            noise.view(-1)[:: max(1, noise.numel() // 7)] = float("nan")
            noise.view(-1)[1 :: max(1, noise.numel() // 5)] = float("inf")
            t.copy_(noise.to(t.dtype))
        self.num_accepted.copy_(torch.randint(-3, 1000, self.num_accepted.shape, generator=gen))


def _int_tuple(values: Iterable[int]) -> tuple[int, ...]:
    # a typed converter: with ``converter=tuple`` type checkers see ``__init__`` take ``Iterable[_T_co]``
    # and refuse every list of ints a caller passes
    return tuple(values)


@frozen
class SequenceInput:
    """One sequence's share of a model step.

    :param token_ids: the tokens of this step (>= 1), at positions ``start, start + 1, ...``.
    :param start: position of the first token = tokens already in the cache (0: a fresh sequence).
    :param block_table: attention page ids in position order covering at least ``start + len(token_ids)``.
    :param slot: the sequence's state slot (distinct within a batch).
    :param verify: a speculative verify step (``k + 1`` tokens): the recurrent state is not advanced, the
        step's inputs go to the replay buffer; call :meth:`Model.accept` with the outcome.
    :param all_logits: logits for every token (verify) instead of only the last (prefill/decode).
    """

    token_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    start: int
    block_table: tuple[int, ...] = attrs.field(converter=_int_tuple)
    slot: int
    verify: bool = False
    all_logits: bool = False


class RowViews(Sequence[torch.Tensor]):
    """Row ``i`` of a ``[n, ...]`` tensor as a ``[1, ...]`` view, made when asked for (a step of hundreds of
    one-token rows hands its outputs over as one tensor, :attr:`rows`, without a view per row)."""

    __slots__ = ("rows",)

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return tuple(self.rows[i : i + 1] for i in range(*index.indices(len(self))))
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        index %= len(self)
        return self.rows[index : index + 1]

    def __repr__(self) -> str:
        return f"<RowViews {tuple(self.rows.shape)}>"


@frozen
class StepOutput:
    """Per sequence, in batch order: ``logits`` ``[1 or n, vocab]`` and ``hidden`` ``[n, hidden_size]``.

    ``hidden`` is the residual stream after the last block, before the final norm (the drafter's input). The
    decode path gives both as :class:`RowViews` of one tensor each (one row per sequence).
    """

    logits: Sequence[torch.Tensor]
    hidden: Sequence[torch.Tensor]


@define(eq=False)
class _Rank:
    weights: RankWeights
    cache: CacheViews


@define(eq=False)
class Model:
    """A NemotronH model over ``tp`` simulated ranks, each with its weight shard and its own cache.

    Build with :meth:`build`. Not thread-safe; one step at a time. Statistics in :meth:`statistics`.
    """

    weights: ModelWeights
    spec: ModelSpec
    _ranks: list[_Rank]
    device: torch.device
    _steps: int = 0
    _tokens: int = 0
    _verify_tokens: int = 0
    _replayed_tokens: int = 0
    _decode: DecodeGraphs | None = None

    @classmethod
    def build(cls, weights: ModelWeights, spec: ModelSpec, caches: Sequence[CacheViews]) -> Model:
        """A model over ``len(caches)`` tensor-parallel ranks (cache ``r`` belongs to rank ``r``).

        :param spec: cache shapes (``weights.args.model_spec(...)`` or a preset whose shapes match).
        :raises ~kvferry.errors.ConfigError: when the spec, the weights and the caches' shapes disagree.
        """
        args = weights.args
        if not isinstance(args, NemotronHArgs):
            raise ConfigError(f"Model runs NemotronH weights, not {type(args).__name__} (see build_model)")
        if spec.layer_kinds != args.layer_kinds or spec.hidden_size != args.hidden_size:
            raise ConfigError("spec layer kinds / hidden size differ from the weights' config")
        if spec.vocab_size != args.vocab_size:
            raise ConfigError("spec vocab size differs from the weights' config")
        if not caches:
            raise ConfigError("a model needs at least one rank's cache")
        tp = len(caches)
        ranks = []
        for r, cache in enumerate(caches):
            rank_spec = spec.shard(tp, r)
            shard = shard_weights(
                weights.tensors,
                rank_spec,
                layer_kinds=args.layer_kinds,
                head_dim=args.head_dim,
                mlp_intermediate=args.intermediate_size,
            )
            _check_cache(rank_spec, cache)
            ranks.append(_Rank(shard, cache))
        device = weights.device
        return cls(weights=weights, spec=spec, ranks=ranks, device=device)

    def rebind(self, caches: Sequence[CacheViews]) -> None:
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
        if self._decode is not None:
            self._decode.reset()  # its graphs hold the old caches

    def __repr__(self) -> str:
        return (
            f"<Model {self.spec.name} tp={self.tp_size} {self.weights.dtype} layers={self.spec.num_layers} "
            f"steps={self._steps} tokens={self._tokens}>"
        )

    @property
    def args(self) -> NemotronHArgs:
        args = self.weights.args
        assert isinstance(args, NemotronHArgs)  # build refuses others
        return args

    @property
    def tp_size(self) -> int:
        return len(self._ranks)

    @property
    def caches(self) -> tuple[CacheViews, ...]:
        return tuple(r.cache for r in self._ranks)

    @property
    def rank_weights(self) -> tuple[RankWeights, ...]:
        return tuple(r.weights for r in self._ranks)

    @property
    def num_pages(self) -> int:
        return _num_pages(self._ranks[0].cache, self.spec)

    @property
    def num_slots(self) -> int:
        return int(self._ranks[0].cache.num_accepted.shape[0])

    @property
    def max_replay_tokens(self) -> int:
        mamba = self.spec.layer_ids(LayerKind.MAMBA2)
        return int(self._ranks[0].cache.replay(mamba[0]).shape[1]) if mamba else 0

    def statistics(self) -> dict[str, Any]:
        return {
            "steps": self._steps,
            "tokens": self._tokens,
            "verify_tokens": self._verify_tokens,
            "replayed_tokens": self._replayed_tokens,
            "tp_size": self.tp_size,
            "decode_graphs": self._decode.statistics() if self._decode is not None else None,
        }

    # --- validation ------------------------------------------------------------------------------------------

    def _validate(self, batch: Sequence[SequenceInput], *, check_replay: bool = True) -> None:
        validate_batch(
            batch,
            self.spec,
            num_pages=self.num_pages,
            num_slots=self.num_slots,
            max_replay_tokens=self.max_replay_tokens,
            num_accepted=self._ranks[0].cache.num_accepted if self.spec.layer_ids(LayerKind.MAMBA2) else None,
            check_replay=check_replay,
        )

    # --- the step --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, batch: Sequence[SequenceInput]) -> StepOutput:
        """Run one step for a batch of sequences; write their K/V and advance (or stage) their state.

        :raises ~kvferry.errors.ConfigError: on a bad input, before anything is written.
        An exception from inside the arithmetic (none expected) may leave this step's K/V positions and the
        named slots partly written; slots of other sequences are never touched.
        """
        decode = self._decode
        rows = [i for i, s in enumerate(batch) if is_decode_row(s)] if decode is not None else []
        # the decode path masks replay by the counts on the device: only the rest needs them read and checked
        self._validate(batch, check_replay=len(rows) < len(batch))
        if decode is None or not rows or len(rows) > decode.buckets[-1]:
            out = self._step_eager(batch)
        elif len(rows) == len(batch):
            out = decode.run(batch)
        else:
            # one step, two launches over disjoint slots and pages: the decode rows, then the rest
            fast = decode.run([batch[i] for i in rows])
            rest_index = [i for i in range(len(batch)) if i not in set(rows)]
            slow = self._step_eager([batch[i] for i in rest_index])
            logits: list[torch.Tensor] = [torch.empty(0)] * len(batch)
            hidden: list[torch.Tensor] = [torch.empty(0)] * len(batch)
            for index, part in ((rows, fast), (rest_index, slow)):
                for i, row_logits, row_hidden in zip(index, part.logits, part.hidden, strict=True):
                    logits[i], hidden[i] = row_logits, row_hidden
            out = StepOutput(logits=tuple(logits), hidden=tuple(hidden))
        self._steps += 1
        self._tokens += sum(len(s.token_ids) for s in batch)
        self._verify_tokens += sum(len(s.token_ids) for s in batch if s.verify)
        return out

    @torch.no_grad()
    def step_decode(
        self,
        rows: DecodeBatch,
        keys: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        slot_of: Callable[[int], int],
    ) -> torch.Tensor:
        """One step of decode rows kept by the caller in ``rows`` (:class:`~kvferry.model.decode_batch.DecodeBatch`,
        see :meth:`DecodeBatch.step <kvferry.model.decode_batch.DecodeBatch.step>`): the same as :meth:`step` over
        ``SequenceInput((tokens[i],), positions[i], tables[i], slot_of(keys[i]))``, checked only where a row is
        new or its table grew. Logits ``[n, vocab]``, valid until the next step.

        :raises ~kvferry.errors.ConfigError: on a bad input, before anything is written.
        """
        logits = rows.step(keys, tokens, positions, tables, slot_of)
        self._steps += 1
        self._tokens += len(keys)
        return logits

    def enable_decode_graphs(
        self, max_batch: int, *, capture: bool = True, use_triton: bool | None = None
    ) -> None:
        """Run pure decode rows through :class:`~kvferry.model.decode_graph.DecodeGraphs` from the next step:
        fused kernels, captured as CUDA graphs per batch bucket on CUDA (``capture``), eager elsewhere.
        Rows of a step that are not decode rows (prefill chunks, verify steps) run the general step.
        ``use_triton`` None: the Triton kernels where they run (CUDA), else their torch forms."""
        from kvferry.model.decode_graph import DecodeGraphs

        self._decode = DecodeGraphs(self, max_batch, capture, use_triton)

    @property
    def decode_graphs(self) -> DecodeGraphs | None:
        """The decode path, when enabled."""
        return self._decode

    def _step_eager(self, batch: Sequence[SequenceInput]) -> StepOutput:
        dev = self.device
        groups = _plan_groups(
            [(len(s.token_ids), s.start, s.block_table, s.slot, s.verify) for s in batch], dev
        )
        tokens = torch.tensor([t for s in batch for t in s.token_ids], dtype=torch.int64, device=dev)
        mamba_layers = self.spec.layer_ids(LayerKind.MAMBA2)
        fresh = torch.tensor([s.slot for s in batch if s.start == 0], dtype=torch.int64, device=dev)
        resumed = torch.tensor([s.slot for s in batch if s.start > 0], dtype=torch.int64, device=dev)
        replay_counts = torch.zeros(0, dtype=torch.int64, device=dev)
        if mamba_layers:
            for rank in self._ranks:
                for layer in mamba_layers:
                    rank.cache.conv(layer)[fresh] = 0
                    rank.cache.ssm(layer)[fresh] = 0
                rank.cache.num_accepted[fresh] = 0
            replay_counts = self._ranks[0].cache.num_accepted[resumed].clone()

        eps = self.args.layer_norm_epsilon
        x = self.weights.embeddings[tokens]
        for layer, kind in enumerate(self.spec.layer_kinds):
            h = rms_norm(x, self.weights[f"model.layers.{layer}.norm.weight"], eps)
            if kind == LayerKind.ATTENTION:
                out = all_reduce([self._attention(r, layer, h, groups) for r in self._ranks])
            elif kind == LayerKind.MAMBA2:
                out = self._mamba(layer, h, groups, resumed, replay_counts)
            elif kind == LayerKind.MLP:
                out = all_reduce([self._mlp(r, layer, h) for r in self._ranks])
            else:
                raise ConfigError(f"layer {layer}: {kind.value} is not supported")
            x = x + out
        if mamba_layers:
            for rank in self._ranks:
                rank.cache.num_accepted[resumed] = 0

        hidden, logits = [], []
        offset = 0
        norm_f = self.weights.final_norm
        for s in batch:
            n = len(s.token_ids)
            rows = x[offset : offset + n]
            hidden.append(rows)
            wanted = rows if s.all_logits else rows[-1:]
            logits.append(rms_norm(wanted, norm_f, eps) @ self.weights.lm_head.T)
            offset += n
        self._replayed_tokens += int(replay_counts.sum()) if replay_counts.numel() else 0
        return StepOutput(logits=tuple(logits), hidden=tuple(hidden))

    def accept(self, slot: int, num_tokens: int) -> None:
        """Record the outcome of ``slot``'s last verify step: its first ``num_tokens`` tokens are accepted.

        ``num_tokens`` counts the verify step's first token (the one already committed before drafting), so
        it is ``1 + accepted drafts``, in ``[1, k + 1]``; 0 discards the step. The next step of the slot
        replays them. Writes ``num_accepted[slot]`` on every rank; nothing else.
        """
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"slot {slot} outside [0, {self.num_slots})")
        if not 0 <= num_tokens <= self.max_replay_tokens:
            raise ConfigError(f"num_tokens {num_tokens} outside [0, {self.max_replay_tokens}]")
        for rank in self._ranks:
            rank.cache.num_accepted[slot] = num_tokens

    # --- blocks ----------------------------------------------------------------------------------------------

    def _attention(self, rank: _Rank, layer: int, h: torch.Tensor, groups: list[_Group]) -> torch.Tensor:
        key_cache, value_cache = rank.cache.kv(layer)
        return _attention_block(
            rank.weights.tensors, f"model.layers.{layer}.mixer.", h, key_cache, value_cache, groups,
            self.args.head_dim,
        )  # fmt: skip

    def mlp(self, rank: int, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Rank ``rank``'s share of MLP block ``layer`` for the rows ``h`` (summed over ranks by the caller)."""
        return self._mlp(self._ranks[rank], layer, h)

    def _mlp(self, rank: _Rank, layer: int, h: torch.Tensor) -> torch.Tensor:
        m = f"model.layers.{layer}.mixer."
        return (
            F.relu(h @ rank.weights[m + "up_proj.weight"].T).pow(2) @ rank.weights[m + "down_proj.weight"].T
        )

    def _mamba(
        self,
        layer: int,
        h: torch.Tensor,
        groups: list[_Group],
        resumed: torch.Tensor,
        replay_counts: torch.Tensor,
    ) -> torch.Tensor:
        args = self.args
        mamba = self.spec.mamba2
        assert mamba is not None
        m = f"model.layers.{layer}.mixer."
        p, n_state = mamba.head_dim, mamba.state_size
        mixed = []
        for rank in self._ranks:
            w, cache = rank.weights, rank.cache
            heads = rank.weights.rank.mamba2_heads
            assert heads is not None
            x_dim, bc_dim, _ = rank.weights.rank.mamba2_conv_sections
            conv_dim = x_dim + 2 * bc_dim
            conv_w, conv_b = w[m + "conv1d.weight"], w.get(m + "conv1d.bias")
            A = -torch.exp(w[m + "A_log"])
            D, dt_bias = w[m + "D"], w[m + "dt_bias"]
            conv_states, ssm_states = cache.conv(layer), cache.ssm(layer)
            if resumed.numel():
                mamba2_replay(
                    conv_states,
                    ssm_states,
                    cache.replay(layer),
                    resumed,
                    replay_counts,
                    conv_w,
                    conv_b,
                    A,
                    D,
                    dt_bias,
                    dt_min=args.time_step_min,
                )
            proj = h @ w[m + "in_proj.weight"].T
            z, xbc, dt = torch.split(proj, [x_dim, conv_dim, heads.count], dim=-1)
            y = torch.empty_like(z)
            for g in groups:
                b, n = g.rows.shape
                raw = xbc[g.rows]  # [b, n, conv_dim]
                raw_dt = dt[g.rows]
                commit = not g.verify
                if g.verify:
                    cache.replay(layer)[g.slots, :n] = torch.cat((raw, raw_dt), dim=-1).to(
                        cache.replay(layer).dtype
                    )
                conv = causal_conv1d(raw, conv_states, g.slots, conv_w, conv_b, commit=commit)
                xs, Bs, Cs = torch.split(conv, [x_dim, bc_dim, bc_dim], dim=-1)
                xs = xs.reshape(b, n, heads.count, p)
                Bs = Bs.reshape(b, n, -1, n_state)
                Cs = Cs.reshape(b, n, -1, n_state)
                if n > 1 and commit:
                    ys = ssm_chunk_scan(
                        xs, raw_dt, A, Bs, Cs, D, dt_bias, ssm_states, g.slots,
                        dt_min=args.time_step_min, chunk_size=args.chunk_size,
                    )  # fmt: skip
                else:
                    ys = ssm_step(
                        xs, raw_dt, A, Bs, Cs, D, dt_bias, ssm_states, g.slots,
                        dt_min=args.time_step_min, commit=commit,
                    )  # fmt: skip
                y[g.rows.reshape(-1)] = ys.reshape(b * n, -1)
            mixed.append((y, z))
        return self.mamba_out(layer, mixed)

    def mamba_out(self, layer: int, mixed: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """A Mamba2 block's output from each rank's scan output ``y`` and gate input ``z`` (``[rows, x_dim]``):
        gated RMSNorm over groups of channels (a group may span ranks), then ``out_proj``, summed over ranks.
        Allocates and runs only on the device (a decode graph holds it)."""
        mamba = self.spec.mamba2
        assert mamba is not None
        m = f"model.layers.{layer}.mixer."
        group_size = mamba.intermediate_size // mamba.num_groups
        gated, norm_groups = [], []
        for rank, (y, z) in zip(self._ranks, mixed, strict=True):
            heads = rank.weights.rank.mamba2_heads
            assert heads is not None
            gate = y * F.silu(z)
            first_channel = heads.first * mamba.head_dim
            group_of = (torch.arange(y.shape[1], device=y.device) + first_channel) // group_size
            sums = torch.zeros(y.shape[0], mamba.num_groups, dtype=y.dtype, device=y.device)
            sums.index_add_(1, group_of, gate.pow(2))
            gated.append((gate, group_of))
            norm_groups.append(sums)
        totals = all_reduce(norm_groups)
        partial = []
        for rank, (gate, group_of) in zip(self._ranks, gated, strict=True):
            w = rank.weights
            variance = totals[:, group_of] / group_size
            normed = w[m + "norm.weight"] * (gate * torch.rsqrt(variance + self.args.layer_norm_epsilon))
            partial.append(normed @ w[m + "out_proj.weight"].T)
        return all_reduce(partial)


def _attention_block(
    w: Mapping[str, torch.Tensor],
    prefix: str,
    h: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    groups: list[_Group],
    head_dim: int,
) -> torch.Tensor:
    # One rank's share of a GQA block: its heads' q/k/v, paged attention per group, its o_proj columns.
    d = head_dim
    q = h @ w[prefix + "q_proj.weight"].T
    k = h @ w[prefix + "k_proj.weight"].T
    v = h @ w[prefix + "v_proj.weight"].T
    out = torch.empty_like(q)
    for g in groups:
        b, n = g.rows.shape
        attn = attention_step(
            q[g.rows].reshape(b, n, -1, d),
            k[g.rows].reshape(b, n, -1, d),
            v[g.rows].reshape(b, n, -1, d),
            key_cache,
            value_cache,
            g.block_tables,
            g.positions,
            d**-0.5,
        )
        out[g.rows.reshape(-1)] = attn.reshape(b * n, -1)
    return out @ w[prefix + "o_proj.weight"].T


def _num_pages(cache: CacheViews, spec: ModelSpec) -> int:
    layers = spec.attention_layer_ids
    return int(cache.kv(layers[0])[0].shape[0]) if layers else 0


def _check_cache(rank: RankSpec, cache: CacheViews) -> None:
    spec = rank.model
    if spec.attention is not None and rank.attention_kv_heads is not None:
        for layer in spec.attention_layer_ids:
            k, v = cache.kv(layer)
            want = (rank.attention_kv_heads.count, spec.tokens_per_block, spec.attention.head_dim)
            if tuple(k.shape[1:]) != want or k.shape != v.shape:
                raise ConfigError(f"layer {layer}: K/V shape {tuple(k.shape)} does not match {want}")
    m, heads = spec.mamba2, rank.mamba2_heads
    if m is not None and heads is not None:
        conv_dim = sum(rank.mamba2_conv_sections)
        for layer in spec.layer_ids(LayerKind.MAMBA2):
            if tuple(cache.conv(layer).shape[1:]) != (conv_dim, m.conv_kernel - 1):
                raise ConfigError(
                    f"layer {layer}: conv shape {tuple(cache.conv(layer).shape)} is not per contract"
                )
            if tuple(cache.ssm(layer).shape[1:]) != (heads.count, m.head_dim, m.state_size):
                raise ConfigError(
                    f"layer {layer}: ssm shape {tuple(cache.ssm(layer).shape)} is not per contract"
                )
            if cache.replay(layer).shape[2] != conv_dim + heads.count:
                raise ConfigError(
                    f"layer {layer}: replay width {cache.replay(layer).shape[2]} is not per contract"
                )
    if spec.drafter is not None and rank.draft_kv_heads is not None:
        for layer in spec.drafter.global_layer_ids:
            try:
                k, _ = cache.kv(layer)
            except ConfigError:
                continue  # a cache without draft pages: the drafter cannot run, the target can
            want = (rank.draft_kv_heads.count, spec.drafter.tokens_per_block, spec.drafter.head_dim)
            if tuple(k.shape[1:]) != want:
                raise ConfigError(
                    f"draft layer {layer - DRAFT_LAYER_SHIFT}: K/V shape {tuple(k.shape)} vs {want}"
                )


def validate_batch(
    batch: Sequence[SequenceInput],
    spec: ModelSpec,
    *,
    num_pages: int,
    num_slots: int,
    max_replay_tokens: int,
    num_accepted: torch.Tensor | None,
    check_replay: bool = True,
) -> None:
    """Refuse a bad batch before anything is written (either family's model).

    :param num_accepted: rank 0's ``num_accepted`` when the model has recurrent layers (None: it has none, and
        slots are not checked); with ``check_replay`` every resumed slot's count must lie in
        ``[0, max_replay_tokens]``.
    :raises ~kvferry.errors.ConfigError: the first problem found.
    """
    if not batch:
        raise ConfigError("empty batch")
    tpb = spec.tokens_per_block
    has_attention = bool(spec.attention_layer_ids)
    has_state = num_accepted is not None
    vocab = spec.vocab_size
    slots = [s.slot for s in batch]
    # slots hold recurrent state: a model without any (MLA / attention only) ignores them
    if has_state and len(set(slots)) != len(slots):
        raise ConfigError(f"a batch names the same slot twice: {slots}")
    for s in batch:
        n = len(s.token_ids)
        if n == 0:
            raise ConfigError("a sequence step needs at least one token")
        if s.start < 0:
            raise ConfigError(f"negative start {s.start}")
        # min/max run in C: a batch of hundreds of rows is checked in well under a millisecond
        if min(s.token_ids) < 0 or max(s.token_ids) >= vocab:
            raise ConfigError(f"token ids outside the vocabulary [0, {vocab})")
        if has_state and not 0 <= s.slot < num_slots:
            raise ConfigError(f"slot {s.slot} outside [0, {num_slots})")
        if has_attention:
            needed = -(-(s.start + n) // tpb)
            if len(s.block_table) < needed:
                raise ConfigError(
                    f"block table of {len(s.block_table)} blocks cannot hold {s.start + n} tokens"
                )
            pages = s.block_table[:needed]
            if pages and (min(pages) < 0 or max(pages) >= num_pages):
                raise ConfigError(f"page ids outside [0, {num_pages})")
        if s.verify and has_state and n > max_replay_tokens:
            raise ConfigError(f"verify of {n} tokens exceeds max_replay_tokens {max_replay_tokens}")
    resumed = [s.slot for s in batch if s.start > 0]
    if num_accepted is not None and resumed and check_replay:
        # one gather (one device sync) for the whole batch
        pending = num_accepted[torch.tensor(resumed, device=num_accepted.device)].tolist()
        for slot, count in zip(resumed, pending, strict=True):
            if not 0 <= count <= max_replay_tokens:
                raise ConfigError(f"slot {slot} has num_accepted {count} outside [0, {max_replay_tokens}]")
