"""The draft mirror (kvferry.pools.draft_mirror): draft KV reuse clamped to the target's reuse boundary
(docs/design.md, "Draft KV")."""

from __future__ import annotations

import pytest

from kvferry.errors import InvalidTransition, UnknownRequest
from kvferry.pools.blocks import hash_block, root_hash
from kvferry.pools.manager import CacheManager, Offload
from tests.support.pools_factories import draft_page_bytes as pages
from tests.support.pools_factories import make_manager, page_bytes, run_prompt, same, serve


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
    # c's draft KV after the gap was computed over zeros: it never enters the index
    m.commit("c", [99, 98, 97])
    m.commit_draft("c", 24, 27)
    m.grow("c", 36)
    m.commit("c", list(range(9)))
    m.commit_draft("c", 27, 36)
    assert [m._pools.draft.block_hash(p) for p in c_draft[2:]] == [None] * len(c_draft[2:])  # type: ignore[union-attr]


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


def decode(m: CacheManager, rid: str, fed_from: int, generated: list[int]) -> None:
    """Decode ``generated`` one token a step; before each step the drafter catches up on the positions fed since
    ``fed_from`` (one step behind the target, as the engine's runner does)."""
    for token in generated:
        done = m.num_committed_tokens(rid)
        m.commit_draft(rid, fed_from, done)
        fed_from = done
        m.commit(rid, [token])


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
