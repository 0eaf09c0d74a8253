"""The real model and the real cache manager behind the engine, and the factory that builds an engine of them.

- :class:`LockstepCache` drives one :class:`~kvferry.pools.manager.CacheManager` per tensor-parallel rank (each
  rank owns its own arena) through the same operations, so every rank holds the same page and slot ids.
- :class:`PagedRunner` runs :class:`~kvferry.model.family.PagedModel` steps (NemotronH or KimiLinear) over the managers' block tables and
  slots, feeds the drafter the target's hidden states, and records verify outcomes (``num_accepted``) in the
  replay state through the managers.
- :func:`build_engine` builds an :class:`~kvferry.engine.engine.Engine` for a preset (seeded random weights,
  :mod:`kvferry.model.presets`) or a local NemotronH or KimiLinear checkpoint directory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple, cast

import attrs
import torch
from attrs import define, frozen

from kvferry import wire
from kvferry.engine.engine import DraftItem, Engine, EngineConfig, ForwardItem
from kvferry.engine.scheduler import SchedulerConfig
from kvferry.errors import ConfigError, KvferryError, UnknownRequest, WireFormatError
from kvferry.model.decode_batch import DecodeBatch
from kvferry.model.device import resolve_device
from kvferry.model.drafter import Drafter, DrafterWeights, DraftInput
from kvferry.model.family import PagedModel, build_model
from kvferry.model.nemotron_h import Model, RowViews, SequenceInput
from kvferry.model.presets import load_preset
from kvferry.model.weights import ModelWeights
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.manager import CacheManager, CacheManagerStatistics, PendingMove, Resumed
from kvferry.pools.spec import ModelSpec, dtype_from_name, dtype_name, preset, preset_names

__all__ = [
    "CHECKPOINT_TOKENS_PER_BLOCK",
    "DrafterHandoff",
    "EngineOptions",
    "LockstepCache",
    "PagedRunner",
    "build_engine",
]


# --- cache: one manager per rank, in lockstep -------------------------------------------------------------


@define(eq=False)
class LockstepCache:
    """The scheduler's :class:`~kvferry.engine.scheduler.CacheOps` over one manager per TP rank.

    Every operation runs on rank 0 first; only when it succeeded does it run on the others, which hold
    identical bookkeeping and so must succeed the same way. A PoolExhausted therefore changes nothing on any
    rank.
    """

    managers: tuple[CacheManager, ...]

    @property
    def primary(self) -> CacheManager:
        return self.managers[0]

    def create(self, request_id: int, prompt_token_ids: Sequence[int]) -> None:
        for m in self.managers:
            m.create(request_id, prompt_token_ids)

    def resume(self, request_id: int) -> Resumed:
        first = self.primary.resume(request_id)
        for m in self.managers[1:]:
            if m.resume(request_id) != first:
                raise KvferryError(f"bug: ranks disagree on the resume of request {request_id}")
        return first

    def grow(self, request_id: int, capacity: int) -> None:
        for m in self.managers:
            m.grow(request_id, capacity)

    def grow_many(self, grows: Sequence[tuple[int, int]], *, offload: bool = True) -> None:
        """:meth:`CacheManager.grow_many <kvferry.pools.manager.CacheManager.grow_many>` on every rank."""
        for m in self.managers:
            m.grow_many(grows, offload=offload)

    def commit(self, request_id: int, token_ids: Sequence[int], *, num_pending_replay: int = 0) -> None:
        for m in self.managers:
            m.commit(request_id, token_ids, num_pending_replay=num_pending_replay)

    def commit_many(self, commits: Sequence[tuple[int, Sequence[int], int]]) -> None:
        """:meth:`CacheManager.commit_many <kvferry.pools.manager.CacheManager.commit_many>` on every rank."""
        for m in self.managers:
            m.commit_many(commits)

    def next_snapshot_boundary(self, request_id: int) -> int | None:
        return self.primary.next_snapshot_boundary(request_id)

    def suspend(self, request_id: int) -> None:
        for m in self.managers:
            m.suspend(request_id)

    def close(self, request_id: int) -> None:
        for m in self.managers:
            m.close(request_id)

    def offload(self, request_id: int) -> None:
        """:meth:`CacheManager.offload <kvferry.pools.manager.CacheManager.offload>` on every rank."""
        for m in self.managers:
            m.offload(request_id)

    def extend(self, request_id: int, prompt_token_ids: Sequence[int]) -> None:
        """:meth:`CacheManager.extend <kvferry.pools.manager.CacheManager.extend>` on every rank."""
        for m in self.managers:
            m.extend(request_id, prompt_token_ids)

    def holds(self, request_id: int) -> bool:
        """Whether the managers hold a cache for ``request_id``."""
        try:
            self.primary.state(request_id)
        except UnknownRequest:
            return False
        return True

    def num_committed_tokens(self, request_id: int) -> int:
        return self.primary.num_committed_tokens(request_id)

    def capacity(self, request_id: int) -> int:
        return self.primary.capacity(request_id)

    def rebalance(
        self,
        *,
        num_pages: int | None = None,
        num_slots: int | None = None,
        num_draft_pages: int | None = None,
    ) -> tuple[CacheArena, ...]:
        """:meth:`CacheManager.rebalance <kvferry.pools.manager.CacheManager.rebalance>` on every rank (rank 0
        first: a refusal there changes nothing anywhere); returns the new arenas, one per rank.

        :raises ~kvferry.errors.RebalanceRefused: as the manager's.
        """
        for m in self.managers:
            m.rebalance(num_pages=num_pages, num_slots=num_slots, num_draft_pages=num_draft_pages)
        arenas = tuple(m.arena for m in self.managers)
        assert all(a is not None for a in arenas), "a rebalance of managers without arenas"
        return arenas  # type: ignore[return-value]

    def host_nbytes(self, request_id: int) -> int:
        """Host bytes of the request's cache over every rank (0 while on the device)."""
        return sum(m.host_nbytes(request_id) for m in self.managers)

    def commit_draft(self, request_id: int, start: int, end: int) -> None:
        """:meth:`CacheManager.commit_draft <kvferry.pools.manager.CacheManager.commit_draft>` on every rank."""
        for m in self.managers:
            m.commit_draft(request_id, start, end)

    def set_num_accepted(self, request_id: int, num_accepted: int, *, defer: bool = False) -> None:
        for m in self.managers:
            m.set_num_accepted(request_id, num_accepted, defer=defer)

    def flush_num_accepted(self) -> None:
        """Write every rank's deferred ``num_accepted`` (before a model step reads them)."""
        for m in self.managers:
            m.flush_num_accepted()

    # --- two-phase moves to the host and back (kvferry.engine.host_moves drives them) --------------------------

    def start_offload(self, request_id: int) -> tuple[PendingMove, ...]:
        """:meth:`CacheManager.start_offload <kvferry.pools.manager.CacheManager.start_offload>` on every rank
        (rank 0 first: a refusal there changes nothing anywhere); one move per rank, for :meth:`finish`."""
        return self._start(lambda m: m.start_offload(request_id))

    def start_restore(self, request_id: int, *, pin: bool = False) -> tuple[PendingMove, ...]:
        """:meth:`CacheManager.start_restore <kvferry.pools.manager.CacheManager.start_restore>` on every rank,
        as :meth:`start_offload`."""
        return self._start(lambda m: m.start_restore(request_id, pin=pin))

    def _start(self, start: Callable[[CacheManager], PendingMove]) -> tuple[PendingMove, ...]:
        moves = [start(self.primary)]
        try:
            moves.extend(start(m) for m in self.managers[1:])  # appended one by one: a failure keeps the rest
        except BaseException:
            for m, move in zip(self.managers, moves, strict=False):
                m.finish(move, commit=False)
            raise
        return tuple(moves)

    def finish(self, moves: Sequence[PendingMove], *, commit: bool = True) -> bool:
        """End the moves of :meth:`start_offload` / :meth:`start_restore` on every rank alike: each rank's copy
        is waited for (run here when nobody ran it), then every rank commits when every rank copied every byte
        and ``commit``, else every rank rolls back. Returns whether they committed.

        :raises Exception: a rank's copy error when it failed and ``commit`` (every rank rolled back first).
        """
        if len(moves) != len(self.managers):
            raise ConfigError(f"{len(moves)} moves for {len(self.managers)} ranks")
        for move in moves:
            move.run()
        together = commit and all(move.copied for move in moves)
        committed = [m.finish(move, commit=together) for m, move in zip(self.managers, moves, strict=True)]
        failed = next((move.error for move in moves if move.error is not None), None)
        if commit and failed is not None:
            raise failed
        if len(set(committed)) > 1:
            raise KvferryError(f"bug: ranks disagree on the move of request {moves[0].request_id}")
        return committed[0]

    def restore_victims(self, request_id: int) -> list[int]:
        """:meth:`CacheManager.restore_victims <kvferry.pools.manager.CacheManager.restore_victims>` (the same
        on every rank)."""
        return [cast(int, v) for v in self.primary.restore_victims(request_id)]

    def is_offloaded(self, request_id: int) -> bool:
        return self.primary.is_offloaded(request_id)

    def is_moving(self, request_id: int) -> bool:
        return self.primary.is_moving(request_id)

    def block_table(self, request_id: int) -> tuple[int, ...]:
        return tuple(self.primary.block_table(request_id))

    def block_tables(self, request_ids: Sequence[int]) -> list[Sequence[int]]:
        """Rank 0's live page lists of the requests (the same on every rank; do not mutate)."""
        return self.primary.block_tables(request_ids)

    def draft_block_table(self, request_id: int) -> tuple[int, ...]:
        return tuple(self.primary.draft_block_table(request_id))

    def slot_id(self, request_id: int) -> int:
        slot = self.primary.slot_id(request_id)
        return 0 if slot is None else slot

    def statistics(self) -> CacheManagerStatistics:
        return self.primary.statistics()

    def __repr__(self) -> str:
        return f"<LockstepCache tp={len(self.managers)} {self.primary!r}>"


# --- the drafter's hand-off --------------------------------------------------------------------------------


@frozen
class DrafterHandoff:
    """What a generation engine's drafter needs of a prefilled request besides its draft KV pages: the target's
    hidden state of the prompt's last position (``start``, holding ``token``) and the token chosen after it
    (``pending``). ``hidden``: the raw bytes of one ``[hidden_size]`` row of ``dtype``."""

    start: int
    token: int
    pending: int
    dtype: str
    hidden: bytes

    def validate(self) -> None:
        if min(self.start, self.token, self.pending) < 0:
            raise WireFormatError(f"drafter hand-off with a negative position or token: {self!r}")
        try:
            itemsize = dtype_from_name(self.dtype).itemsize
        except ConfigError:
            raise WireFormatError(f"drafter hand-off of unknown dtype {self.dtype!r}") from None
        if not self.hidden or len(self.hidden) % itemsize:
            raise WireFormatError(f"drafter hand-off of {len(self.hidden)} bytes of {self.dtype}")

    def __repr__(self) -> str:
        return (
            f"DrafterHandoff(start={self.start}, token={self.token}, pending={self.pending}, "
            f"dtype={self.dtype}, {len(self.hidden)} bytes)"
        )


# --- the model runner ---------------------------------------------------------------------------------------


@define(eq=False)
class _Fed:
    # target hidden states of tokens fed since the drafter last ran, for the drafter's next proposal
    start: int
    token_ids: list[int]
    hidden: torch.Tensor


@define(eq=False)
class PagedRunner:
    """Runs the paged model (and its drafter) for the engine over a :class:`LockstepCache`.

    For requests that speculate, the target's hidden states of every fed token are kept (host memory of this
    object, not cache pages) until the drafter consumes them at the request's next proposal; a verify window
    keeps only its accepted rows.
    """

    model: PagedModel
    cache: LockstepCache
    drafter: Drafter | None = None
    _fed: dict[int, list[_Fed]] = attrs.field(factory=dict, init=False)
    #: the drafter's final KV ranges of the last step, handed to the managers by :meth:`finish_step`
    _draft_commits: list[tuple[int, int, int]] = attrs.field(factory=list, init=False)
    #: the plain decodes' rows kept on the model's decode path from step to step (:meth:`forward_decodes`)
    _decode_rows: DecodeBatch | None = attrs.field(default=None, init=False)

    @property
    def vocab_size(self) -> int:
        return self.model.spec.vocab_size

    def prepare_step(self) -> None:
        """On the engine's loop, before a step that may run in a worker thread: the last step's acceptances
        reach the arena (the step's replay reads them), so nothing in the step touches the managers'
        bookkeeping, which the loop may change meanwhile (a transfer, a hold) for requests outside the step."""
        self._draft_commits.clear()  # of a step that failed: its requests failed with it
        self.cache.flush_num_accepted()

    def finish_step(self) -> None:
        """On the engine's loop, after the step: the draft KV it made final enters the draft prefix index."""
        commits, self._draft_commits = self._draft_commits, []
        for request_id, start, end in commits:
            self.cache.commit_draft(request_id, start, end)

    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        self.cache.flush_num_accepted()  # a no-op after prepare_step; kept for callers that step by hand
        batch = [
            SequenceInput(
                token_ids=item.token_ids,  # type: ignore[arg-type,unused-ignore]
                start=item.start,
                block_table=self.cache.block_table(item.request_id),  # type: ignore[arg-type,unused-ignore]
                slot=self.cache.slot_id(item.request_id),
                verify=item.verify,
                all_logits=item.num_logits > 1,
            )
            for item in items
        ]
        out = self.model.step(batch)
        if isinstance(out.logits, RowViews) and all(item.num_logits == 1 for item in items):
            # the decode path's one row per sequence: hand the tensor on as it is
            for index, item in enumerate(items):
                if item.keep_hidden and self.drafter is not None:
                    self._fed.setdefault(item.request_id, []).append(
                        _Fed(item.start, list(item.token_ids), out.hidden[index].detach().clone())
                    )
            return out.logits.rows
        logits = []
        for item, item_logits, hidden in zip(items, out.logits, out.hidden, strict=True):
            if item.num_logits:
                logits.append(item_logits[item_logits.shape[0] - item.num_logits :])
            if item.keep_hidden and self.drafter is not None:
                self._fed.setdefault(item.request_id, []).append(
                    _Fed(item.start, list(item.token_ids), hidden.detach().clone())
                )
        if not logits:
            return torch.empty(0, self.vocab_size, dtype=self.model.weights.dtype, device=self.model.device)
        return torch.cat(logits)

    @property
    def decode_rows(self) -> DecodeBatch | None:
        """The plain decodes' rows on the model's decode path (None before the first such step)."""
        return self._decode_rows

    @property
    def decode_path_rows(self) -> int:
        """The most plain decodes one step of the model's decode path takes (0: the model has none)."""
        graphs = self.model.decode_graphs
        return 0 if graphs is None else graphs.buckets[-1]

    def decode_path_ready(self, rows: int) -> bool:
        """Whether a step of ``rows`` plain decodes would be a cheap, asynchronous launch: the model's decode path
        takes them and has its graph captured (a first capture compiles and warms up; the general step reads
        values back from the device)."""
        graphs = self.model.decode_graphs
        return graphs is not None and graphs.ready(rows)

    def forward_decodes(
        self, request_ids: Sequence[int], tokens: Sequence[int], starts: Sequence[int]
    ) -> torch.Tensor:
        """Plain decodes (one token each, no hidden state kept): the logits of ``forward`` over
        ``ForwardItem(request_ids[i], (tokens[i],), starts[i], 1)``. With the model's decode path, through rows it
        keeps from step to step (:class:`~kvferry.model.decode_batch.DecodeBatch`): per step only tokens and
        positions are written, and a row's table and slot are read and checked when it enters or its table grows.
        The logits are valid until the next step."""
        model, graphs = self.model, self.model.decode_graphs
        # only NemotronH has the decode path (a KimiLinear model's decode_graphs is always None)
        if graphs is None or not isinstance(model, Model) or len(request_ids) > graphs.buckets[-1]:
            return self.forward(
                [ForwardItem(r, (t,), s, 1) for r, t, s in zip(request_ids, tokens, starts, strict=True)]
            )
        if self._decode_rows is None or self._decode_rows.model is not model:
            self._decode_rows = DecodeBatch(model)
        self.cache.flush_num_accepted()  # a no-op after prepare_step
        tables = self.cache.block_tables(request_ids)
        return model.step_decode(self._decode_rows, request_ids, tokens, starts, tables, self.cache.slot_id)

    def propose(self, items: Sequence[DraftItem]) -> list[tuple[int, ...]]:
        if self.drafter is None:
            raise ConfigError("speculative decoding needs a drafter; this engine has none")

        by_k: dict[int, list[int]] = {}
        for index, item in enumerate(items):
            by_k.setdefault(item.k, []).append(index)
        proposals: list[tuple[int, ...]] = [()] * len(items)
        for k, indices in by_k.items():
            inputs = []
            for index in indices:
                item = items[index]
                fed = self._fed.pop(item.request_id, [])
                if not fed:
                    raise ConfigError(f"request {item.request_id}: no target hidden state to draft from")
                tokens = [t for f in fed for t in f.token_ids]
                tokens.append(item.pending_token)
                inputs.append(
                    DraftInput(
                        hidden=torch.cat([f.hidden for f in fed]),
                        next_tokens=tokens[1:],  # type: ignore[arg-type,unused-ignore]
                        start=fed[0].start,
                        block_table=self.cache.draft_block_table(item.request_id),  # type: ignore[arg-type,unused-ignore]
                    )
                )
            for index, proposal in zip(indices, self.drafter.propose(inputs, k), strict=True):
                proposals[index] = proposal.tokens
            for index, draft_input in zip(indices, inputs, strict=True):
                # the catch-up rows are final draft KV of committed positions: the draft mirror may offer them
                # (at finish_step, on the engine's loop)
                start = draft_input.start
                self._draft_commits.append(
                    (items[index].request_id, start, start + len(draft_input.next_tokens))
                )
        return proposals

    def record_accepted(self, request_id: int, num_accepted: int) -> None:
        # deferred: the step's acceptances reach the arena in one write per rank, before the next model step
        # (forward flushes them) or any manager operation that moves, frees or resets a slot
        self.cache.set_num_accepted(request_id, num_accepted, defer=True)
        fed = self._fed.get(request_id)
        if fed:
            last = fed[-1]
            fed[-1] = _Fed(last.start, last.token_ids[:num_accepted], last.hidden[:num_accepted])

    def release(self, request_id: int) -> None:
        self._fed.pop(request_id, None)

    def rebind(self, arenas: Sequence[CacheArena]) -> None:
        """Run the model (and the drafter) over new arenas, one per rank, from the next step on."""
        self.model.rebind(arenas)
        if self._decode_rows is not None:
            self._decode_rows.reset()
        if self.drafter is not None:
            self.drafter.rebind()

    def export_handoff(self, request_id: int, pending_token: int) -> bytes:
        """Finish the drafter's part of a prefilled request for a hand-off; returns the bytes to send along.

        Runs the drafter's catch-up over every target hidden state fed since its last proposal (the prompt,
        with ``pending_token``, the token the target just chose, after its last position), exactly the pass
        the first proposal of aggregated serving makes: this writes the request's draft KV for the whole
        prompt into its draft pages (the transfer carries them). The bytes returned
        (:class:`DrafterHandoff`) hold only what the receiver's first proposal needs besides those pages:
        the last position's hidden state. Afterwards this runner keeps just that row too, so the request
        could also continue here.

        Empty when the request keeps no drafter state (submitted with ``spec_k == 0``, or no drafter).
        On failure (bad draft block table: ConfigError) nothing is written and the state is kept.
        """
        fed = self._fed.get(request_id)
        if not fed or self.drafter is None:
            return b""
        hidden = torch.cat([f.hidden for f in fed])
        tokens = [t for f in fed for t in f.token_ids]
        start = fed[0].start
        # k=1: the catch-up rows plus one draft token, which is discarded (it writes no draft KV)
        self.drafter.propose(
            [
                DraftInput(
                    hidden=hidden,
                    next_tokens=(*tokens[1:], int(pending_token)),  # type: ignore[arg-type,unused-ignore]
                    start=start,
                    block_table=self.cache.draft_block_table(request_id),  # type: ignore[arg-type,unused-ignore]
                )
            ],
            1,
        )
        self.cache.commit_draft(request_id, start, start + len(tokens))
        last = _Fed(start + len(tokens) - 1, tokens[-1:], hidden[-1:])
        self._fed[request_id] = [last]
        row = last.hidden.detach().to("cpu").contiguous()
        return wire.encode(
            DrafterHandoff(
                start=last.start,
                token=last.token_ids[0],
                pending=int(pending_token),
                dtype=dtype_name(row.dtype),
                hidden=row.view(torch.uint8).numpy().tobytes(),
            )
        )

    def import_handoff(
        self,
        request_id: int,
        data: bytes,
        *,
        prompt: Sequence[int] | None = None,
        pending_token: int | None = None,
    ) -> None:
        """Install the drafter state :meth:`export_handoff` made on another engine (the request's draft KV
        arrives in its draft pages by transfer; without it they hold zeros and proposals get worse).

        ``prompt`` / ``pending_token``, when given, must be what the hand-off continues: its position is the
        prompt's last, its token the prompt's last token, its pending token ``pending_token``.

        :raises ~kvferry.errors.WireFormatError: bytes that do not decode to a hand-off of this model (another
            dtype, hidden size) or that continue another sequence; nothing changes.
        """
        handoff = wire.decode(data, DrafterHandoff)
        dtype = self.model.weights.dtype
        width = self.model.spec.hidden_size
        if handoff.dtype != dtype_name(dtype):
            raise WireFormatError(f"drafter hand-off of dtype {handoff.dtype}, this model runs {dtype}")
        if len(handoff.hidden) != width * dtype.itemsize:
            raise WireFormatError(
                f"drafter hand-off of {len(handoff.hidden)} bytes is not one hidden state of {width} x {dtype}"
            )
        if prompt is not None and (handoff.start, handoff.token) != (len(prompt) - 1, prompt[-1]):
            raise WireFormatError(
                f"drafter hand-off at position {handoff.start} (token {handoff.token}) does not continue a "
                f"prompt of {len(prompt)} tokens ending in {prompt[-1] if prompt else None}"
            )
        if pending_token is not None and handoff.pending != pending_token:
            raise WireFormatError(
                f"drafter hand-off continues with token {handoff.pending}, not {pending_token}"
            )
        row = torch.frombuffer(bytearray(handoff.hidden), dtype=torch.uint8).view(dtype).reshape(1, width)
        self._fed[request_id] = [_Fed(handoff.start, [handoff.token], row.to(self.model.device))]

    def __repr__(self) -> str:
        return f"<PagedRunner {self.model!r} drafter={self.drafter is not None} speculating={len(self._fed)}>"


# --- the factory --------------------------------------------------------------------------------------------


@frozen
class EngineOptions:
    """Everything :func:`build_engine` sizes. Counts of pages and slots include the reserved id 0."""

    tp: int = 1
    dtype: str = "float32"
    seed: int = 0
    device: str = "cpu"
    num_pages: int = 512
    num_slots: int = 0  # 0: 2 * max_running + 1 (live slots plus room for prefix snapshots)
    num_draft_pages: int = 0  # 0: as many draft pages as target pages cover the same tokens
    max_running: int = 16
    token_budget: int = 0  # 0: max_running * (1 + max_spec_k) + max_prefill_chunk
    max_prefill_chunk: int = 64
    max_spec_k: int = 0
    snapshot_interval: int = 0
    enable_reuse: bool = True
    #: reuse the drafter's KV with the target's prefix (False: the reused prefix's draft KV is zero-filled)
    draft_reuse: bool = True
    step_in_thread: bool = True
    #: overlap host work with the model step (EngineConfig.overlap; only with step_in_thread)
    overlap: bool = True
    #: bytes of host memory for caches moved off the device (None: no bound; see EngineConfig.host_memory)
    host_memory: int | None = None
    #: build the drafter when max_spec_k > 0 (False: the caller brings its own proposals via the runner)
    drafter: bool = True
    #: pure decode rows through fused kernels captured as CUDA graphs (None: on CUDA devices only; True on the
    #: CPU runs the same path eagerly)
    decode_graphs: bool | None = None
    #: steps of plain decodes launched from the event loop, their tokens polled while the device computes, instead
    #: of a worker thread (EngineConfig.launch_on_loop; None: on CUDA devices only, where a launch returns at once)
    launch_on_loop: bool | None = None
    #: divide a NemotronH preset's widths by this (1: its real proportions; see kvferry.model.presets)
    preset_scale: int = 1


class BuiltEngine(NamedTuple):
    engine: Engine
    runner: PagedRunner
    cache: LockstepCache
    arenas: tuple[CacheArena, ...]


#: attention tokens per page of an engine built from a checkpoint directory
CHECKPOINT_TOKENS_PER_BLOCK = 32


def _load(model: str | Path, options: EngineOptions) -> tuple[ModelWeights, ModelSpec]:
    device = resolve_device(options.device)
    dtype_from_name(options.dtype)
    if str(model) in preset_names():
        # seeded on the device in the dtype: a large preset never exists in float64 or on the host
        return load_preset(
            str(model), seed=options.seed, dtype=options.dtype, device=device, scale=options.preset_scale
        )
    path = Path(model)
    if not path.is_dir():
        raise ConfigError(
            f"--model must be a preset ({', '.join(preset_names())}) or a checkpoint directory; "
            f"{path} is not a directory"
        )
    weights = ModelWeights.from_checkpoint(path, dtype_from_name(options.dtype))
    tiny = preset("tiny")
    assert tiny.drafter is not None
    spec = weights.args.model_spec(
        name=path.name,
        tokens_per_block=CHECKPOINT_TOKENS_PER_BLOCK,
        dtype=options.dtype,
        drafter=tiny.drafter,
    ).with_dtype(options.dtype)
    return weights, spec


def build_engine(model: str | Path = "tiny", options: EngineOptions | None = None) -> BuiltEngine:
    """An engine over the paged model: a preset (``tiny``, ``tiny-kimi``, ``nemotron-h-1b``, ``nemotron-h-8b``:
    seeded random weights made on ``options.device``, see :mod:`kvferry.model.presets`) or a checkpoint
    directory of either family (``config.json``'s ``model_type``: ``nemotron_h`` or ``kimi_linear``).

    Each of ``options.tp`` simulated ranks gets its own arena and manager. With ``max_spec_k > 0`` the drafter
    is built too (its own paged KV). The engine is not started: use ``async with built.engine:``.

    :raises ~kvferry.errors.ConfigError: on an unknown model, a bad directory, a device torch cannot use here
        or sizes that cannot work.
    """
    options = options or EngineOptions()
    weights, spec = _load(model, options)
    speculative = options.max_spec_k > 0 and options.drafter
    if not speculative:
        spec = spec.without_drafter()
    num_slots = options.num_slots or 2 * options.max_running + 1
    num_draft_pages = 0
    if spec.drafter is not None:
        per_page = spec.tokens_per_block / spec.drafter.tokens_per_block
        num_draft_pages = options.num_draft_pages or int(options.num_pages * per_page) + 1
    arenas = []
    for rank in range(options.tp):
        layout = CacheLayout.build(
            spec.shard(options.tp, rank),
            num_pages=options.num_pages,
            num_slots=num_slots,
            num_draft_pages=num_draft_pages,
            max_replay_tokens=options.max_spec_k + 1,
        )
        arenas.append(CacheArena(layout, options.device))
    managers = [
        CacheManager.for_arena(
            arena,
            max_batch_size=options.max_running,
            snapshot_interval=options.snapshot_interval,
            enable_reuse=options.enable_reuse,
            enable_draft_reuse=options.draft_reuse,
        )
        for arena in arenas
    ]
    cache = LockstepCache(tuple(managers))
    weights = weights.to(dtype_from_name(options.dtype), options.device)
    target = build_model(weights, spec, arenas)
    decode_graphs = options.decode_graphs
    if decode_graphs is None:
        # the fused decode path exists for NemotronH only (KimiLinearModel refuses it when asked outright)
        decode_graphs = torch.device(options.device).type == "cuda" and isinstance(target, Model)
    if decode_graphs:
        target.enable_decode_graphs(options.max_running)
    drafter = None
    if speculative:
        assert spec.drafter is not None
        drafter = Drafter.build(target, DrafterWeights.derived(weights, spec.drafter, options.seed))
    runner = PagedRunner(target, cache, drafter)
    budget = options.token_budget or (
        options.max_running * (1 + options.max_spec_k) + options.max_prefill_chunk
    )
    config = EngineConfig(
        SchedulerConfig(
            budget,
            options.max_running,
            options.max_prefill_chunk,
            options.max_spec_k,
            grow_granularity=spec.tokens_per_block,
        ),
        step_in_thread=options.step_in_thread,
        overlap=options.overlap,
        launch_on_loop=(
            torch.device(options.device).type == "cuda"
            if options.launch_on_loop is None
            else options.launch_on_loop
        ),
        host_memory=options.host_memory,
    )
    return BuiltEngine(Engine(runner, cache, config), runner, cache, tuple(arenas))
