"""Transfer sessions: a synchronous core that decides, and an async edge that performs the I/O.

One transfer moves one request's cache from the context engine's ranks (the *writers*) into pages and a slot
the generation engine allocated (the protocol's messages are in :mod:`kvferry.disagg.protocol`; docs/design.md,
section "Disaggregation protocol", tells the same story for a reader of the whole system):

- the receiver (:class:`ReceiveSession`) grants the context peer the bytes the transfer writes (its transport
  refuses the peer's writes anywhere else) and sends a :class:`~kvferry.disagg.protocol.ReceiveRequest`;
- each writer (:class:`SendSession`, one per request on the context side, with a chunk list per writer)
  pushes its chunks with ``transport.write(..., notify=<its ChunkResult>)``; the transport delivers the notify
  only after the data landed. A failed write is reported as FAILED on the control channel, a chunk never
  posted because of a cancel as CANCELLED, and a writer with nothing to write reports one empty chunk: every
  writer reports every chunk;
- the receiver completes only when every expected writer reported all of its chunks. Never on a timeout.

Bounce: a writer given a staging area in the receive request may pack its fragments into its own staging
(:class:`~kvferry.disagg.staging.StagedWrite`, before its first chunk is posted) and write them as a few large
fragments into that area; its reports say ``staged``. The receiver scatters a writer's area into the pages once
every chunk of that writer landed OK, and completes only after every scatter. Staging areas follow the pages:
released when nothing can land any more, quarantined with them otherwise.

Cancellation is two-phase. A cancel stops posting; a receiver that cancels while writers are still to report
keeps its pages *quarantined* (out of the pools, never reallocated) and sends
:class:`~kvferry.disagg.protocol.CancelTransfer`. The pages come back when the first of these happens, each of
which means no write of the session can land any more:

- every writer has reported every chunk (the sender was pushing: it posts nothing more, and reports the rest
  CANCELLED);
- the sender answers :class:`~kvferry.disagg.protocol.CancelAck`: it was not pushing the session and never will
  (the receive request never reached it, or reached it before the push started, which the cancel then called
  off), or it had finished it (every write returned, hence landed, before the reports were sent);
- the transport says the peer is gone (its process died: nothing more can land).

So a cancel whose request never reached the sender costs its pages one round trip, not the connection's
life; only a CancelTransfer or an acknowledgement lost on a live connection keeps them out until it drops.
A stall deadline turns a silent peer into :class:`~kvferry.errors.TransferInDoubt` with the pages still
quarantined (no CancelTransfer is sent then, so only the reports or the peer's loss release them).

The modules: :mod:`.chunks` (the unit of posting and reporting), :mod:`.send_session` and
:mod:`.receive_session` (the cores: no I/O, never block; the receiver's states and their one transition
table), :mod:`.sender` (:func:`send`) and :mod:`.receiver` (:class:`Receiver`), which drive the cores over a
:class:`~kvferry.transports.Transport`.
"""

from kvferry.disagg.session.chunks import Chunk, split_chunks
from kvferry.disagg.session.receive_session import (
    RECEIVE_TRANSITIONS,
    CancelAction,
    ReceiveSession,
    ReceiveState,
    TransferStatistics,
)
from kvferry.disagg.session.receiver import PageHold, Receiver
from kvferry.disagg.session.send_session import SendSession
from kvferry.disagg.session.sender import send

__all__ = [
    "RECEIVE_TRANSITIONS",
    "CancelAction",
    "Chunk",
    "PageHold",
    "ReceiveSession",
    "ReceiveState",
    "Receiver",
    "SendSession",
    "TransferStatistics",
    "send",
    "split_chunks",
]
