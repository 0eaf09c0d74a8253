"""The paged model of either family behind one interface: :class:`PagedModel` and :func:`build_model`.

The engine's runner, the drafter and the tools hold a :class:`PagedModel` and never ask which family it is:
:class:`~kvferry.model.nemotron_h.Model` (NemotronH) and :class:`~kvferry.model.kimi_linear.KimiLinearModel`
(KimiLinear) both satisfy it. :func:`build_model` picks the class from the weights' args.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvferry.errors import ConfigError
from kvferry.model.kimi_args import KimiLinearArgs
from kvferry.model.kimi_linear import KimiLinearModel
from kvferry.model.nemotron_h import CacheViews, Model, SequenceInput, StepOutput
from kvferry.model.weights import ModelWeights, NemotronHArgs
from kvferry.pools.spec import ModelSpec

if TYPE_CHECKING:
    from kvferry.model.decode_graph import DecodeGraphs

__all__ = ["PagedModel", "build_model"]


class PagedModel(Protocol):
    """What the engine and the drafter use of a paged model (see :class:`~kvferry.model.nemotron_h.Model`)."""

    @property
    def weights(self) -> ModelWeights: ...

    @property
    def spec(self) -> ModelSpec: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def tp_size(self) -> int: ...

    @property
    def caches(self) -> Sequence[CacheViews]: ...

    @property
    def num_pages(self) -> int: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def max_replay_tokens(self) -> int: ...

    @property
    def decode_graphs(self) -> DecodeGraphs | None: ...

    def step(self, batch: Sequence[SequenceInput]) -> StepOutput: ...

    def accept(self, slot: int, num_tokens: int) -> None: ...

    def rebind(self, caches: Sequence[Any]) -> None: ...

    def statistics(self) -> dict[str, Any]: ...

    def enable_decode_graphs(
        self, max_batch: int, *, capture: bool = True, use_triton: bool | None = None
    ) -> None: ...


def build_model(weights: ModelWeights, spec: ModelSpec, caches: Sequence[Any]) -> PagedModel:
    """The paged model of ``weights``' family over ``caches`` (one per tensor-parallel rank).

    ``caches``: :class:`~kvferry.pools.arena.CacheArena` or :class:`~kvferry.model.nemotron_h.DenseCache`,
    one per rank. :raises ~kvferry.errors.ConfigError: as the family's ``build``.
    """
    if isinstance(weights.args, KimiLinearArgs):
        return KimiLinearModel.build(weights, spec, caches)
    if isinstance(weights.args, NemotronHArgs):
        return Model.build(weights, spec, caches)
    raise ConfigError(f"no paged model for {type(weights.args).__name__}")
