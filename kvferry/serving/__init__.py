"""Serving: the public API that turns engines into a service (:func:`open_service`, :class:`Service`,
:class:`RequestHandle`), over one aggregated engine or disaggregated engines.

- :mod:`.handle`: one request as its caller holds it (tokens, cancel, the final result and its timing);
- :mod:`.backends`: what a service runs requests on (aggregated, or context engines + this generation engine);
- :mod:`.service`: the service (submission, admission into the engine's queue, statistics).
"""

from kvferry.serving.backends import DisaggOptions, check_fits
from kvferry.serving.handle import CompletionResult, FinishReason, RequestHandle, RequestTiming
from kvferry.serving.service import (
    Percentiles,
    PoolOccupancy,
    Service,
    ServiceConversation,
    ServiceStatistics,
    open_service,
)

__all__ = [
    "CompletionResult",
    "DisaggOptions",
    "FinishReason",
    "Percentiles",
    "PoolOccupancy",
    "RequestHandle",
    "RequestTiming",
    "Service",
    "ServiceConversation",
    "ServiceStatistics",
    "check_fits",
    "open_service",
]
