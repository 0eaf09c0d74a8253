"""Random lifecycles against the CacheManager: accounting and exclusive ownership hold after every step."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvferry.errors import PoolExhausted, RebalanceRefused
from kvferry.pools.blocks import hash_block
from kvferry.pools.manager import CacheManager, CacheState, Offload, Quarantine
from kvferry.pools.slots import DUMMY_SLOT
from tests.support.pools_factories import DRAFT_TPB, TPB, make_arena

IDS = [f"r{i}" for i in range(6)]
# common prefixes and a two-letter alphabet make shared blocks (and so reuse and snapshots) common
prompts = st.builds(
    lambda prefix, rest: prefix + rest,
    st.sampled_from([[], [0, 1, 1, 0], [0, 1, 1, 0, 1, 1, 1, 1]]),
    st.lists(st.integers(0, 1), max_size=10),
).filter(bool)


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        arena = make_arena(num_pages=16, num_slots=6, num_draft_pages=9, max_replay_tokens=2)
        self.m = CacheManager.for_arena(arena, max_batch_size=4, snapshot_interval=4)
        self.initial = self.m.statistics()
        self.quarantines: list[Quarantine] = []
        self.dummies: list[int] = []

    # --- helpers -----------------------------------------------------------------------------------------

    def _live(self) -> list[str]:
        return [rid for rid in IDS if rid in self.m.request_ids()]

    def _in(self, state: CacheState) -> list[str]:
        return [rid for rid in self._live() if self.m.state(rid) is state]

    def _unchanged_on_exhaustion(self, action: object) -> None:
        before = self.m.debug_state()
        try:
            action()  # type: ignore[operator]
        except PoolExhausted:
            assert self.m.debug_state() == before

    # --- rules -------------------------------------------------------------------------------------------

    @rule(rid=st.sampled_from(IDS), prompt=prompts, reuse=st.booleans())
    def create(self, rid: str, prompt: list[int], reuse: bool) -> None:
        if rid in self.m.request_ids():
            return
        self.m.create(rid, prompt, reuse=reuse)
        assert self.m.reused_tokens(rid) <= len(prompt) - 1

    @rule(
        rid=st.sampled_from(IDS),
        prompt=prompts,
        then=st.sampled_from(["close", "suspend", "stay"]),
        draft=st.booleans(),
    )
    def serve_prompt(self, rid: str, prompt: list[int], then: str, draft: bool) -> None:
        """create + resume + prefill in chunks that end at snapshot boundaries (+ the drafter's catch-up and
        one decode): what makes reuse of target and draft blocks happen."""
        if rid in self.m.request_ids():
            return
        self.m.create(rid, prompt)
        try:
            done = self.m.resume(rid).reused_tokens
        except PoolExhausted:
            self.m.close(rid)
            return
        while done < len(prompt):
            boundary = self.m.next_snapshot_boundary(rid)
            end = len(prompt) if boundary is None else min(boundary, len(prompt))
            self.m.commit(rid, prompt[done:end])
            done = end
        if draft:
            self.m.commit_draft(rid, self.m.reused_tokens(rid), done)
            try:
                self.m.grow(rid, done + 1)
            except PoolExhausted:
                pass
            else:
                self.m.commit(rid, [1])  # the token the drafter's last position was computed with
        if then == "close":
            self.m.close(rid)
        elif then == "suspend":
            self.m.suspend(rid)

    @rule(data=st.data(), extra=st.integers(0, 6))
    def resume(self, data: st.DataObject, extra: int) -> None:
        candidates = self._in(CacheState.SUSPENDED)
        if not candidates:
            return
        rid = data.draw(st.sampled_from(candidates))
        capacity = self.m.capacity(rid) + extra
        self._unchanged_on_exhaustion(lambda: self.m.resume(rid, capacity=capacity))

    @rule(data=st.data(), extra=st.integers(1, 8))
    def grow(self, data: st.DataObject, extra: int) -> None:
        candidates = self._in(CacheState.ACTIVE)
        if not candidates:
            return
        rid = data.draw(st.sampled_from(candidates))
        self._unchanged_on_exhaustion(lambda: self.m.grow(rid, self.m.capacity(rid) + extra))

    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        candidates = self._in(CacheState.ACTIVE)
        if not candidates:
            return
        rid = data.draw(st.sampled_from(candidates))
        req = self.m._requests[rid]
        room = req.capacity - len(req.tokens)
        if room <= 0:
            return
        boundary = self.m.next_snapshot_boundary(rid)
        counts = st.integers(1, room)
        if boundary is not None and 0 < boundary - len(req.tokens) <= room:
            counts = st.just(boundary - len(req.tokens)) | counts
        count = data.draw(counts)
        start = len(req.tokens)
        tokens = [
            req.prompt[i] if i < len(req.prompt) else data.draw(st.integers(0, 1))
            for i in range(start, start + count)
        ]
        total = start + count
        pending = data.draw(st.just(0) | st.integers(0, min(3, total - req.state_tokens)))
        self.m.commit(rid, tokens, num_pending_replay=pending)

    @rule(data=st.data())
    def commit_draft(self, data: st.DataObject) -> None:
        candidates = self._in(CacheState.ACTIVE)
        if not candidates:
            return
        rid = data.draw(st.sampled_from(candidates))
        req = self.m._requests[rid]
        committed = len(req.tokens)
        start = data.draw(st.sampled_from(sorted({min(req.draft_valid, committed), req.reused_tokens})))
        end = data.draw(st.integers(start, committed))
        before = req.draft_valid
        # the zero-filled gap counts as final once KV from its end on is
        final = max(before, req.draft_zeroed[1])
        self.m.commit_draft(rid, start, end)
        assert req.draft_valid == (end if start <= final < end else before)

    @rule(data=st.data(), offload=st.sampled_from(Offload))
    def suspend(self, data: st.DataObject, offload: Offload) -> None:
        candidates = self._in(CacheState.ACTIVE)
        if candidates:
            self.m.suspend(data.draw(st.sampled_from(candidates)), offload=offload)

    @rule(data=st.data())
    def offload(self, data: st.DataObject) -> None:
        candidates = self._in(CacheState.SUSPENDED)
        if candidates:
            self.m.offload(data.draw(st.sampled_from(candidates)))

    @rule(rid=st.sampled_from(IDS), quarantine=st.booleans(), twice=st.booleans())
    def close(self, rid: str, quarantine: bool, twice: bool) -> None:
        ticket = self.m.close(rid, quarantine=quarantine)
        if ticket is not None:
            self.quarantines.append(ticket)
        if twice:
            assert self.m.close(rid) is None

    @precondition(lambda self: self.quarantines)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        ticket = data.draw(st.sampled_from(self.quarantines))
        self.m.release(ticket)
        self.m.release(ticket)
        self.quarantines.remove(ticket)

    @rule()
    def add_dummy(self) -> None:
        rows = {rid: self.m.batch_row(rid) for rid in self._in(CacheState.ACTIVE)}
        try:
            self.dummies.append(self.m.add_dummy())
        except PoolExhausted:
            return
        assert {rid: self.m.batch_row(rid) for rid in rows} == rows

    @precondition(lambda self: self.dummies)
    @rule()
    def remove_dummy(self) -> None:
        self.m.remove_dummy(self.dummies.pop(0))

    @rule(num_pages=st.sampled_from([12, 16, 20]))
    def rebalance(self, num_pages: int) -> None:
        before = self.m.debug_state()
        try:
            self.m.rebalance(num_pages=num_pages)
        except RebalanceRefused:
            assert self.m.debug_state() == before
            return
        self.initial = self.initial._replace(pages_total=num_pages - 1, pages_free=num_pages - 1)

    # --- invariants --------------------------------------------------------------------------------------

    @invariant()
    def ownership_is_consistent(self) -> None:
        m = self.m
        reqs = [m._requests[rid] for rid in m.request_ids()]
        owners: Counter[int] = Counter()
        draft_owners: Counter[int] = Counter()
        slots: list[int] = []
        for req in reqs:
            owners.update(req.pages)
            draft_owners.update(req.draft_pages)
            if req.draft_source is not None:
                draft_owners[req.draft_source] += 1
                assert not req.resumed
            if req.slot is not None:
                slots.append(req.slot)
            # the pages a request will still write are its own
            if req.state is CacheState.ACTIVE:
                for page in req.pages[len(req.tokens) // TPB :]:
                    assert m._pools.pages.ref_cnt(page) == 1
                assert req.draft_valid <= len(req.tokens)
                for page in req.draft_pages[req.draft_valid // DRAFT_TPB :]:
                    assert m._pools.draft is not None and m._pools.draft.ref_cnt(page) == 1
            # the draft match never passes the target's boundary; only final draft KV is offered, keyed by the
            # chained hash of the target tokens (through a zero-filled gap too)
            assert req.draft_hit <= req.reused_tokens
            assert len(req.draft_hashes) * DRAFT_TPB <= max(req.draft_valid, req.draft_hit)
            # a matched block's key takes the token after it from the prompt, not committed yet on a fresh match
            known = req.tokens + req.prompt[len(req.tokens) :]
            parent = req.parent
            for b, key in enumerate(req.draft_hashes):
                parent = hash_block(parent, known[b * DRAFT_TPB : (b + 1) * DRAFT_TPB + 1])
                assert key == parent
        for q in self.quarantines:
            owners.update(q.pages)
            draft_owners.update(q.draft_pages)
            if q.slot is not None:
                slots.append(q.slot)
        for page_id in range(1, m._pools.pages.num_pages):
            assert m._pools.pages.ref_cnt(page_id) == owners[page_id]
            if owners[page_id] > 1:  # shared: only full cached prefix blocks
                assert m._pools.pages.block_hash(page_id) is not None
        assert m._pools.draft is not None
        for page_id in range(1, m._pools.draft.num_pages):
            assert m._pools.draft.ref_cnt(page_id) == draft_owners[page_id]
            if draft_owners[page_id] > 1:  # shared: only full cached draft blocks
                assert m._pools.draft.block_hash(page_id) is not None
        assert len(slots) == len(set(slots)) and DUMMY_SLOT not in slots
        assert m._pools.slots is not None
        snapshot_slots = {s.slot_id for s in m._pools.slots.snapshots()}
        unpinned = sum(1 for s in m._pools.slots.snapshots() if s.pins == 0)
        assert m._pools.slots.num_available == m._pools.slots.num_free_slots + unpinned
        assert not snapshot_slots & set(slots)
        s = m.statistics()
        assert s.slots_live == len(slots)
        assert s.slots_live + s.slots_snapshot + s.slots_free == s.slots_total
        assert s.pages_used + s.pages_free == s.pages_total
        assert s.draft_pages_used + s.draft_pages_free == s.draft_pages_total
        for req in reqs:
            if req.pinned is not None:
                snap = m._pools.slots.snapshot(req.pinned)
                assert snap is not None and snap.pins > 0

    @invariant()
    def batch_rows_map_active_requests(self) -> None:
        m = self.m
        expected = [DUMMY_SLOT] * m.config.max_batch_size
        rows = []
        for rid in self._in(CacheState.ACTIVE):
            row, slot = m.batch_row(rid), m.slot_id(rid)
            assert row is not None and slot is not None
            rows.append(row)
            expected[row] = slot
        for rid in self._in(CacheState.SUSPENDED):
            assert m.batch_row(rid) is None
        assert not set(rows) & set(self.dummies)
        assert len(rows) == len(set(rows))
        assert m.state_indices.tolist() == expected

    def teardown(self) -> None:
        for rid in list(self.m.request_ids()):
            self.m.close(rid)
        for ticket in self.quarantines:
            self.m.release(ticket)
        for row in self.dummies:
            self.m.remove_dummy(row)
        self.m.reset_prefix_cache()
        s = self.m.statistics()
        i = self.initial
        assert (s.pages_free, s.slots_free, s.draft_pages_free) == (
            i.pages_free,
            i.slots_free,
            i.draft_pages_free,
        )
        assert (s.pages_used, s.slots_live, s.slots_snapshot, s.draft_pages_used) == (0, 0, 0, 0)
        assert self.m.state_indices.tolist() == [DUMMY_SLOT] * self.m.config.max_batch_size


ManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestManagerLifecycle = ManagerMachine.TestCase


def test_a_fresh_draft_match_is_keyed_by_the_prompt_token_after_it() -> None:
    """A request created over a prefix whose draft blocks were indexed: its matched draft keys include the prompt
    token after each block, which it has not committed yet (a case the machine found)."""
    machine = ManagerMachine()
    machine.serve_prompt(draft=True, prompt=[0, 0, 0, 0, 0, 0, 1, 1], rid="r0", then="close")
    machine.create(prompt=[0, 0, 0, 0, 0, 0, 1, 1, 1], reuse=True, rid="r0")
    machine.ownership_is_consistent()
    machine.teardown()
