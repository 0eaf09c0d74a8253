"""The channel transport's own life (``kvferry.transports.channel``): one state enum, one transition table."""

from __future__ import annotations

from typing import Any

import pytest

from kvferry.errors import ClosedResourceError, InvalidTransition
from kvferry.transports.channel import TRANSITIONS, ChannelTransport, TransportState
from kvferry.transports.local import LocalTransport

pytestmark = pytest.mark.anyio


def state_of(transport: ChannelTransport[Any]) -> TransportState:
    return transport.state


def test_the_transition_table_names_every_state_and_ends_in_closed() -> None:
    assert set(TRANSITIONS) == set(TransportState)
    assert TRANSITIONS[TransportState.CLOSED] == frozenset()
    # every state but CLOSED leads on, and every way leads to CLOSED
    for state in TransportState:
        seen, todo = set(), {state}
        while todo:
            seen |= todo
            todo = {n for s in todo for n in TRANSITIONS[s]} - seen
        assert TransportState.CLOSED in seen


async def test_a_transport_goes_new_open_closed_and_says_where_it_is() -> None:
    transport = LocalTransport()
    assert state_of(transport) is TransportState.NEW and "[new |" in repr(transport)
    with pytest.raises(ClosedResourceError, match="new, not open"):
        _ = transport.address
    await transport.start()
    assert state_of(transport) is TransportState.OPEN and transport.is_open and "[open |" in repr(transport)
    with pytest.raises(ClosedResourceError, match="already started"):
        await transport.start()
    await transport.aclose()
    assert state_of(transport) is TransportState.CLOSED and "[closed |" in repr(transport)
    await transport.aclose()  # idempotent
    with pytest.raises(ClosedResourceError, match="closed, not open"):
        await transport.connect("local://127.0.0.1:1")


async def test_a_transport_closed_before_it_started_stays_closed() -> None:
    transport = LocalTransport()
    await transport.aclose()
    assert state_of(transport) is TransportState.CLOSED
    with pytest.raises(ClosedResourceError, match="already started"):
        await transport.start()


def test_a_move_outside_the_table_is_refused_and_changes_nothing() -> None:
    transport = LocalTransport()
    with pytest.raises(InvalidTransition, match="NEW -> OPEN"):
        transport._move(TransportState.OPEN)
    assert state_of(transport) is TransportState.NEW
