"""The decode rows a caller keeps from step to step: the decode path's inputs updated in place, not rebuilt.

A serving engine decodes mostly the same sequences step after step: each brings one new token at the next
position, and only now and then a new page or a new sequence. :class:`DecodeBatch` keeps the packed input rows
of :class:`~kvferry.model.decode_graph.DecodeGraphs` (``[token, position, slot, block table...]``) in host memory
(pinned on CUDA) keyed by the caller's sequence ids, and per step writes only what changed:

- every row's token and position (two column writes for the whole batch, checked in one pass each);
- rows that enter (a sequence that was not in the last step), or whose table changed object (the cache manager
  replaces a request's page list when it moves it): their slot and table are read and validated then;
- pages a row's position reaches for the first time: only those page ids are read and validated.

Rows keep the caller's order; a step with other sequences than the last permutes the rows in one gather. A row
of a sequence missing from a step is dropped, so a cache moved while its sequence sat a step out is read anew.
The validation is that of :meth:`Model.step <kvferry.model.nemotron_h.Model.step>` for decode rows, done when a
row enters or its table grows rather than per step; a bad input raises :class:`~kvferry.errors.ConfigError`
before anything is run, and the rows are then forgotten (the next step reads every row anew).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch
from attrs import define

from kvferry.errors import ConfigError

if TYPE_CHECKING:
    from kvferry.model.nemotron_h import Model

__all__ = ["DecodeBatch"]


@define(eq=False)
class DecodeBatch:
    """Persistent decode rows of one caller over ``model``'s decode path (it must have one:
    :meth:`Model.enable_decode_graphs <kvferry.model.nemotron_h.Model.enable_decode_graphs>`).

    Not thread-safe; one step at a time, as the model. :meth:`reset` after the caches were replaced.
    """

    model: Model
    _host: torch.Tensor = attrs.field(init=False)
    _rows: np.ndarray = attrs.field(init=False)  # the numpy view of _host
    #: table entries written per row
    _written: np.ndarray = attrs.field(init=False)
    _keys: list[int] = attrs.field(init=False, factory=list)
    _row_of: dict[int, int] = attrs.field(init=False, factory=dict)
    #: per row, the table object its pages were read from (another object: the row is read anew)
    _tables: list[Sequence[int] | None] = attrs.field(init=False, factory=list)
    _entered: int = attrs.field(init=False, default=0)
    _pages_read: int = attrs.field(init=False, default=0)

    def __attrs_post_init__(self) -> None:
        if self.model.decode_graphs is None:
            raise ConfigError("decode rows need the model's decode path (enable_decode_graphs)")
        self._allocate()

    def __repr__(self) -> str:
        return f"<DecodeBatch rows={len(self._keys)} width={self._host.shape[1]}>"

    def statistics(self) -> dict[str, int]:
        """Rows now, rows that entered (read and validated whole) and page ids read since they entered."""
        return {"rows": len(self._keys), "entered": self._entered, "pages_read": self._pages_read}

    def reset(self) -> None:
        """Forget every row (the next step reads each anew): after the caches or their ids changed."""
        self._allocate()

    def _allocate(self) -> None:
        graphs = self.model.decode_graphs
        assert graphs is not None
        pinned = self.model.device.type == "cuda"
        self._host = torch.zeros(graphs.buckets[-1], graphs.width, dtype=torch.int64, pin_memory=pinned)
        self._rows = self._host.numpy()
        self._written = np.zeros(graphs.buckets[-1], dtype=np.int64)
        self._keys, self._row_of, self._tables = [], {}, []

    def step(
        self,
        keys: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        slot_of: Callable[[int], int],
    ) -> torch.Tensor:
        """One decode step: sequence ``keys[i]`` feeds ``tokens[i]`` at ``positions[i]`` (> 0) with block table
        ``tables[i]`` and slot ``slot_of(keys[i])``. A table is read only where it is another object than the
        row's last one (then the slot is asked for too) or where the position reaches pages not read yet: a
        caller's table object may only grow, and must be replaced when its pages or slot change. Logits
        ``[n, vocab]``, valid until the model's next step.

        :raises ~kvferry.errors.ConfigError: a bad input (nothing run; the rows are forgotten).
        """
        graphs = self.model.decode_graphs
        if graphs is None:
            raise ConfigError("the model's decode path is off")
        n = len(keys)
        if not 0 < n <= graphs.buckets[-1]:
            raise ConfigError(f"{n} decode rows; the decode path takes 1 to {graphs.buckets[-1]}")
        graphs.inputs_copied()  # the last step's rows reached the device: they may change now
        if self._host.shape != (graphs.buckets[-1], graphs.width):
            self._allocate()  # inputs widened by another caller's step, or a new decode path
        try:
            width = self._update(keys, tokens, positions, tables, slot_of)
        except BaseException:
            self._allocate()
            raise
        logits, _ = graphs.run_rows(self._host, n, width, clone=False)
        return logits

    def _update(
        self,
        keys: Sequence[int],
        tokens: Sequence[int],
        positions: Sequence[int],
        tables: Sequence[Sequence[int]],
        slot_of: Callable[[int], int],
    ) -> int:
        model, graphs = self.model, self.model.decode_graphs
        assert graphs is not None
        n = len(keys)
        token_col = np.fromiter(tokens, dtype=np.int64, count=n)
        position_col = np.fromiter(positions, dtype=np.int64, count=n)
        if int(token_col.min()) < 0 or int(token_col.max()) >= model.spec.vocab_size:
            raise ConfigError(f"token ids outside the vocabulary [0, {model.spec.vocab_size})")
        if int(position_col.min()) < 1:
            raise ConfigError("a decode row continues a cached sequence: position >= 1")
        if not isinstance(keys, list):
            keys = list(keys)  # compared with the last step's list in C
        if keys != self._keys:
            self._relayout(keys)
        rows = self._rows
        if len(tables) != n:
            raise ConfigError(f"{len(tables)} block tables for {n} decode rows")
        known = self._tables
        if not all(map(operator.is_, tables, known)):
            entering = [i for i in range(n) if tables[i] is not known[i]]
            num_slots = graphs.num_slots
            for i in entering:
                slot = slot_of(keys[i])
                if not 0 <= slot < num_slots:
                    raise ConfigError(f"slot {slot} outside [0, {num_slots})")
                rows[i, 2] = slot
                rows[i, 3:] = 0
                self._written[i] = 0
                known[i] = tables[i]
            if np.unique(rows[:n, 2]).size != n:
                raise ConfigError(f"a batch names the same slot twice: {rows[:n, 2].tolist()}")
            self._entered += len(entering)
        num_pages = graphs.num_pages
        if num_pages:
            needed = position_col // model.spec.tokens_per_block + 1
            width = 3 + int(needed.max())
            if width > rows.shape[1]:
                graphs.widen(width)
                self._widen()
                rows = self._rows
            written = self._written
            for i in np.flatnonzero(needed > written[:n]).tolist():
                lo, hi = int(written[i]), int(needed[i])
                pages = tables[i][lo:hi]
                if len(pages) < hi - lo:
                    raise ConfigError(
                        f"block table of {len(tables[i])} blocks cannot hold {int(position_col[i]) + 1} tokens"
                    )
                if min(pages) < 0 or max(pages) >= num_pages:
                    raise ConfigError(f"page ids outside [0, {num_pages})")
                rows[i, 3 + lo : 3 + hi] = pages
                written[i] = hi
                self._pages_read += hi - lo
        else:
            width = 4  # one page column (page 0): the inputs' layout without attention layers
        rows[:n, 0] = token_col
        rows[:n, 1] = position_col
        return width

    def _relayout(self, keys: Sequence[int]) -> None:
        # the rows in the new order: kept rows move (one gather), entering rows start empty, the rest is padding
        n, before = len(keys), len(self._keys)
        row_of = {key: i for i, key in enumerate(keys)}
        if len(row_of) != n:
            raise ConfigError("a batch names the same sequence twice")
        source = np.fromiter((self._row_of.get(key, -1) for key in keys), dtype=np.int64, count=n)
        kept = source >= 0
        rows, written = self._rows, self._written
        moved, moved_written = rows[source[kept]], written[source[kept]]
        rows[: max(n, before)] = 0
        written[: max(n, before)] = 0
        rows[:n][kept] = moved
        written[:n][kept] = moved_written
        self._tables = [self._tables[j] if j >= 0 else None for j in source.tolist()]
        self._keys, self._row_of = list(keys), row_of

    def _widen(self) -> None:
        # rows as wide as the widened inputs, the same contents
        old = self._rows
        keys, row_of, tables, written = self._keys, self._row_of, self._tables, self._written
        self._allocate()
        self._rows[:, : old.shape[1]] = old
        self._keys, self._row_of, self._tables, self._written = keys, row_of, tables, written
