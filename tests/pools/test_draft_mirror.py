"""The draft mirror (kvferry.pools.draft_mirror): draft KV reuse clamped to the target's reuse boundary
(docs/design.md, "Draft KV")."""

from __future__ import annotations

import pytest

from kvferry.errors import InvalidTransition, UnknownRequest
from kvferry.pools.blocks import PageHash, hash_block, root_hash
from kvferry.pools.manager import CacheManager, Offload
from tests.support.pools_factories import DRAFT_TPB, make_manager, page_bytes, run_prompt, same, serve
from tests.support.pools_factories import draft_page_bytes as pages


def chain_keys(tokens: list[int], count: int) -> list[PageHash]:
    """The draft mirror's keys of the first ``count`` draft blocks of ``tokens``: each block's tokens and the
    token after it, chained from the root (no salt)."""
    keys: list[PageHash] = []
    parent = root_hash()
    for b in range(count):
        parent = hash_block(parent, tokens[b * DRAFT_TPB : (b + 1) * DRAFT_TPB + 1])
        keys.append(parent)
    return keys


def test_draft_blocks_are_indexed_only_when_final_and_followed() -> None:
    m = make_manager(num_pages=32, num_draft_pages=24, snapshot_interval=8)
    prompt = list(range(20))
    m.create("a", prompt)
    m.resume("a", capacity=24)
    m.commit("a", prompt)
    assert m.statistics().draft_pages_cached == 0  # target committed, the drafter has not run yet
    m.commit_draft("a", 0, 20)
    # blocks [0, 8) and [8, 16) are final and their next token is committed; [16, 24) is not full
    assert m.statistics().draft_pages_cached == 2
    draft = list(m.draft_block_table("a"))
    key0 = hash_block(root_hash(), prompt[0:9])
    key1 = hash_block(key0, prompt[8:17])
    assert m._pools.draft.lookup(key0) == draft[0] and m._pools.draft.lookup(key1) == draft[1]  # type: ignore[union-attr]
    m.commit("a", [20, 21, 22])
    m.commit_draft("a", 20, 23)
    assert m.statistics().draft_pages_cached == 2  # position 23 not final, token 24 not committed
    m.commit("a", [23])
    m.commit_draft("a", 23, 24)
    assert (
        m.statistics().draft_pages_cached == 2
    )  # final, but token 24 (part of the block's hash) is not known
    with pytest.raises(InvalidTransition):
        m.commit_draft("a", 20, 25)  # past the committed tokens


def test_reuse_shares_exact_draft_pages_and_copies_the_straddling_block() -> None:
    m = make_manager(num_pages=32, num_slots=16, num_draft_pages=24, snapshot_interval=4, max_batch_size=8)
    arena = m.arena
    assert arena is not None
    prompt = list(range(30))
    serve(m, "a", prompt, [100, 101])
    a_draft = list(m.draft_block_table("a"))
    arena.fill_garbage("draft", a_draft, seed=7)  # stands for the drafter's KV
    a_bytes = pages(m, a_draft)
    # b shares 22 tokens: target reuse 20 (whole blocks with snapshots), draft: blocks 0, 1 shared, block 2's
    # front [16, 20) copied (its hash covers tokens 16..24, b agrees on 16..20)
    assert m.create("b", [*prompt[:22], 7, 7, 7]) == 20
    assert m._pools.draft.ref_cnt(a_draft[2]) == 2  # type: ignore[union-attr]  # held for the copy
    r = m.resume("b")
    assert r.reused_tokens == 20 and r.draft_zeroed == (0, 0)
    b_draft = list(m.draft_block_table("b"))
    assert b_draft[:2] == a_draft[:2]
    assert b_draft[2] not in a_draft
    assert [m._pools.draft.ref_cnt(p) for p in a_draft[:3]] == [2, 2, 1]  # type: ignore[union-attr]
    assert same(pages(m, b_draft[:3]), a_bytes[:3])  # the straddling block: a private copy
    assert m.statistics().draft_hit_tokens == 20
    # the copy is b's: writing it leaves a's page alone
    arena.fill_garbage("draft", [b_draft[2]], seed=8)
    assert same(pages(m, a_draft), a_bytes)
    m.close("a")
    m.close("b")
    assert m.statistics().draft_pages_used == 0


def test_draft_match_is_clamped_to_the_target_boundary_and_the_gap_zero_filled() -> None:
    m = make_manager(num_pages=32, num_slots=16, num_draft_pages=24, snapshot_interval=4, max_batch_size=8)
    arena = m.arena
    assert arena is not None
    prompt = list(range(40))
    serve(m, "a", prompt, [100, 101])  # draft blocks 0..4 indexed
    assert m.statistics().draft_pages_cached == 5
    a_draft = list(m.draft_block_table("a"))
    # clamp: b's prompt is a's: the target reuses 36 (prompt - 1, whole blocks); the draft mirror has 40 but
    # takes blocks 0..3 and the front of block 4 only
    m.create("b", prompt[:37])
    r = m.resume("b")
    assert r.reused_tokens == 36 and r.draft_zeroed == (0, 0)
    assert list(m.draft_block_table("b"))[:4] == a_draft[:4]
    assert m._pools.draft.ref_cnt(a_draft[4]) == 1  # type: ignore[union-attr]  # copied, not shared
    # gap: c diverges right at the target boundary 24, so draft block 2 (hash covers token 24) cannot be
    # reused, not even its front: [16, 24) is zero-filled, blocks 0 and 1 are shared
    arena.fill_garbage("draft", list(range(1, 24)), seed=9)
    a_bytes = pages(m, a_draft)
    m.create("c", [*prompt[:24], 99, 98, 97])
    r = m.resume("c")
    assert r.reused_tokens == 24 and r.draft_zeroed == (16, 24)
    c_draft = list(m.draft_block_table("c"))
    assert c_draft[:2] == a_draft[:2] and c_draft[2] not in a_draft
    assert not any(b.any() for b in pages(m, c_draft[2:3]))
    assert same(pages(m, a_draft), a_bytes)  # shared pages untouched
    s = m.statistics()
    assert (s.draft_hit_tokens, s.draft_zeroed_tokens) == (36 + 16, 8)
    # c's draft KV after the gap enters the index once final, and the gap's zeros with it, keyed by c's tokens
    m.commit("c", [99, 98, 97])
    m.commit_draft("c", 24, 27)
    m.grow("c", 36)
    m.commit("c", list(range(9)))
    m.commit_draft("c", 27, 36)
    c_tokens = [*prompt[:24], 99, 98, 97, *range(9)]
    keys = chain_keys(c_tokens, 4)
    c_draft = list(m.draft_block_table("c"))
    assert [m._pools.draft.block_hash(p) for p in c_draft[2:]] == [*keys[2:4], None]  # type: ignore[union-attr]
    # block 4 [32, 40) is not full


def test_draft_pages_of_the_reused_prefix_are_zeroed() -> None:
    m = make_manager(snapshot_interval=8)
    arena = m.arena
    assert arena is not None
    run_prompt(m, "a", list(range(20)))
    m.close("a")
    arena.fill_garbage("draft", list(range(1, 8)), seed=5)
    m.create("b", [*range(17), 1])
    r = m.resume("b")
    assert r.reused_tokens == 16 and r.draft_zeroed == (0, 16)
    draft = list(m.draft_block_table("b"))
    assert len(draft) == 3
    zeroed, untouched = page_bytes(m, "draft", draft[:2]), page_bytes(m, "draft", draft[2:])
    assert all(not b.any() for b in zeroed)
    assert all(b.any() for b in untouched)  # not in the reused range: the drafter writes it before reading


def test_requests_that_never_draft_offer_no_draft_blocks() -> None:
    m = make_manager(snapshot_interval=4)
    serve(m, "a", list(range(20)), [])
    m.close("a")
    m.create("b", list(range(20)))
    r = m.resume("b")
    assert r.reused_tokens == 16 and r.draft_zeroed == (0, 16)
    assert m.statistics().draft_pages_cached == 0


def test_draft_index_survives_offload_and_obeys_salt_and_reset() -> None:
    m = make_manager(num_pages=32, num_slots=16, num_draft_pages=24, snapshot_interval=4, max_batch_size=8)
    prompt = list(range(20))
    serve(m, "a", prompt, [100])
    a_draft = list(m.draft_block_table("a"))
    m.suspend("a")
    m.offload("a")
    assert m.statistics().draft_pages_cached == 2  # free pages keep their hash
    m.resume("a")  # restored into new pages; the index keeps the cached free ones (same bytes)
    assert not set(m.draft_block_table("a")) & set(a_draft)
    m.create("x", prompt, salt=b"other")
    assert m.resume("x").draft_zeroed == (0, 0)  # no target reuse under another salt: no gap either
    m.create("b", prompt[:17])
    assert m.resume("b").draft_zeroed == (0, 0)
    assert list(m.draft_block_table("b"))[:2] == a_draft[:2]
    m.reset_prefix_cache()
    assert m.statistics().draft_pages_cached == 0


def test_commit_draft_needs_the_pages_on_the_device() -> None:
    m = make_manager(num_pages=32, num_slots=16, num_draft_pages=24, snapshot_interval=4, max_batch_size=8)
    m.create("a", list(range(20)))
    with pytest.raises(InvalidTransition):
        m.commit_draft("a", 0, 0)  # never resumed: it holds no pages of its own
    m.resume("a")
    m.commit("a", list(range(20)))
    m.suspend("a", offload=Offload.NEVER)
    m.commit_draft("a", 0, 20)  # a hand-off's catch-up after the prefill: suspended, on the device
    assert m.statistics().draft_pages_cached == 2
    m.offload("a")
    before = m.debug_state()
    with pytest.raises(InvalidTransition):
        m.commit_draft("a", 0, 20)
    with pytest.raises(UnknownRequest):
        m.commit_draft("zz", 0, 0)
    assert m.debug_state() == before


# --- gaps: the blocks computed after a zero-filled gap ----------------------------------------------------------


def decode(m: CacheManager, rid: str, fed_from: int, generated: list[int]) -> None:
    """Decode ``generated`` one token a step; before each step the drafter catches up on the positions fed since
    ``fed_from`` (one step behind the target, as the engine's runner does)."""
    for token in generated:
        done = m.num_committed_tokens(rid)
        m.commit_draft(rid, fed_from, done)
        fed_from = done
        m.commit(rid, [token])


def test_a_next_turn_matches_past_the_gap_of_the_turn_before() -> None:
    m = make_manager(num_pages=128, num_slots=16, num_draft_pages=32, snapshot_interval=4, max_batch_size=8)
    arena, draft = m.arena, m._pools.draft
    assert arena is not None and draft is not None
    initial = m.statistics()
    # turn 1: the drafter's catch-up lags the target by a step, so the target's last snapshot (20) lies past
    # the draft blocks turn 1 could index ([0, 8) and [8, 16); [16, 24) is not full)
    t1 = [*range(18), 50, 51, 52]
    serve(m, "t1", t1[:18], t1[18:])
    t1_draft = list(m.draft_block_table("t1"))
    assert [draft.block_hash(p) for p in t1_draft] == [*chain_keys(t1, 2), None]
    arena.fill_garbage("draft", t1_draft, seed=7)  # stands for turn 1's draft KV
    t1_bytes = pages(m, t1_draft)
    m.close("t1")
    arena.fill_garbage("draft", draft.free_page_ids()[:-3], seed=9)  # recycled bytes in every other free page
    # turn 2: all of turn 1 and a new prompt; the target reuses 20 tokens, the draft mirror 16: gap [16, 20)
    t2_prompt = [*t1, *range(60, 71)]
    assert m.create("t2", t2_prompt) == 20
    r = m.resume("t2", capacity=35)
    assert r.draft_zeroed == (16, 20)
    t2_draft = list(m.draft_block_table("t2"))
    assert t2_draft[:2] == t1_draft[:2] and same(pages(m, t2_draft[:2]), t1_bytes[:2])
    assert not pages(m, t2_draft[2:3])[0].any()  # the gap's page is zero-filled, not recycled garbage
    m.commit("t2", t2_prompt[20:])
    assert draft.block_hash(t2_draft[2]) is None  # the drafter has written nothing after the gap yet
    decode(m, "t2", 20, [80, 81, 82])
    t2 = [*t2_prompt, 80, 81, 82]
    # final: [0, 16) matched, [16, 20) zero-filled, [20, 34) the drafter's catch-up; blocks whose next token
    # is committed enter the index, keyed by turn 2's own tokens: the gap's block 2 and block 3 after it
    assert [draft.block_hash(p) for p in t2_draft] == [*chain_keys(t2, 4), None]
    assert [draft.lookup(k) for k in chain_keys(t2, 4)] == t2_draft[:4]
    arena.fill_garbage("draft", t2_draft[3:], seed=11)  # stands for turn 2's draft KV after the gap
    t2_bytes = pages(m, t2_draft)
    # turn 3: the target reuses 32 tokens (the snapshot at 32); the draft match now covers all of them
    t3_prompt = [*t2, *range(90, 96)]
    assert m.create("t3", t3_prompt) == 32
    r = m.resume("t3")
    assert r.draft_zeroed == (0, 0)
    t3_draft = list(m.draft_block_table("t3"))
    assert t3_draft[:4] == t2_draft[:4]
    assert [draft.ref_cnt(p) for p in t2_draft] == [2, 2, 2, 2, 1]  # t2 and t3 share the four full blocks
    assert not t2_bytes[2].any()  # the block of turn 2's gap holds zeros (and here no catch-up bytes)
    assert same(
        pages(m, t3_draft[:4]), t2_bytes[:4]
    )  # turn 2's gap as zero-filled there, and its KV after it
    s = m.statistics()
    assert (s.draft_hit_tokens, s.draft_zeroed_tokens) == (16 + 32, 4)
    assert same(pages(m, t2_draft), t2_bytes)  # shared pages stay read-only
    m.close("t3")
    m.close("t2")
    assert m.statistics().draft_pages_used == 0

    # eviction: another request takes free pages up to turn 2's block 3 (pages freed tail block first go
    # first), which loses its hash; the chain breaks there, so the same turn 3 matches blocks 0..2 and the
    # gap [24, 32) comes back zero-filled over the recycled bytes
    evicted = draft.free_page_ids().index(t2_draft[3]) + 1
    m.create("x", [300] * 8)
    m.resume("x", capacity=evicted * DRAFT_TPB)
    assert draft.block_hash(t2_draft[3]) is None and draft.lookup(chain_keys(t2, 4)[3]) is None
    arena.fill_garbage("draft", list(m.draft_block_table("x")), seed=13)
    m.close("x")
    assert m.create("t3b", t3_prompt) == 32
    r = m.resume("t3b")
    assert r.draft_zeroed == (24, 32)
    t3b_draft = list(m.draft_block_table("t3b"))
    assert t3b_draft[:3] == t2_draft[:3]
    assert same(pages(m, t3b_draft[:3]), t2_bytes[:3])
    assert not pages(m, t3b_draft[3:4])[0].any()  # x left garbage in its pages (this one among them)
    assert [draft.ref_cnt(p) for p in t3b_draft[:4]] == [1, 1, 1, 1]
    m.close("t3b")
    m.reset_prefix_cache()
    s = m.statistics()
    assert (s.pages_free, s.slots_free, s.draft_pages_free) == (
        initial.pages_free,
        initial.slots_free,
        initial.draft_pages_free,
    )


def test_a_gap_is_final_only_once_the_drafter_writes_from_its_end_on() -> None:
    m = make_manager(num_pages=32, num_slots=16, num_draft_pages=24, snapshot_interval=4, max_batch_size=8)
    draft = m._pools.draft
    assert draft is not None
    run_prompt(m, "a", list(range(24)))  # the target only: no draft block is indexed
    m.close("a")
    prompt = [*range(24), *range(100, 120)]
    m.create("b", prompt)
    assert m.resume("b", capacity=48).draft_zeroed == (0, 24)
    for start in range(24, 44, 4):  # snapshots at every block
        m.commit("b", prompt[start : start + 4])
    m.commit_draft("b", 28, 44)  # past the gap's end, with [24, 28) never written: extends nothing
    assert m._requests["b"].draft_valid == 0 and m.statistics().draft_pages_cached == 0
    m.commit_draft("b", 24, 44)
    assert m._requests["b"].draft_valid == 44
    b_draft = list(m.draft_block_table("b"))
    assert [draft.block_hash(p) for p in b_draft] == [*chain_keys(prompt, 5), None]
    # keyed by the target tokens, the one after the block included: a prompt that differs at 32 shares the
    # target's blocks through 32, but the draft mirror's only through 24 (block 3's key covers token 32)
    other = [*prompt[:32], 7, *prompt[33:]]
    m.create("c", other)
    r = m.resume("c")
    assert (r.reused_tokens, r.draft_zeroed) == (32, (24, 32))
    assert list(m.draft_block_table("c"))[:3] == b_draft[:3]
    # another salt matches nothing
    m.create("d", prompt, salt=b"other")
    assert m.resume("d").reused_tokens == 0
    for rid in "bcd":
        m.close(rid)
    assert m.statistics().draft_pages_used == 0


def test_without_draft_reuse_the_reused_prefix_is_zero_filled_and_nothing_is_indexed() -> None:
    m = make_manager(
        num_pages=32,
        num_slots=16,
        num_draft_pages=24,
        snapshot_interval=4,
        max_batch_size=8,
        enable_draft_reuse=False,
    )
    arena, draft = m.arena, m._pools.draft
    assert arena is not None and draft is not None
    prompt = list(range(30))
    serve(m, "a", prompt, [100, 101, 102])
    s = m.statistics()
    assert s.pages_cached > 0 and s.draft_pages_cached == 0  # the target's prefix index is as ever
    m.close("a")
    arena.fill_garbage("draft", draft.free_page_ids(), seed=3)
    m.create("b", [*prompt, 100, 101, 5])
    r = m.resume("b", capacity=40)
    assert r.reused_tokens == 32 and r.draft_zeroed == (0, 32)
    assert not any(b.any() for b in pages(m, list(m.draft_block_table("b"))[:4]))
    m.commit("b", [5])
    decode(m, "b", 32, [6, 7, 8, 9])
    assert m.statistics().draft_pages_cached == 0
    assert m.statistics().draft_hit_tokens == 0
    m.close("b")
