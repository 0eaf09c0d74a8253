"""kvferry: the whole cache of a hybrid LLM, correct through every turn of a request, and ferried between engines.

The public API is re-exported here and imported on first use, so ``import kvferry`` stays cheap and never
imports torch's heavier corners, nixl, ucxx or transformers::

    import kvferry

    spec = kvferry.preset("tiny")
    layout = kvferry.CacheLayout.build(spec.shard(2, 0), num_pages=64, num_slots=8, num_draft_pages=32)
    transport = kvferry.get_transport("auto")
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry._lazy import lazy_exports
from kvferry.errors import *  # noqa: F403
from kvferry.errors import __all__ as _errors_all

if TYPE_CHECKING:
    from kvferry.engine.config import EngineStatistics as EngineStatistics
    from kvferry.engine.conversation import Conversation as Conversation
    from kvferry.engine.conversation import TurnStatistics as TurnStatistics
    from kvferry.engine.engine import Engine as Engine
    from kvferry.engine.generation import Generation as Generation
    from kvferry.engine.generation import GenerationStatistics as GenerationStatistics
    from kvferry.engine.runner import BuiltEngine as BuiltEngine
    from kvferry.engine.runner import EngineOptions as EngineOptions
    from kvferry.engine.runner import build_engine as build_engine
    from kvferry.pools.arena import CacheArena as CacheArena
    from kvferry.pools.layout import CacheLayout as CacheLayout
    from kvferry.pools.manager import CacheManager as CacheManager
    from kvferry.pools.pagetable import PageTable as PageTable
    from kvferry.pools.spec import ModelSpec as ModelSpec
    from kvferry.pools.spec import RankSpec as RankSpec
    from kvferry.pools.spec import preset as preset
    from kvferry.serving import CompletionResult as CompletionResult
    from kvferry.serving import DisaggOptions as DisaggOptions
    from kvferry.serving import FinishReason as FinishReason
    from kvferry.serving import RequestHandle as RequestHandle
    from kvferry.serving import Service as Service
    from kvferry.serving import ServiceConversation as ServiceConversation
    from kvferry.serving import ServiceStatistics as ServiceStatistics
    from kvferry.serving import open_service as open_service
    from kvferry.transports.base import Transport as Transport
    from kvferry.transports.registry import get_transport as get_transport

__version__ = "0.1.0"

#: public name -> module that defines it
_LAZY: dict[str, str] = {
    "ModelSpec": "kvferry.pools.spec",
    "RankSpec": "kvferry.pools.spec",
    "preset": "kvferry.pools.spec",
    "CacheLayout": "kvferry.pools.layout",
    "CacheArena": "kvferry.pools.arena",
    "PageTable": "kvferry.pools.pagetable",
    "CacheManager": "kvferry.pools.manager",
    "Transport": "kvferry.transports.base",
    "get_transport": "kvferry.transports.registry",
    "Engine": "kvferry.engine.engine",
    "Generation": "kvferry.engine.generation",
    "EngineStatistics": "kvferry.engine.config",
    "GenerationStatistics": "kvferry.engine.generation",
    "Conversation": "kvferry.engine.conversation",
    "TurnStatistics": "kvferry.engine.conversation",
    "EngineOptions": "kvferry.engine.runner",
    "BuiltEngine": "kvferry.engine.runner",
    "build_engine": "kvferry.engine.runner",
    "open_service": "kvferry.serving",
    "Service": "kvferry.serving",
    "ServiceConversation": "kvferry.serving",
    "ServiceStatistics": "kvferry.serving",
    "RequestHandle": "kvferry.serving",
    "CompletionResult": "kvferry.serving",
    "FinishReason": "kvferry.serving",
    "DisaggOptions": "kvferry.serving",
}

__all__ = ["__version__", *_errors_all, *_LAZY]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
