"""Engine roles: a context worker prefills and hands off; a generation worker receives and decodes.

Both wrap an :class:`~kvferry.engine.engine.Engine` built by :func:`~kvferry.engine.runner.build_engine` and
change nothing inside it: each swaps the engine's cache for a :class:`HandoffCache` adapter (the context side
*holds* a prefilled request for its push, the generation side *adopts* a transferred one).

- :mod:`.handoff_cache`: :class:`HandoffCache`, the engine's cache with hold and adopt;
- :mod:`.worker`: what both roles share (staging pool, its memory's registration, kept current across
  rebalances, the handshake's description, the default deadlines);
- :mod:`.context`: :class:`ContextWorker`, which prefills, answers and pushes;
- :mod:`.generation`: :class:`GenerationWorker`, which asks for prefills, receives and adopts.

Deadlines: every wait on the peer is bounded and ends in a typed error. The generation side waits for a prefill's
answer until its context engine answered nothing for ``prefill_timeout`` (:class:`~kvferry.errors.PrefillTimeout`; the context side is then
told to drop the request, which stops its prefill or frees its held cache), ``stall_timeout`` between a
transfer's reports, ``handshake_timeout`` for the handshake (both sides, :class:`~kvferry.errors.PeerTimeout`),
``control_timeout`` for a best-effort control message; the context side holds a prefilled cache at most
``hold_timeout`` for its receive request. Sends and writes are bounded by the transport's stall deadline.

Bounce: each worker owns one bounded :class:`~kvferry.disagg.staging.StagingPool` (``staging_bytes``, on the
arenas' device). The generation side offers staging areas to writers whose bytes land fragmented; a context
writer bounces when it was offered an area, its own policy finds its plan fragmented and its own pool has room.
Anything short of that is a direct write: a full pool costs speed, never a transfer, and the tokens are the
same either way.
"""

from kvferry.disagg.roles.context import ContextWorker
from kvferry.disagg.roles.generation import GenerationWorker, Handoff
from kvferry.disagg.roles.handoff_cache import HandoffCache
from kvferry.disagg.roles.worker import (
    DEFAULT_CONTROL_TIMEOUT,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_PREFILL_TIMEOUT,
    DEFAULT_STAGING_BYTES,
    Worker,
)

__all__ = [
    "DEFAULT_CONTROL_TIMEOUT",
    "DEFAULT_HANDSHAKE_TIMEOUT",
    "DEFAULT_PREFILL_TIMEOUT",
    "DEFAULT_STAGING_BYTES",
    "ContextWorker",
    "GenerationWorker",
    "Handoff",
    "HandoffCache",
    "Worker",
]
