"""Serving: requests and their states, the scheduler, sampling, the anyio engine, and the runner that builds an
engine over the reference model (:func:`build_engine`).

Import direction: request -> scheduler / sampling -> engine -> runner (which brings in the model and the pools)
-> host_moves (offload and restore of a request off the event loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry._lazy import lazy_exports

if TYPE_CHECKING:
    from kvferry.engine.config import EngineConfig as EngineConfig
    from kvferry.engine.config import EngineStatistics as EngineStatistics
    from kvferry.engine.conversation import Conversation as Conversation
    from kvferry.engine.conversation import TurnStatistics as TurnStatistics
    from kvferry.engine.engine import Engine as Engine
    from kvferry.engine.generation import Generation as Generation
    from kvferry.engine.generation import GenerationStatistics as GenerationStatistics
    from kvferry.engine.host_moves import offload_request as offload_request
    from kvferry.engine.host_moves import restore_request as restore_request
    from kvferry.engine.model_runner import ModelRunner as ModelRunner
    from kvferry.engine.request import Request as Request
    from kvferry.engine.request import RequestState as RequestState
    from kvferry.engine.request import SamplingParams as SamplingParams
    from kvferry.engine.runner import BuiltEngine as BuiltEngine
    from kvferry.engine.runner import EngineOptions as EngineOptions
    from kvferry.engine.runner import build_engine as build_engine
    from kvferry.engine.sampling import accept_drafts as accept_drafts
    from kvferry.engine.sampling import sample_tokens as sample_tokens
    from kvferry.engine.scheduler import Scheduler as Scheduler
    from kvferry.engine.scheduler import SchedulerConfig as SchedulerConfig
    from kvferry.engine.scheduler import SchedulerStatistics as SchedulerStatistics

#: public name -> module that defines it
_LAZY: dict[str, str] = {
    "Request": "kvferry.engine.request",
    "RequestState": "kvferry.engine.request",
    "SamplingParams": "kvferry.engine.request",
    "Scheduler": "kvferry.engine.scheduler",
    "SchedulerConfig": "kvferry.engine.scheduler",
    "SchedulerStatistics": "kvferry.engine.scheduler",
    "accept_drafts": "kvferry.engine.sampling",
    "sample_tokens": "kvferry.engine.sampling",
    "Engine": "kvferry.engine.engine",
    "EngineConfig": "kvferry.engine.config",
    "EngineStatistics": "kvferry.engine.config",
    "Generation": "kvferry.engine.generation",
    "GenerationStatistics": "kvferry.engine.generation",
    "Conversation": "kvferry.engine.conversation",
    "TurnStatistics": "kvferry.engine.conversation",
    "ModelRunner": "kvferry.engine.model_runner",
    "BuiltEngine": "kvferry.engine.runner",
    "EngineOptions": "kvferry.engine.runner",
    "build_engine": "kvferry.engine.runner",
    "offload_request": "kvferry.engine.host_moves",
    "restore_request": "kvferry.engine.host_moves",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
