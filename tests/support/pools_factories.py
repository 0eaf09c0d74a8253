"""Cache managers over the ``tiny`` model for the pools tests, and helpers that drive them and read their bytes.

``tiny``: target tokens_per_block 4, drafter tokens_per_block 8, one STATE group :data:`STATE`.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from kvferry.errors import InvalidTransition, KvferryError, PoolExhausted, UnknownRequest
from kvferry.pools.arena import REPLAY, CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.manager import CacheManager, CacheState, Offload
from kvferry.pools.spec import preset

#: the state group of ``tiny``
STATE = "mamba2"
#: the token blocks of ``tiny``'s target and drafter
TPB, DRAFT_TPB = 4, 8


def make_arena(
    num_pages: int = 16,
    num_slots: int = 6,
    num_draft_pages: int = 8,
    *,
    max_replay_tokens: int = 3,
    garbage_seed: int | None = None,
    device: str = "cpu",
) -> CacheArena:
    """A CPU arena of ``tiny``; with ``garbage_seed`` every page, slot and replay buffer holds distinct bytes, so a
    snapshot or offload of the wrong slot or page shows."""
    layout = CacheLayout.build(
        preset("tiny").shard(1, 0),
        num_pages=num_pages,
        num_slots=num_slots,
        num_draft_pages=num_draft_pages,
        max_replay_tokens=max_replay_tokens,
    )
    arena = CacheArena(layout, device)
    if garbage_seed is not None:
        arena.fill_garbage(STATE, list(range(num_slots)), seed=garbage_seed)
        arena.fill_garbage("attention", list(range(num_pages)), seed=garbage_seed + 1)
        arena.fill_garbage(REPLAY, list(range(num_slots)), seed=garbage_seed + 2)
    return arena


def make_manager(
    num_pages: int = 16,
    num_slots: int = 6,
    num_draft_pages: int = 8,
    *,
    device: str = "cpu",
    **kwargs: object,
) -> CacheManager:
    """A manager over a fresh :func:`make_arena` on ``device`` (``max_batch_size`` 4 unless given)."""
    kwargs.setdefault("max_batch_size", 4)
    arena = make_arena(num_pages, num_slots, num_draft_pages, device=device)
    return CacheManager.for_arena(arena, **kwargs)  # type: ignore[arg-type]


def page_bytes(m: CacheManager, group: str, ids: list[int]) -> list[torch.Tensor]:
    assert m.arena is not None
    return [b.clone() for b in m.arena.save_pages(group, ids).blocks]


def draft_page_bytes(m: CacheManager, ids: list[int]) -> list[torch.Tensor]:
    """The bytes of each draft page, one tensor a page."""
    return [torch.cat([b.reshape(-1) for b in page_bytes(m, "draft", [i])]) for i in ids]


def slot_bytes(m: CacheManager, slot: int) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """A slot's state blocks, replay buffer and num_accepted."""
    assert m.arena is not None
    saved = m.arena.save_slots([slot])
    assert saved.replay is not None and saved.num_accepted is not None
    return [b.clone() for b in saved.blocks], saved.replay.clone(), int(saved.num_accepted[0])


def arena_bytes(m: CacheManager) -> list[torch.Tensor]:
    """Every byte of the arena: pools, replay buffers and num_accepted."""
    assert m.arena is not None
    tensors = [*m.arena.pool_tensors().values(), m.arena.replay_tensor, m.arena.num_accepted]
    return [t.clone() for t in tensors]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def run_prompt(m: CacheManager, rid: str, prompt: list[int], *, chunk_at_boundaries: bool = True) -> None:
    """Create, resume and commit the whole prompt, ending chunks at snapshot boundaries."""
    m.create(rid, prompt)
    resumed = m.resume(rid)
    done = resumed.reused_tokens
    while done < len(prompt):
        boundary = m.next_snapshot_boundary(rid) if chunk_at_boundaries else None
        end = len(prompt) if boundary is None else min(boundary, len(prompt))
        m.commit(rid, prompt[done:end])
        done = end


def serve(m: CacheManager, rid: str, prompt: list[int], generated: list[int]) -> None:
    """Prefill ``prompt`` (chunks at snapshot boundaries), then decode ``generated`` one token a step; the
    drafter catches up on each step's fed positions one step later, as the engine's runner does."""
    m.create(rid, prompt)
    done = m.resume(rid, capacity=len(prompt) + len(generated)).reused_tokens
    fed_from = done
    while done < len(prompt):
        boundary = m.next_snapshot_boundary(rid)
        end = len(prompt) if boundary is None else min(boundary, len(prompt))
        m.commit(rid, prompt[done:end])
        done = end
    for token in generated:
        m.commit_draft(rid, fed_from, done)  # the proposal before this step's forward
        fed_from = done
        m.commit(rid, [token])
        done += 1


def active(m: CacheManager) -> list[str]:
    return [str(rid) for rid in m.request_ids() if m.state(rid) is CacheState.ACTIVE]


# --- batches against one-by-one calls ----------------------------------------------------------------------------

#: the pool sizes of :func:`busy_manager`
BUSY_PAGES, BUSY_SLOTS, BUSY_DRAFT_PAGES = 14, 8, 9


def busy_manager(seed: int, num_pages: int = BUSY_PAGES) -> CacheManager:
    """A manager with little room (snapshots every 4 tokens, 6 batch rows) over an arena of distinct bytes."""
    arena = make_arena(num_pages, BUSY_SLOTS, BUSY_DRAFT_PAGES, garbage_seed=seed)
    return CacheManager.for_arena(arena, max_batch_size=6, snapshot_interval=4)


def scenario(seed: int) -> tuple[CacheManager, dict[str, list[int]]]:
    """A small busy manager (and the prompts): shared prefixes (reuse, snapshots), active and suspended requests,
    little room left, so grows move suspended requests to the host or run out."""
    rng = random.Random(seed)
    m = busy_manager(seed)
    prompts = {}
    for i in range(5):
        rid = f"r{i}"
        prompt = prompts[rid] = [rng.choice([0, 1]) for _ in range(rng.randint(1, 10))]
        m.create(rid, prompt)
        try:
            m.resume(rid, capacity=len(prompt) + rng.randint(0, 6))
        except PoolExhausted:
            continue  # stays suspended, never resumed
        done = m.num_committed_tokens(rid)
        end = rng.randint(done, len(prompt))
        while done < end:
            boundary = m.next_snapshot_boundary(rid)
            step = end if boundary is None else min(boundary, end)
            m.commit(rid, prompt[done:step])
            done = step
        if rng.random() < 0.4:
            m.suspend(rid, offload=rng.choice([Offload.ON_PRESSURE, Offload.ON_PRESSURE, Offload.NEVER]))
    return m, prompts


def batch_vs_one_by_one(
    seed: int, one_by_one: Callable[[CacheManager], None], batch: Callable[[CacheManager], None]
) -> tuple[type[KvferryError] | None, CacheManager]:
    """``one_by_one`` on one copy of the :func:`scenario`, ``batch`` on another: the same state and bytes when
    every single call succeeds; else the batch raises (the same error) and changes nothing."""
    single, batched = scenario(seed)[0], scenario(seed)[0]
    assert single.debug_state() == batched.debug_state()
    before, before_bytes = batched.debug_state(), arena_bytes(batched)
    try:
        one_by_one(single)
    except KvferryError as exc:
        # the same error, except that a bad tuple anywhere is reported before pages run out
        expected: tuple[type[KvferryError], ...] = (type(exc),)
        if isinstance(exc, PoolExhausted):
            expected = (PoolExhausted, UnknownRequest, InvalidTransition)
        with pytest.raises(expected):
            batch(batched)
        assert batched.debug_state() == before
        assert same(arena_bytes(batched), before_bytes)
        return type(exc), batched
    batch(batched)
    assert batched.debug_state() == single.debug_state()
    assert same(arena_bytes(batched), arena_bytes(single))
    return None, batched


def two_active_one_suspended(seed: int) -> CacheManager:
    """``a`` (prompt 1..5, 2 committed) and ``b`` (prompt 7, 8) ACTIVE with capacity 8; ``s`` never resumed."""
    m = busy_manager(seed, num_pages=32)
    for rid, prompt in (("a", [1, 2, 3, 4, 5]), ("b", [7, 8])):
        m.create(rid, prompt)
        m.resume(rid, capacity=8)
    m.commit("a", [1, 2])
    m.create("s", [1])
    return m
