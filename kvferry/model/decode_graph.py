"""The decode step as CUDA graphs: one token per sequence, fused kernels, no host work inside the step.

A pure decode batch (every sequence brings one token, continues a cached sequence, and is not a verify step)
runs here instead of the general :meth:`Model.step`. The step reads its inputs from one device buffer, packed per
row as ``[token, position, slot, block table...]``, runs every layer with kernels that read the cache in place
(:mod:`kvferry.kernels.mamba_decode`, :mod:`kvferry.kernels.paged_decode`) and ends in logits and hidden states
of fixed shape. On CUDA it is captured once per batch-size bucket (1, 2, 4, 8, 16, 32, then multiples of 32) and
replayed: the host copies one packed buffer in and the logits out. Elsewhere (the CPU) the same step runs
eagerly, with the torch forms of the kernels, which is how the CPU tests prove the path token for token.

A batch smaller than its bucket is padded with rows of the reserved slot 0 and page 0 at position 0: they
compute garbage there and nowhere else. With speculative decoding the step first replays each slot's
accepted tokens, masked over ``max_replay_tokens`` steps (no host read of the counts).

Captured graphs hold the cache tensors they were captured over: :meth:`DecodeGraphs.reset` drops them (a pool
rebalance does, through :meth:`Model.rebind`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import torch
from attrs import define

from kvferry.errors import ConfigError
from kvferry.kernels.mamba_decode import conv_update, ssm_update, triton_available
from kvferry.kernels.norms import add_rms_norm, gated_group_norm
from kvferry.kernels.paged_decode import paged_decode_attention
from kvferry.model.attention import page_coordinates, write_kv
from kvferry.model.mamba2 import mamba2_replay_steps
from kvferry.model.tensor_parallel import all_reduce
from kvferry.pools.spec import LayerKind

if TYPE_CHECKING:
    from kvferry.model.nemotron_h import Model, SequenceInput, StepOutput

__all__ = ["INITIAL_TABLE_BLOCKS", "DecodeGraphs", "decode_buckets", "is_decode_row"]

#: block-table room of the packed inputs at first (256 pages: 8192 tokens at 32 per page); a longer sequence
#: doubles it (and the graphs are captured again), so the inputs never scale with the pool's size
INITIAL_TABLE_BLOCKS = 256


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a decode graph is captured for: 1, 2, 4, 8, 16, 32, then multiples of 32, up to the
    first that holds ``max_batch`` rows."""
    buckets: list[int] = []
    for size in (1, 2, 4, 8, 16, 32):
        buckets.append(size)
        if size >= max_batch:
            return tuple(buckets)
    while buckets[-1] < max_batch:
        buckets.append(buckets[-1] + 32)
    return tuple(buckets)


def is_decode_row(row: SequenceInput) -> bool:
    """Whether a sequence's share of a step can run on the decode path: one token continuing a cached sequence."""
    return len(row.token_ids) == 1 and row.start > 0 and not row.verify


@define(eq=False)
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    logits: torch.Tensor
    hidden: torch.Tensor


@define(eq=False)
class DecodeGraphs:
    """Pure decode steps of one :class:`Model`, captured as CUDA graphs per batch bucket (eager off CUDA).

    :param max_batch: the most rows one step brings (the engine's ``max_running``).
    :param capture: capture CUDA graphs (CUDA only); False runs the same step eagerly.
    :param use_triton: the Triton kernels (None: where they can run, on CUDA, for float32 / bfloat16 / float16
        models; a float64 model runs their torch forms, since the kernels accumulate in float32); False: their
        torch forms.
    :raises ~kvferry.errors.ConfigError: ``use_triton=True`` for a float64 model on CUDA.
    Not thread-safe; one step at a time, as the model.
    """

    model: Model
    max_batch: int
    capture: bool
    use_triton: bool | None = None
    buckets: tuple[int, ...] = attrs.field(init=False)
    _packed: torch.Tensor = attrs.field(init=False)
    _captured: dict[int, _Captured] = attrs.field(init=False, factory=dict)
    _pool: Any = attrs.field(init=False, default=None)
    _replays: int = attrs.field(init=False, default=0)
    _eager_steps: int = attrs.field(init=False, default=0)
    _rows: int = attrs.field(init=False, default=0)
    _padded_rows: int = attrs.field(init=False, default=0)
    _constants: dict[tuple[str, int, int], torch.Tensor] = attrs.field(init=False, factory=dict)
    _widened: int = attrs.field(init=False, default=0)
    #: recorded after an asynchronous copy of pinned host rows (CUDA)
    _copied: Any = attrs.field(init=False, default=None)
    #: the caches' page and slot counts (read through the arena's views, which costs; refreshed by reset)
    num_pages: int = attrs.field(init=False, default=0)
    num_slots: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        self.buckets = decode_buckets(self.max_batch)
        self.num_pages, self.num_slots = self.model.num_pages, self.model.num_slots
        self._packed = self._inputs(INITIAL_TABLE_BLOCKS)
        self.capture = self.capture and self.model.device.type == "cuda"
        float64 = self.model.weights.dtype == torch.float64
        if self.use_triton is None:
            self.use_triton = triton_available(self.model.device) and not float64
        elif self.use_triton and float64 and self.model.device.type == "cuda":
            # (Triton's interpreter on the CPU computes in the tensors' own dtype: float64 works there)
            raise ConfigError(
                "the Triton decode kernels accumulate in float32: a float64 model runs their torch forms"
            )

    def __repr__(self) -> str:
        return (
            f"<DecodeGraphs buckets={list(self.buckets)} captured={sorted(self._captured)} "
            f"replays={self._replays} eager={self._eager_steps}>"
        )

    def statistics(self) -> dict[str, Any]:
        """Captured buckets, graph replays and eager steps, rows run and padding rows added, the block-table room
        of the inputs and how often it grew."""
        return {
            "buckets": list(self.buckets),
            "captured": sorted(self._captured),
            "replays": self._replays,
            "eager_steps": self._eager_steps,
            "rows": self._rows,
            "padded_rows": self._padded_rows,
            "table_blocks": int(self._packed.shape[1] - 3),
            "widened": self._widened,
        }

    def reset(self) -> None:
        """Drop the captured graphs (the next steps capture again); between steps only."""
        self._captured.clear()
        self._pool = None
        self.num_pages, self.num_slots = self.model.num_pages, self.model.num_slots
        self._packed = self._inputs(self._packed.shape[1] - 3)

    def _inputs(self, blocks: int) -> torch.Tensor:
        # the packed input rows, with room for block tables of ``blocks`` pages (never more than the pool has)
        blocks = max(1, min(blocks, self.num_pages))
        return torch.zeros(self.buckets[-1], 3 + blocks, dtype=torch.int64, device=self.model.device)

    @property
    def width(self) -> int:
        """Columns of an input row now: token, position, slot and the block-table room (grows, never shrinks)."""
        return int(self._packed.shape[1])

    def ready(self, rows: int) -> bool:
        """Whether a step of ``rows`` rows runs without capturing a graph first (captured already, or eager)."""
        if rows > self.buckets[-1]:
            return False
        return not self.capture or self.bucket(rows) in self._captured

    def bucket(self, rows: int) -> int:
        """The batch bucket that runs ``rows`` rows (at most the largest bucket)."""
        return next(b for b in self.buckets if b >= rows)

    def run(self, batch: Sequence[SequenceInput]) -> StepOutput:
        """One decode step for ``batch``: decode rows (:func:`is_decode_row`), at most the largest bucket, already
        validated by the model. K/V written, state advanced, outputs cloned."""
        from kvferry.model.nemotron_h import RowViews, StepOutput

        n = len(batch)
        bucket = self.bucket(n)
        tpb = self.model.spec.tokens_per_block
        has_pages = self.num_pages > 0
        width = 3 + (max(row.start for row in batch) // tpb + 1 if has_pages else 1)
        # one host tensor, one copy: rows as [token, position, slot, block table...], zero-padded; the padding
        # rows are all zeros (slot 0, page 0, position 0)
        flat: list[int] = []
        zeros = (0,) * width
        for row in batch:
            table = row.block_table[: row.start // tpb + 1] if has_pages else (0,)
            flat += (row.token_ids[0], row.start, row.slot)
            flat += table
            flat += zeros[: width - 3 - len(table)]
        flat += (0,) * ((bucket - n) * width)
        host = torch.tensor(flat, dtype=torch.int64).view(bucket, width)
        logits, hidden = self.run_rows(host, n, width)
        return StepOutput(logits=RowViews(logits), hidden=RowViews(hidden))

    def inputs_copied(self) -> None:
        """Wait until the last step's asynchronous copy of its host rows ended (they may change afterwards)."""
        if self._copied is not None:
            self._copied.synchronize()

    def widen(self, width: int) -> bool:
        """Make room for input rows of ``width`` columns (doubled block-table room; the graphs are captured
        again); whether it grew. Between steps only."""
        if width <= self._packed.shape[1]:
            return False
        self._captured.clear()
        self._pool = None
        self._packed = self._inputs(max(width - 3, 2 * (self._packed.shape[1] - 3)))
        self._widened += 1
        return True

    def run_rows(
        self, host: torch.Tensor, n: int, width: int, *, clone: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step over packed host rows: ``host`` holds at least the bucket's rows of ``n`` (rows ``n``
        and on all zeros: padding) and ``width`` valid columns (validated by the caller). Logits and hidden
        states ``[n, ...]``; with ``clone`` False they are the graph's own outputs, overwritten by the next step.

        A host tensor as wide as the inputs and pinned is copied whole rows, asynchronously on CUDA: the caller
        must not change it before the copy ran (:meth:`inputs_copied`)."""
        bucket = self.bucket(n)
        self.widen(width)
        # a first capture of the bucket runs on padding rows: before this step's rows are copied in
        captured = (self._captured.get(bucket) or self._capture(bucket)) if self.capture else None
        if host.shape[1] == self._packed.shape[1] and host.is_pinned():
            self._packed[:bucket].copy_(host[:bucket], non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._copied.record(torch.cuda.current_stream(self.model.device))
        else:
            self._packed[:bucket, :width].copy_(host[:bucket, :width])
        if captured is not None:
            captured.graph.replay()
            logits, hidden = captured.logits, captured.hidden
            self._replays += 1
        else:
            logits, hidden = self._forward(bucket, width)
            self._eager_steps += 1
        self._rows += n
        self._padded_rows += bucket - n
        if clone:
            return logits[:n].clone(), hidden[:n].clone()
        return logits[:n], hidden[:n]

    def _capture(self, bucket: int) -> _Captured:
        # Warm up (Triton compiles its kernels) on padding rows only: slot 0, page 0.
        self._packed[:bucket].zero_()
        stream = torch.cuda.Stream(device=self.model.device)  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(bucket)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            logits, hidden = self._forward(bucket)
        captured = _Captured(graph, logits, hidden)
        self._captured[bucket] = captured
        return captured

    # --- the step's arithmetic (device work only) ---------------------------------------------------------

    def _forward(self, bucket: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # ``width``: only the inputs' first columns hold tables (an eager step reads no page past them; a graph
        # is captured over every column)
        model = self.model
        spec = model.spec
        packed = self._packed[:bucket, :width]
        tokens, positions = packed[:, 0], packed[:, 1]
        slots = packed[:, 2].contiguous()  # once per step: every kernel indexes it as a vector
        tables = packed[:, 3:]
        # where each row's new K/V goes, and how far it attends: the same for every attention layer
        pages = (
            page_coordinates(tables, positions[:, None], spec.tokens_per_block) if self.num_pages else None
        )
        lengths = positions + 1
        weights = model.weights
        eps = model.args.layer_norm_epsilon
        replay_steps = model.max_replay_tokens if model.max_replay_tokens > 1 else 0
        mamba_layers = spec.layer_ids(LayerKind.MAMBA2)
        counts = model.caches[0].num_accepted[slots] if mamba_layers and replay_steps else None

        x = weights.embeddings[tokens]
        out: torch.Tensor | None = None
        for layer, kind in enumerate(spec.layer_kinds):
            # the residual add of the last block and this block's norm: one kernel
            x, h = add_rms_norm(
                x, out, weights[f"model.layers.{layer}.norm.weight"], eps, use_triton=self.use_triton
            )
            if kind == LayerKind.ATTENTION:
                assert pages is not None
                out = self._attention(layer, h, pages, lengths, tables)
            elif kind == LayerKind.MAMBA2:
                out = self._mamba(layer, h, slots, counts, replay_steps)
            else:
                out = all_reduce([model.mlp(r, layer, h) for r in range(model.tp_size)])
        if counts is not None:
            for cache in model.caches:
                cache.num_accepted.index_fill_(0, slots, 0)  # no host scalar: capturable
        x, normed = add_rms_norm(x, out, weights.final_norm, eps, use_triton=self.use_triton)
        return normed @ weights.lm_head.T, x

    def _attention(
        self,
        layer: int,
        h: torch.Tensor,
        pages: tuple[torch.Tensor, torch.Tensor],
        lengths: torch.Tensor,
        tables: torch.Tensor,
    ) -> torch.Tensor:
        model = self.model
        d = model.args.head_dim
        prefix = f"model.layers.{layer}.mixer."
        page_ids, offsets = pages
        parts = []
        for rank, (weights, cache) in enumerate(zip(model.rank_weights, model.caches, strict=True)):
            w = weights.tensors
            key_cache, value_cache = cache.kv(layer)
            q, k, v = self._qkv(rank, layer, h)
            rows = h.shape[0]
            write_kv(
                key_cache,
                value_cache,
                k.view(rows, -1, d),
                v.view(rows, -1, d),
                page_ids[:, 0],
                offsets[:, 0],
            )
            attn = paged_decode_attention(
                q.view(rows, -1, d),
                key_cache,
                value_cache,
                tables,
                lengths,
                d**-0.5,
                use_triton=self.use_triton,
            )
            parts.append(attn.reshape(rows, -1) @ w[prefix + "o_proj.weight"].T)
        return all_reduce(parts)

    def _constant(self, key: tuple[str, int, int], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        # per-layer tensors derived from the weights once, not in every step
        value = self._constants.get(key)
        if value is None:
            value = self._constants[key] = make()
        return value

    def _qkv(self, rank: int, layer: int, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # one GEMM for the three projections (their rows stacked once)
        prefix = f"model.layers.{layer}.mixer."
        w = self.model.rank_weights[rank].tensors
        names = [prefix + f"{p}_proj.weight" for p in "qkv"]
        stacked = self._constant(("qkv", rank, layer), lambda: torch.cat([w[n] for n in names]).contiguous())
        return torch.split(h @ stacked.T, [w[n].shape[0] for n in names], dim=-1)  # type: ignore[return-value]

    def _mamba(
        self,
        layer: int,
        h: torch.Tensor,
        slots: torch.Tensor,
        counts: torch.Tensor | None,
        replay_steps: int,
    ) -> torch.Tensor:
        model = self.model
        args = model.args
        mamba = model.spec.mamba2
        assert mamba is not None
        m = f"model.layers.{layer}.mixer."
        rows = h.shape[0]
        mixed = []
        for rank, (weights, cache) in enumerate(zip(model.rank_weights, model.caches, strict=True)):
            heads = weights.rank.mamba2_heads
            assert heads is not None
            x_dim, bc_dim, _ = weights.rank.mamba2_conv_sections
            conv_dim = x_dim + 2 * bc_dim
            conv_w, conv_b = weights[m + "conv1d.weight"], weights.get(m + "conv1d.bias")
            A_log = weights[m + "A_log"]
            A = self._constant(("A", rank, layer), lambda: -torch.exp(A_log))  # noqa: B023 (called at once)
            D, dt_bias = weights[m + "D"], weights[m + "dt_bias"]
            conv_states, ssm_states = cache.conv(layer), cache.ssm(layer)
            if counts is not None:
                mamba2_replay_steps(
                    conv_states, ssm_states, cache.replay(layer), slots, counts, replay_steps,
                    conv_w, conv_b, A, D, dt_bias, dt_min=args.time_step_min,
                )  # fmt: skip
            proj = h @ weights[m + "in_proj.weight"].T
            z, xbc, dt = torch.split(proj, [x_dim, conv_dim, heads.count], dim=-1)
            conv = conv_update(xbc, conv_states, slots, conv_w, conv_b, use_triton=self.use_triton)
            y = ssm_update(
                conv[:, :x_dim].view(rows, heads.count, mamba.head_dim),
                dt,
                A,
                conv[:, x_dim : x_dim + bc_dim].view(rows, -1, mamba.state_size),
                conv[:, x_dim + bc_dim :].view(rows, -1, mamba.state_size),
                D,
                dt_bias,
                ssm_states,
                slots,
                dt_min=args.time_step_min,
                use_triton=self.use_triton,
            )
            mixed.append((y.view(rows, x_dim), z))
        if model.tp_size == 1 and self.use_triton:
            # every norm group lies in the one rank: the gated norm as one kernel
            (y, z), weights = mixed[0], model.rank_weights[0]
            group_size = mamba.intermediate_size // mamba.num_groups
            normed = gated_group_norm(
                y, z, weights[m + "norm.weight"], group_size, args.layer_norm_epsilon, use_triton=True
            )
            return normed @ weights[m + "out_proj.weight"].T
        return model.mamba_out(layer, mixed)
