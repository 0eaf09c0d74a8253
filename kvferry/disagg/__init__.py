"""Disaggregated serving: a context engine hands each request's whole cache to a generation engine.

The modules, from the wire up (each imports only those above it):

- :mod:`.protocol`: what the two engines say to each other (handshake, control messages, chunk reports);
- :mod:`.mapping`: which bytes of a context rank go where on a generation rank (TP shard maths, pieces,
  layouts, plans);
- :mod:`.staging`: bounded staging memory and the two halves of a bounced transfer;
- :mod:`.session`: one transfer's life on each side (the synchronous cores and the async edges that drive
  them over a transport);
- :mod:`.transfer`: from a receive request to each writer's chunks;
- :mod:`.link`: the handshake and the reader of one connected peer;
- :mod:`.roles`: the context and generation workers around an engine;
- :mod:`.router`: one ``generate()`` stream over both engines;
- :mod:`.serve`: running the roles (a context engine in its own process, or both in one).

The entry points are re-exported here and imported on first use, so importing one module (the protocol, say)
does not import the engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry._lazy import lazy_exports

if TYPE_CHECKING:
    from kvferry.disagg.mapping import BouncePolicy as BouncePolicy
    from kvferry.disagg.mapping import PeerMap as PeerMap
    from kvferry.disagg.roles import ContextWorker as ContextWorker
    from kvferry.disagg.roles import GenerationWorker as GenerationWorker
    from kvferry.disagg.router import RoutedGeneration as RoutedGeneration
    from kvferry.disagg.router import Router as Router
    from kvferry.disagg.serve import ContextProcess as ContextProcess
    from kvferry.disagg.serve import disaggregated as disaggregated
    from kvferry.disagg.serve import start_context_process as start_context_process

#: public name -> module that defines it
_LAZY: dict[str, str] = {
    "BouncePolicy": "kvferry.disagg.mapping",
    "PeerMap": "kvferry.disagg.mapping",
    "ContextWorker": "kvferry.disagg.roles",
    "GenerationWorker": "kvferry.disagg.roles",
    "RoutedGeneration": "kvferry.disagg.router",
    "Router": "kvferry.disagg.router",
    "ContextProcess": "kvferry.disagg.serve",
    "disaggregated": "kvferry.disagg.serve",
    "start_context_process": "kvferry.disagg.serve",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
