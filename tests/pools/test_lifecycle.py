"""The cache lifecycle (kvferry.pools.lifecycle): one transition table, the state each operation needs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvferry.errors import ConfigError, InvalidTransition, UnknownRequest
from kvferry.pools.blocks import root_hash
from kvferry.pools.lifecycle import REQUIRED_STATE, TRANSITIONS, CacheState, check_transition, require_state
from kvferry.pools.manager import CacheManager
from kvferry.pools.record import RequestRecord
from tests.support.pools_factories import make_manager


def test_the_table_names_every_state_and_closed_is_terminal() -> None:
    assert set(TRANSITIONS) == set(CacheState)
    assert TRANSITIONS[CacheState.CLOSED] == frozenset()
    for src in (CacheState.SUSPENDED, CacheState.ACTIVE):
        assert CacheState.CLOSED in TRANSITIONS[src]
    check_transition(CacheState.SUSPENDED, CacheState.ACTIVE)
    check_transition(CacheState.ACTIVE, CacheState.SUSPENDED)
    with pytest.raises(InvalidTransition):
        check_transition(CacheState.CLOSED, CacheState.ACTIVE)
    with pytest.raises(InvalidTransition):
        check_transition(CacheState.SUSPENDED, CacheState.SUSPENDED)


def state_of(record: RequestRecord) -> CacheState:
    """The record's state, read through a call so that mypy keeps it a CacheState after a transition."""
    return record.state


def test_a_record_moves_only_through_the_table() -> None:
    record = RequestRecord(request_id="a", prompt=[1], parent=root_hash())
    assert record.state is CacheState.SUSPENDED
    record.transition(CacheState.ACTIVE)
    record.transition(CacheState.CLOSED)
    with pytest.raises(InvalidTransition):
        record.transition(CacheState.SUSPENDED)
    assert state_of(record) is CacheState.CLOSED
    assert "closed" in repr(record)


def test_require_state_says_what_the_operation_needs() -> None:
    require_state("a", CacheState.ACTIVE, "commit")
    with pytest.raises(InvalidTransition, match="grow of 'a': it is suspended, not active"):
        require_state("a", CacheState.SUSPENDED, "grow")
    with pytest.raises(InvalidTransition, match="resume of 'a': it is active, not suspended"):
        require_state("a", CacheState.ACTIVE, "resume")


def operate(m: CacheManager, operation: str) -> None:
    calls: dict[str, Callable[[], object]] = {
        "resume": lambda: m.resume("a"),
        "offload": lambda: m.offload("a"),
        "pin": lambda: m.pin("a"),
        "extend": lambda: m.extend("a", [1, 2, 3, 4]),
        "restore": lambda: m.start_restore("a"),
        "grow": lambda: m.grow("a", 8),
        "commit": lambda: m.commit("a", [1]),
        "suspend": lambda: m.suspend("a"),
    }
    calls[operation]()


@pytest.mark.parametrize("operation", sorted(REQUIRED_STATE))
def test_every_operation_refuses_the_other_state_and_changes_nothing(operation: str) -> None:
    m = make_manager()
    m.create("a", [1, 2, 3])
    if REQUIRED_STATE[operation] is CacheState.SUSPENDED:
        m.resume("a")
    before = m.debug_state()
    with pytest.raises(InvalidTransition):
        operate(m, operation)
    assert m.debug_state() == before
    m.close("a")
    with pytest.raises(UnknownRequest):  # closed requests are forgotten
        operate(m, operation)


def test_extend_takes_a_longer_prompt_that_starts_with_the_committed_tokens() -> None:
    m = make_manager()
    m.create("a", [1, 2, 3])
    m.resume("a")
    m.commit("a", [1, 2, 3])
    m.suspend("a")
    before = m.debug_state()
    for bad in ([1, 2, 3], [1, 2], [1, 9, 3, 4]):
        with pytest.raises(ConfigError):
            m.extend("a", bad)
        assert m.debug_state() == before
    m.extend("a", [1, 2, 3, 4, 5])
    m.resume("a")
    m.grow("a", 5)
    with pytest.raises(InvalidTransition):  # commits are checked against the new prompt
        m.commit("a", [9])
    m.commit("a", [4, 5])
    assert m.num_committed_tokens("a") == 5
