"""Batch rows and state_indices (kvferry.pools.batch_rows): requests and attention-DP dummies."""

from __future__ import annotations

import pytest
import torch

from kvferry.errors import PoolExhausted, UnknownRequest
from kvferry.pools.batch_rows import BatchRows
from kvferry.pools.slots import DUMMY_SLOT
from tests.support.pools_factories import make_manager


def test_dummies_never_shift_real_rows() -> None:
    m = make_manager(num_pages=32, num_slots=8, max_batch_size=6)
    for rid in "abc":
        m.create(rid, [1, 2, 3])
        m.resume(rid)
    rows = {rid: m.batch_row(rid) for rid in "abc"}
    slots = {rid: m.slot_id(rid) for rid in "abc"}
    assert rows == {"a": 0, "b": 1, "c": 2}
    d1 = m.add_dummy()
    m.suspend("b")  # b's row is free again and reset to the dummy slot
    d2 = m.add_dummy()
    assert (d1, d2) == (3, 1)
    m.create("e", [4])
    m.resume("e")
    assert m.batch_row("e") == 4
    for rid in "ac":
        assert m.batch_row(rid) == rows[rid]
        assert m.state_indices[rows[rid]].item() == slots[rid]
    assert m.state_indices.tolist() == [
        slots["a"],
        DUMMY_SLOT,
        slots["c"],
        DUMMY_SLOT,
        m.slot_id("e"),
        DUMMY_SLOT,
    ]
    m.remove_dummy(d1)
    m.remove_dummy(d1)
    m.close("a")
    assert m.state_indices[0].item() == DUMMY_SLOT
    with pytest.raises(UnknownRequest):
        m.batch_row("a")
    assert m.batch_row("b") is None
    tensor = m.state_indices
    m.resume("b")
    assert m.batch_row("b") == 0 and m.state_indices is tensor


def test_batch_rows_run_out_without_side_effects() -> None:
    m = make_manager(num_pages=32, num_slots=8, max_batch_size=2)
    m.create("a", [1])
    m.create("b", [1])
    m.resume("a")
    m.add_dummy()
    before = m.debug_state()
    with pytest.raises(PoolExhausted):
        m.resume("b")
    with pytest.raises(PoolExhausted):
        m.add_dummy()
    assert m.debug_state() == before


def test_rows_are_written_to_state_indices_when_read() -> None:
    rows = BatchRows(4, torch.device("cpu"))
    tensor = rows.state_indices
    a, b = rows.take(5), rows.take(None)
    assert (a, b) == (0, 1)
    assert tensor.tolist() == [DUMMY_SLOT] * 4  # not written until read
    assert rows.state_indices is tensor and tensor.tolist() == [5, DUMMY_SLOT, DUMMY_SLOT, DUMMY_SLOT]
    rows.give_back(a)
    assert rows.add_dummy() == 0  # the lowest free row
    assert rows.state_indices.tolist() == [DUMMY_SLOT] * 4
    rows.remove_dummy(1)  # b's row is not a dummy's: left alone
    assert rows.num_dummies == 1 and "2/4 taken" in repr(rows)
