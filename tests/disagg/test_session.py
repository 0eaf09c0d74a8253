"""Session cores: chunks, the sender's and the receiver's synchronous state (no I/O), reports that overtake
the receive request, and reports that travel together."""

from __future__ import annotations

import numpy as np
import pytest

from kvferry.disagg.protocol import (
    CancelAck,
    ChunkResult,
    ChunkResults,
    ChunkStatus,
    decode_control,
    encode_control,
    reports_of,
)
from kvferry.disagg.session import (
    RECEIVE_TRANSITIONS,
    Chunk,
    ReceiveSession,
    ReceiveState,
    SendSession,
    split_chunks,
)
from kvferry.errors import (
    InvalidTransition,
    WireFormatError,
)
from tests.support.disagg_session import ok, state_of

pytestmark = pytest.mark.timeout(60)


def test_split_chunks_keeps_every_byte_and_honours_the_limit() -> None:
    src = np.array([[0, 10], [100, 10], [110, 30], [500, 64]], dtype=np.uint64)
    dst = np.array([[1000, 10], [2000, 10], [2010, 30], [3000, 64]], dtype=np.uint64)
    chunks = split_chunks(2, src, dst, max_bytes=40)
    # [100,10]+[110,30] coalesce into one 40-byte row; the 64-byte row is a chunk of its own
    assert [c.src.tolist() for c in chunks] == [[[0, 10]], [[100, 40]], [[500, 64]]]
    assert [c.dst.tolist() for c in chunks] == [[[1000, 10]], [[2000, 40]], [[3000, 64]]]
    assert all(c.dst_rank == 2 for c in chunks)
    assert split_chunks(0, src, dst, max_bytes=1 << 20)[0].nbytes == 114


def test_receive_session_completes_only_when_every_writer_reported_everything() -> None:
    s = ReceiveSession(7, "k", (0, 1))
    s.requested()
    s.on_result(ok(7, 0, 0, 2))
    s.on_result(ok(7, 1, 0, 1))
    assert state_of(s) is ReceiveState.REQUESTED and s.outstanding == 1
    s.on_result(ok(7, 0, 1, 2))
    assert state_of(s) is ReceiveState.COMPLETE
    assert s.statistics().nbytes == 24


def test_receive_session_failure_waits_for_every_writer() -> None:
    s = ReceiveSession(1, "k", (0, 1))
    s.requested()
    s.on_result(ok(1, 0, 0, 1, ChunkStatus.FAILED))
    assert state_of(s) is ReceiveState.REQUESTED  # writer 1 may still write
    s.on_result(ok(1, 1, 0, 1))
    assert state_of(s) is ReceiveState.FAILED and "writer 0" in s.detail


def test_receive_session_refuses_strangers_and_inconsistent_counts() -> None:
    s = ReceiveSession(1, "k", (0,))
    s.requested()
    with pytest.raises(WireFormatError):
        s.on_result(ok(1, 3, 0, 1))
    s.on_result(ok(1, 0, 0, 2))
    with pytest.raises(WireFormatError):
        s.on_result(ok(1, 0, 1, 3))
    assert state_of(s) is ReceiveState.REQUESTED


def test_receive_session_cancel_paths() -> None:
    fresh = ReceiveSession(1, "k", (0,))
    assert fresh.cancel().value == "free" and state_of(fresh) is ReceiveState.CANCELLED
    asked = ReceiveSession(2, "k", (0,))
    asked.requested()
    assert asked.cancel().value == "quarantine" and state_of(asked) is ReceiveState.CANCELLING
    asked.on_result(ok(2, 0, 0, 1))  # the late report settles it
    assert state_of(asked) is ReceiveState.CANCELLED
    stalled = ReceiveSession(3, "k", (0,))
    stalled.requested()
    assert stalled.stalled() and state_of(stalled) is ReceiveState.IN_DOUBT
    stalled.peer_lost("gone")
    assert state_of(stalled) is ReceiveState.CANCELLED


def test_send_session_cancel_reports_the_unposted() -> None:
    chunk = Chunk(0, np.array([[0, 8]], dtype=np.uint64), np.array([[0, 8]], dtype=np.uint64))
    s = SendSession(4, {0: [chunk, chunk, chunk], 1: []})
    assert s.next_post(0) == (0, chunk)
    assert s.next_post(1) == (0, None)
    s.finish_post(1, 0, s.result(1, 0, ChunkStatus.OK))
    s.cancel()
    assert s.next_post(0) is None and not s.finished  # chunk 0 is still in flight
    s.finish_post(0, 0, s.result(0, 0, ChunkStatus.OK))
    cancelled = s.unposted(0)
    assert [(r.chunk, r.status) for r in cancelled] == [
        (1, ChunkStatus.CANCELLED),
        (2, ChunkStatus.CANCELLED),
    ]
    assert s.finished and not s.ok


def test_reports_recorded_before_requested_settle_it() -> None:
    s = ReceiveSession(5, "k", (0, 1))
    s.on_result(ok(5, 0, 0, 1))
    s.on_result(ok(5, 1, 0, 1))
    assert state_of(s) is ReceiveState.ALLOCATED  # nothing was asked yet: nothing settles
    s.requested()
    assert state_of(s) is ReceiveState.COMPLETE and s.statistics().nbytes == 16


def test_every_receive_state_has_its_moves_and_terminal_states_none() -> None:
    """The one transition table covers every state; terminal states go nowhere, and a move that is not in the
    table raises InvalidTransition and changes nothing."""
    assert set(RECEIVE_TRANSITIONS) == set(ReceiveState)
    for state, moves in RECEIVE_TRANSITIONS.items():
        assert (not moves) is state.is_terminal
    s = ReceiveSession(1, "k", (0,))
    s.requested()
    s.on_result(ok(1, 0, 0, 1))
    assert state_of(s) is ReceiveState.COMPLETE
    with pytest.raises(InvalidTransition):
        s.requested()
    assert state_of(s) is ReceiveState.COMPLETE


def test_chunk_results_travel_together_and_are_checked_one_by_one() -> None:
    """Several writers' reports in one message decode to the same reports; a batch that is empty, mixes
    sessions or holds a malformed report is refused whole (WireFormatError), before any report is used."""
    reports = (ok(5, 0, 0, 1), ok(5, 1, 0, 2), ok(5, 1, 1, 2, ChunkStatus.FAILED))
    decoded = decode_control(encode_control(ChunkResults(reports)))
    assert isinstance(decoded, ChunkResults) and decoded.results == reports
    assert reports_of(decoded) == reports and reports_of(reports[0]) == (reports[0],)
    assert reports_of(CancelAck(5)) == ()
    for bad in (
        ChunkResults(()),
        ChunkResults((ok(5, 0, 0, 1), ok(6, 0, 0, 1))),
        ChunkResults((ok(5, 0, 0, 1), ChunkResult(5, 1, 3, 2, ChunkStatus.OK))),  # chunk past its count
    ):
        with pytest.raises(WireFormatError):
            decode_control(encode_control(bad))
