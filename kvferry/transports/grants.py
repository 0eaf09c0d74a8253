"""Grants on the control channel: what we let each peer write into, and what each peer lets us write into.

A grant (:meth:`~kvferry.transports.Transport.grant`) is one or more ``GRANT`` frames (:class:`WriteGrant`: an
id and ``(address, length)`` rows, at most :data:`~kvferry.transports.messages.MAX_GRANT_FRAGMENTS` each) to
one peer, ended by a ``REVOKE`` frame per id. Two tables per peer hold them (:class:`ChannelPeer`):
``peer.granted``, what we granted it (a two-sided receiver checks the peer's writes against it), and
``peer.grants``, what it granted us (every write of ours to it is checked against it before a byte moves).

The life of one of our grants::

    grant() ──> ids recorded in peer.granted ──> GRANT frames sent ─────────────> revoke() ──> REVOKE frames
       │ defer=True: the GRANT frames wait in the peer's outbox, ahead of whatever we send it next
       └──> revoked while they still wait there: taken back out, nothing sent (the peer never learns of it)

A peer's grants end with its connection; ours also end when memory they cover is deregistered.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import suppress
from typing import TYPE_CHECKING

import anyio
import numpy.typing as npt

from kvferry import wire
from kvferry.errors import RegionError, TransportError, WireFormatError
from kvferry.transports import messages
from kvferry.transports._memory import union_of
from kvferry.transports.base import Fragments, Grant, Peer, PeerState, Registration, as_fragments
from kvferry.transports.messages import (
    FrameKind,
    WriteGrant,
    WriteRevoke,
    fragments_bytes,
    fragments_from_bytes,
)

if TYPE_CHECKING:
    from kvferry.transports.channel import ChannelTransport
    from kvferry.transports.datapath import DataPath
    from kvferry.transports.messages import Frame
    from kvferry.transports.peers import ChannelPeer

__all__ = ["ChannelGrant", "GrantLedger"]

log = logging.getLogger("kvferry.transports")


class ChannelGrant(Grant):
    """A grant of a :class:`~kvferry.transports.channel.ChannelTransport`: one or more wire grants (ids) to one
    peer."""

    __slots__ = ("_active", "_fragments", "_peer", "frames", "ids", "ledger")

    def __init__(
        self,
        ledger: GrantLedger,
        peer: ChannelPeer,
        ids: tuple[int, ...],
        fragments: Fragments,
        frames: Sequence[Frame] = (),
    ) -> None:
        self.ledger = ledger
        self._peer = peer
        self.ids = ids
        self._fragments = fragments
        #: its GRANT frames (the very objects: a deferred grant's may still wait in the peer's outbox)
        self.frames = tuple(frames)
        self._active = True

    @property
    def peer(self) -> Peer:
        return self._peer

    @property
    def fragments(self) -> Fragments:
        return self._fragments

    @property
    def active(self) -> bool:
        return self._active and self._peer.state is PeerState.CONNECTED

    async def revoke(self) -> None:
        if self._active:
            self._active = False
            await self.ledger.revoke(self)

    def revoke_nowait(self) -> None:
        if self._active:
            self._active = False
            self.ledger.revoke_nowait(self)

    def __repr__(self) -> str:
        state = "active" if self.active else "revoked"
        return f"<Grant to {self._peer.address} [{len(self._fragments)} ranges | {state}]>"


class GrantLedger:
    """The grants of one transport: ours to each peer (as :class:`ChannelGrant` handles), and the ``GRANT`` /
    ``REVOKE`` frames peers send us."""

    def __init__(self, transport: ChannelTransport[DataPath]) -> None:
        self.transport = transport
        self._next_grant_id = 1
        #: our live grants, per peer (peers lost since are dropped at the next grant)
        self._grants: dict[ChannelPeer, set[ChannelGrant]] = {}

    @property
    def live(self) -> int:
        """Grants of ours live now, to every connected peer."""
        return sum(len(g) for p, g in self._grants.items() if p.state is PeerState.CONNECTED)

    # --- ours --------------------------------------------------------------------------------------------

    async def grant(self, p: ChannelPeer, fragments: npt.ArrayLike | Registration, *, defer: bool) -> Grant:
        """:meth:`~kvferry.transports.Transport.grant` to a live peer."""
        if isinstance(fragments, Registration):
            if not fragments.active:
                raise RegionError("cannot grant a deregistered registration")
            rows = fragments.fragments()
        else:
            rows = as_fragments(fragments)
        # what travels (and what is checked) is the union: rows that overlap or touch merged, in address order
        merged = union_of(rows)
        what = f"memory granted to {p.address}"
        own = self.transport.own_regions
        try:  # the merged ranges first (fewer rows)
            own.locate(merged, what)
        except RegionError:  # names the first row outside; or each lies in a region, a merged one across two
            own.locate(rows, what)
        step = messages.MAX_GRANT_FRAGMENTS
        pieces = [merged[i : i + step] for i in range(0, len(merged), step)] or [merged]
        if len(p.granted) + len(pieces) > messages.MAX_LIVE_GRANTS:
            raise TransportError(
                f"{p.address} holds {len(p.granted)} grants from us, at most {messages.MAX_LIVE_GRANTS} may be "
                "live: revoke some first"
            )
        ids = tuple(range(self._next_grant_id, self._next_grant_id + len(pieces)))
        self._next_grant_id += len(pieces)
        # ours first: a two-sided receiver checks the peer's writes against these, and the peer may write as
        # soon as the frame is out
        for grant_id, piece in zip(ids, pieces, strict=True):
            p.granted.add(grant_id, piece)
        frames = [
            (FrameKind.GRANT, wire.encode(WriteGrant(i, fragments_bytes(piece))))
            for i, piece in zip(ids, pieces, strict=True)
        ]
        control = self.transport.control
        if defer:  # ahead of the next frame we send the peer (the caller's message), or by a task right after
            control.queue(p, frames)
        else:
            try:
                # whole or not at all: a cancel waiting for the channel sends nothing, a frame cut midway loses
                # the peer
                await control.send_frames(p, frames)
            except BaseException:
                for grant_id in ids:
                    p.granted.remove(grant_id)
                raise
        grant = ChannelGrant(self, p, ids, rows, frames)
        for other in [q for q in self._grants if q.state is not PeerState.CONNECTED]:
            del self._grants[other]
        self._grants.setdefault(p, set()).add(grant)
        return grant

    async def revoke(self, grant: ChannelGrant) -> None:
        """End ``grant`` (:meth:`ChannelGrant.revoke`); shielded."""
        with anyio.CancelScope(shield=True):
            if self._forget(grant) and not self._withdraw(grant):
                with suppress(TransportError):  # the peer is gone: its grants went with it
                    await self.transport.control.send_frames(grant._peer, self._revoke_frames(grant))

    def revoke_nowait(self, grant: ChannelGrant) -> None:
        """End ``grant`` without waiting for the channel (:meth:`ChannelGrant.revoke_nowait`)."""
        if self._forget(grant) and not self._withdraw(grant):
            self.transport.control.queue(grant._peer, self._revoke_frames(grant))

    async def revoke_unregistered(self) -> None:
        """Revoke our grants that are no longer inside registered memory (a registration at the same addresses
        later must not revive them)."""
        own = self.transport.own_regions
        for grants in list(self._grants.values()):
            for grant in list(grants):
                rows = grant.fragments
                if len(rows) and int(own.holding(rows).min()) < 0:
                    log.debug(
                        "%s: revoking %r: its memory was deregistered", self.transport.instance_id, grant
                    )
                    await grant.revoke()

    def _forget(self, grant: ChannelGrant) -> bool:
        """Drop ``grant`` on our side (our checks refuse from now on); True when its peer is to be told."""
        p = grant._peer
        self._grants.get(p, set()).discard(grant)
        for grant_id in grant.ids:
            p.granted.remove(grant_id)
        self.transport.data_path.revoked(p)
        return p.state is PeerState.CONNECTED and self.transport.is_open

    @staticmethod
    def _revoke_frames(grant: ChannelGrant) -> list[Frame]:
        return [(FrameKind.REVOKE, wire.encode(WriteRevoke(i))) for i in grant.ids]

    @staticmethod
    def _withdraw(grant: ChannelGrant) -> bool:
        """Take a deferred grant's GRANT frames back out of its peer's outbox if they still wait there (the peer
        never learns of the grant: nothing to revoke); True if they did."""
        outbox = grant._peer.outbox
        if not grant.frames or not any(f is grant.frames[0] for f in outbox):
            return False  # sent (frames leave the outbox all at once, under the send lock)
        mine = {id(f) for f in grant.frames}
        outbox[:] = [f for f in outbox if id(f) not in mine]
        return True

    # --- the peer's ----------------------------------------------------------------------------------------

    def received(self, peer: ChannelPeer, kind: int, body: bytes) -> None:
        """A GRANT or REVOKE frame of ``peer``: what our writes to it may write into.

        :raises ~kvferry.errors.WireFormatError: a malformed frame, an id granted twice, a revoke of an id that
            is not live, or one grant past :data:`~kvferry.transports.messages.MAX_LIVE_GRANTS` (the peer is
            dropped).
        """
        if kind == FrameKind.GRANT:
            grant = wire.decode(body, WriteGrant)
            rows = fragments_from_bytes(grant.fragments)
            if grant.grant_id in peer.grants:
                raise WireFormatError(f"{peer.address} reused grant id {grant.grant_id}")
            if len(peer.grants) >= messages.MAX_LIVE_GRANTS:
                raise WireFormatError(
                    f"{peer.address} holds more than {messages.MAX_LIVE_GRANTS} live grants"
                )
            peer.grants.add(grant.grant_id, rows)
            return
        revoke = wire.decode(body, WriteRevoke)
        if not peer.grants.remove(revoke.grant_id):
            raise WireFormatError(f"{peer.address} revoked grant {revoke.grant_id}, which is not live")

    def __repr__(self) -> str:
        return f"<GrantLedger [{self.live} live grants of ours | next id {self._next_grant_id}]>"
