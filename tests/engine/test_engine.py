"""The engine over the real paged model and the real cache manager: the token-equality oracles of docs/design.md
("Test oracles"); batched, chunked, preempted, speculative, tensor-parallel and prefix-reusing runs give each
prompt the tokens it gets alone."""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence

import anyio
import attrs
import pytest
import torch
from attrs import define

from kvferry.engine.engine import DraftItem, Engine, ForwardItem
from kvferry.engine.runner import BuiltEngine, EngineOptions, PagedRunner, build_engine
from kvferry.pools.spec import DRAFT_LAYER_SHIFT

# lengths cross the tiny preset's 4-token blocks and the model's 8-token scan chunks
PROMPTS: list[tuple[int, ...]] = [
    tuple(b"a"),
    tuple(b"hey"),
    tuple(b"hello"),
    tuple(b"kv ferry!"),
    tuple(b"hybrid caches."),
    tuple(b"the quick brown fox jumps"),
]
MAX_TOKENS = [9, 7, 12, 6, 10, 8]


def options(**kwargs: object) -> EngineOptions:
    base: dict[str, object] = {
        "dtype": "float64",
        "num_pages": 128,
        "max_running": 8,
        "step_in_thread": False,
    }
    base.update(kwargs)
    return EngineOptions(**base)  # type: ignore[arg-type]


def free_counts(built: BuiltEngine) -> list[tuple[int, int, int]]:
    out = []
    for m in built.cache.managers:
        s = m.statistics()
        out.append((s.pages_free, s.slots_free, s.draft_pages_free))
    return out


def assert_all_free(built: BuiltEngine, initial: list[tuple[int, int, int]]) -> None:
    for m in built.cache.managers:
        s = m.statistics()
        assert s.pages_used == 0 and s.slots_live == 0 and s.draft_pages_used == 0
        assert s.requests_active == 0 and s.requests_suspended == 0
        m.reset_prefix_cache()  # cached blocks and snapshots are the prefix cache's, not leaks
    assert free_counts(built) == initial


async def run_all(
    built: BuiltEngine,
    prompts: Sequence[Sequence[int]] = PROMPTS,
    max_tokens: Sequence[int] = MAX_TOKENS,
    *,
    spec_k: int = 0,
    seed: int | None = None,
    sequential: bool = False,
) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in prompts]

    async def one(i: int) -> None:
        generation = built.engine.generate(prompts[i], max_tokens=max_tokens[i], spec_k=spec_k, seed=seed)
        results[i] = await generation.collect()

    with anyio.fail_after(60):
        async with built.engine:
            if sequential:
                for i in range(len(prompts)):
                    await one(i)
            else:
                async with anyio.create_task_group() as tg:
                    for i in range(len(prompts)):
                        tg.start_soon(one, i)
    return results


def submits_in_order(anyio_backend: str) -> bool:
    """Whether run_all's consumers submit their requests in the order they were started, as asyncio runs them.

    Trio runs tasks woken together in a shuffled order, so the scheduler sees the requests in any order;
    the tokens stay the same, but whether tight pools preempt depends on that order (a few orders never do)."""
    return anyio_backend == "asyncio"


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each prompt on its own (sequential, no reuse): the reference of every batched run."""
    # module-scoped, so it runs an event loop of its own rather than one test's
    built = build_engine("tiny", options(enable_reuse=False))
    return anyio.run(functools.partial(run_all, built, sequential=True))


def test_the_engine_equals_transformers_generate() -> None:
    pytest.importorskip("transformers")
    from kvferry.model.weights import ModelWeights, hf_generate, hf_model, tiny_args
    from kvferry.pools.spec import preset

    spec = preset("tiny").with_dtype("float64")
    weights = ModelWeights.seeded(tiny_args(spec), 0, torch.float64)
    built = build_engine("tiny", options())
    tokens = anyio.run(run_all, built, PROMPTS[3:4], [6])
    assert tokens[0] == hf_generate(hf_model(weights), PROMPTS[3], 6)[0]


@pytest.mark.anyio
async def test_batched_equals_alone(alone: list[list[int]]) -> None:
    built = build_engine("tiny", options(enable_reuse=False))
    initial = free_counts(built)
    assert await run_all(built) == alone
    assert built.engine.statistics().num_steps < sum(MAX_TOKENS)  # it really batched
    assert_all_free(built, initial)


@pytest.mark.parametrize("chunk", [1, 3, 5, 64])
@pytest.mark.anyio
async def test_every_prefill_chunk_size_gives_the_same_tokens(chunk: int, alone: list[list[int]]) -> None:
    built = build_engine("tiny", options(max_prefill_chunk=chunk, enable_reuse=False))
    assert await run_all(built) == alone


@pytest.mark.anyio
async def test_garbage_in_free_pages_and_slots_changes_nothing(alone: list[list[int]]) -> None:
    built = build_engine("tiny", options(num_pages=64, enable_reuse=False))
    for arena in built.arenas:
        for group in arena.layout.pool_groups:
            arena.fill_garbage(group.name, range(group.num_slots), seed=7)
        arena.fill_garbage("replay", range(arena.layout.num_slots), seed=8)
    assert await run_all(built) == alone


@pytest.mark.anyio
async def test_preemption_under_tight_pools_gives_the_same_tokens(
    alone: list[list[int]], anyio_backend: str
) -> None:
    # 12 usable pages of 4 tokens: the six requests need ~24 together, so some are suspended and resumed
    built = build_engine("tiny", options(num_pages=13, max_prefill_chunk=4, enable_reuse=False))
    initial = free_counts(built)
    assert await run_all(built) == alone
    stats = built.cache.statistics()
    assert stats.restores == stats.offloads  # suspended requests went to the host and came back
    if submits_in_order(anyio_backend):
        assert built.engine.scheduler.statistics().num_preemptions > 0 and stats.offloads > 0
    assert_all_free(built, initial)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.anyio
async def test_tensor_parallel_gives_the_same_tokens(tp: int, alone: list[list[int]]) -> None:
    built = build_engine("tiny", options(tp=tp, enable_reuse=False))
    assert await run_all(built) == alone


@pytest.mark.anyio
async def test_prefix_reuse_gives_the_same_tokens_and_reports_reused_tokens(alone: list[list[int]]) -> None:
    built = build_engine("tiny", options())
    shared = PROMPTS[5]  # 25 tokens: 6 full blocks
    longer = (*shared, *b" over the lazy dog")
    reference = await run_all(build_engine("tiny", options(enable_reuse=False)), [longer], [8])
    generations = []
    async with built.engine:
        generations.append(built.engine.generate(shared, max_tokens=8))
        assert await generations[0].collect() == alone[5]
        generations.append(built.engine.generate(longer, max_tokens=8))
        assert [await generations[1].collect()] == reference
    assert generations[0].statistics().reused_tokens == 0
    # the whole shared prompt up to its last full block is reused: KV pages and the recurrent snapshot
    assert generations[1].statistics().reused_tokens == 24


@pytest.mark.anyio
async def test_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    one = await run_all(build_engine("tiny", options()), PROMPTS[:3], [8, 8, 8], seed=3, sequential=True)
    many = await run_all(build_engine("tiny", options()), PROMPTS[:3], [8, 8, 8], seed=3)
    greedy = await run_all(build_engine("tiny", options()), PROMPTS[:3], [8, 8, 8])
    assert one == many and one != greedy


@pytest.mark.anyio
async def test_random_cancellation_returns_every_pool_to_its_initial_counts() -> None:
    built = build_engine("tiny", options(num_pages=24, max_prefill_chunk=3, step_in_thread=True))
    initial = free_counts(built)
    rng = random.Random(0)
    tasks_before = len(anyio.get_running_tasks())

    async def consumer(i: int) -> None:
        generation = built.engine.generate(PROMPTS[i % len(PROMPTS)], max_tokens=10)
        stop_after = rng.randrange(0, 10)
        if rng.random() < 0.5:
            with anyio.move_on_after(rng.random() * 0.05):
                await generation.collect()
        else:
            n = 0
            async for _ in generation:
                n += 1
                if n > stop_after:
                    break

    with anyio.fail_after(60):
        async with built.engine:
            async with anyio.create_task_group() as tg:
                for i in range(16):
                    tg.start_soon(consumer, i)
            await built.engine.wait_idle()
            assert built.engine.statistics().num_cancelled > 0
            assert not built.runner._fed
    assert len(anyio.get_running_tasks()) == tasks_before
    assert_all_free(built, initial)


class OracleDraftRunner(PagedRunner):
    """The real target model with a stand-in drafter that proposes the reference continuation, corrupted at
    some positions, so verify steps accept everything, nothing, or a prefix: every replay path runs."""

    def __init__(self, base: PagedRunner, reference: dict[tuple[int, ...], list[int]]) -> None:
        super().__init__(base.model, base.cache, drafter=None)
        self.reference = reference
        self.history: dict[int, list[int]] = {}

    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        for item in items:
            history = self.history.setdefault(item.request_id, [])
            del history[item.start :]
            history.extend(item.token_ids)
        return super().forward(items)

    def propose(self, items: Sequence[DraftItem]) -> list[tuple[int, ...]]:
        out = []
        for item in items:
            prefix = (*self.history[item.request_id][: item.start], item.pending_token)
            drafts = []
            for prompt, continuation in self.reference.items():
                full = (*prompt, *continuation)
                if full[: len(prefix)] == prefix:
                    drafts = list(full[len(prefix) : len(prefix) + item.k])
                    break
            drafts += [0] * (item.k - len(drafts))
            wrong = item.start % (item.k + 1)  # rotate the first wrong draft through every position
            if wrong < item.k:
                drafts[wrong] = (drafts[wrong] + 1) % 256
            out.append(tuple(drafts))
        return out

    def release(self, request_id: int) -> None:
        self.history.pop(request_id, None)
        super().release(request_id)


@pytest.mark.anyio
@pytest.mark.parametrize(("k", "pages"), [(1, 40), (2, 14), (4, 40)])
async def test_speculative_verify_and_replay_give_the_same_tokens(
    k: int, pages: int, alone: list[list[int]], anyio_backend: str
) -> None:
    """Replay state (slot + replay buffers + num_accepted) stays right through verify steps, and (tight pools)
    through suspends to the host and resumes into other slots."""
    built = build_engine(
        "tiny",
        options(max_spec_k=k, drafter=False, num_pages=pages, max_prefill_chunk=5, step_in_thread=True),
    )
    runner = OracleDraftRunner(built.runner, dict(zip(PROMPTS, alone, strict=True)))
    engine = Engine(runner, built.cache, built.engine.config)
    initial = free_counts(built)
    assert await run_all(built._replace(engine=engine, runner=runner), spec_k=k) == alone
    stats = engine.statistics()
    assert 0 < stats.num_accepted < stats.num_drafted  # accept and reject paths both ran
    assert runner.model.statistics()["replayed_tokens"] > 0
    if pages < 20 and submits_in_order(anyio_backend):
        assert engine.scheduler.statistics().num_preemptions > 0 and built.cache.statistics().restores > 0
    assert_all_free(built, initial)


@pytest.mark.anyio
@pytest.mark.parametrize(("k", "tp"), [(1, 1), (2, 2), (4, 1)])
async def test_the_real_drafter_gives_the_same_tokens(k: int, tp: int, alone: list[list[int]]) -> None:
    built = build_engine("tiny", options(max_spec_k=k, tp=tp, num_pages=64, max_prefill_chunk=5))
    initial = free_counts(built)
    assert await run_all(built, spec_k=k) == alone
    stats = built.engine.statistics()
    assert (
        0 < stats.num_accepted < stats.num_drafted and built.runner.drafter is not None
    )  # accept and reject
    assert built.runner.drafter.statistics()["proposals"] > 0
    assert not built.runner._fed  # every request's drafter input was released
    assert_all_free(built, initial)


@pytest.mark.anyio
@pytest.mark.parametrize("k", [0, 3])
async def test_decode_snapshots_let_a_follow_up_turn_reuse_the_generated_tokens(k: int) -> None:
    prompt, n = PROMPTS[4], 12
    built = build_engine("tiny", options(max_spec_k=k, snapshot_interval=8, drafter=k > 0))
    if k:  # the stand-in drafter accepts whole windows often, so windows really cross the boundaries
        reference0 = await run_all(build_engine("tiny", options(enable_reuse=False)), [prompt], [n])
        runner: PagedRunner = OracleDraftRunner(built.runner, {prompt: reference0[0]})
        built = built._replace(runner=runner, engine=Engine(runner, built.cache, built.engine.config))
    async with built.engine as engine:
        first = await engine.generate(prompt, max_tokens=n, spec_k=k).collect()
        follow_up = (*prompt, *first, *b" ok")
        second = engine.generate(follow_up, max_tokens=6, spec_k=k)
        tokens = await second.collect()
    # snapshots at 8, 16, 24: the follow-up reuses through position 24, inside the generated tokens
    assert second.statistics().reused_tokens == 24 > len(prompt)
    reference = await run_all(build_engine("tiny", options(enable_reuse=False)), [follow_up], [6])
    assert tokens == reference[0]


@pytest.mark.anyio
async def test_drafter_hand_off_writes_the_prompts_draft_kv_and_carries_only_the_last_hidden_state() -> None:
    from kvferry.engine.runner import LockstepCache
    from kvferry.errors import WireFormatError

    prompt = PROMPTS[5]
    n = len(prompt)
    draft_layer = DRAFT_LAYER_SHIFT

    def draft_kv(built: BuiltEngine, rid: int) -> torch.Tensor:
        # positions [0, n) of the request's draft K and V, from its draft pages (rank 0)
        k, v = built.arenas[0].kv(draft_layer)
        ids = list(built.cache.draft_block_table(rid))
        rows = [kv[ids].permute(0, 2, 1, 3).reshape(-1, *kv.shape[1:2], kv.shape[3])[:n] for kv in (k, v)]
        return torch.stack(rows).clone()

    seen: dict[int, tuple[bytes, torch.Tensor, torch.Tensor]] = {}
    first: list[int] = []  # the token the target chooses after the prompt (the export's pending token)

    def engine_with(built: BuiltEngine, export: bool) -> Engine:
        class Closing(LockstepCache):
            def close(self, request_id: int) -> None:  # the request's pages are still its own here
                before = draft_kv(built, request_id)
                data = built.runner.export_handoff(request_id, first[0]) if export else b""
                seen[request_id] = (data, before, draft_kv(built, request_id))
                super().close(request_id)

        return Engine(built.runner, Closing(built.cache.managers), built.engine.config)

    # aggregated: the first proposal catches the drafter up on the prompt; later steps write past position n
    aggregated = build_engine("tiny", options(max_spec_k=2, enable_reuse=False))
    async with engine_with(aggregated, export=False) as engine:
        first.extend(await engine.generate(prompt, max_tokens=4, spec_k=2).collect())
    reference = seen.pop(0)[1]
    context = build_engine("tiny", options(max_spec_k=2, enable_reuse=False))
    async with engine_with(context, export=True) as engine:
        await engine.generate(prompt, max_tokens=1, spec_k=2).collect()
        await engine.generate(PROMPTS[3], max_tokens=1).collect()  # spec_k 0 keeps no drafter state
    (data, before, after), (empty, _, _) = seen[0], seen[1]
    assert empty == b""
    assert not before.any()  # nothing drafted during the prefill ...
    assert torch.equal(after, reference)  # ... the export wrote exactly the aggregated run's draft KV

    receiver = build_engine("tiny", options(max_spec_k=2)).runner
    receiver.import_handoff(5, data, prompt=prompt, pending_token=first[0])
    (fed,) = receiver._fed[5]
    assert (fed.start, fed.token_ids) == (n - 1, [prompt[-1]])
    assert fed.hidden.shape == (1, 64) and fed.hidden.dtype == torch.float64
    bad = [b"\x01\x02", data[:-10], data + b"\x00", data.replace(b"float64", b"float16")]
    for blob in bad:
        with pytest.raises(WireFormatError):
            receiver.import_handoff(6, blob)
    with pytest.raises(WireFormatError):
        receiver.import_handoff(6, data, prompt=prompt[:-1], pending_token=first[0])
    with pytest.raises(WireFormatError):
        receiver.import_handoff(6, data, prompt=prompt, pending_token=first[0] + 1)
    assert 6 not in receiver._fed


@pytest.mark.anyio
async def test_draft_proposals_are_the_same_alone_and_batched() -> None:
    async def proposals(sequential: bool, chunk: int) -> list[list[tuple[int, ...]]]:
        built = build_engine("tiny", options(max_spec_k=2, max_prefill_chunk=chunk, enable_reuse=False))
        generations = [
            built.engine.generate(p, max_tokens=m, spec_k=2) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)
        ]
        async with built.engine, anyio.create_task_group() as tg:
            for g in generations:
                if sequential:
                    await g.collect()
                else:
                    tg.start_soon(g.collect)
        return [g.request.draft_history for g in generations]

    alone = await proposals(True, 64)
    assert all(alone)
    assert await proposals(False, 3) == alone


@pytest.mark.anyio
@pytest.mark.parametrize("tp", [1, 2])
async def test_prefix_reuse_gives_the_same_tokens_and_draft_proposals(tp: int) -> None:
    """Prefix reuse with the draft mirror: the same prompt again, and a prompt extending it, reuse
    target pages, the snapshot and the draft KV of the prefix; tokens and every draft proposal are those of a
    fresh engine."""
    shared = PROMPTS[5]  # 25 tokens: target blocks through 24, draft blocks [0, 8) [8, 16) [16, 24)
    longer = (*shared, *b" over the lazy dog")

    async def fresh(prompt: tuple[int, ...]) -> tuple[list[int], list[tuple[int, ...]]]:
        built = build_engine("tiny", options(tp=tp, max_spec_k=2))
        async with built.engine:
            g = built.engine.generate(prompt, max_tokens=8, spec_k=2)
            tokens = await g.collect()
        return tokens, g.request.draft_history

    built = build_engine("tiny", options(tp=tp, max_spec_k=2))
    initial = free_counts(built)
    async with built.engine:
        generations = [built.engine.generate(p, max_tokens=8, spec_k=2) for p in (shared, shared, longer)]
        got = [(await g.collect(), g.request.draft_history) for g in generations]
    assert [g.statistics().reused_tokens for g in generations] == [0, 24, 24]
    for m in built.cache.managers:
        s = m.statistics()
        assert (s.draft_hit_tokens, s.draft_zeroed_tokens) == (48, 0)
    reference = [await fresh(shared), await fresh(longer)]
    assert all(drafts for _, drafts in reference)
    assert got == [reference[0], reference[0], reference[1]]
    assert_all_free(built, initial)


# --- draft reuse over a conversation ---------------------------------------------------------------------------

#: each turn's new prompt; a turn's whole prompt is every earlier prompt and answer, then its new prompt
TURNS: list[tuple[int, ...]] = [
    tuple(b"what is a kv cache?"),
    tuple(b"and draft kv?"),
    tuple(b"why reuse it"),
    tuple(b"ok"),
]


def poison_free_draft_pages(built: BuiltEngine, seed: int) -> None:
    """Garbage in every free draft page that holds no cached block (what a recycled page may hold)."""
    for manager, arena in zip(built.cache.managers, built.arenas, strict=True):
        draft = manager._pools.draft
        assert draft is not None
        arena.fill_garbage(
            "draft", [p for p in draft.free_page_ids() if draft.block_hash(p) is None], seed=seed
        )


@define(eq=False)
class Conversation:
    """A run of :data:`TURNS`: per turn its prompt, answer and draft proposals, and from rank 0's manager its
    reused tokens, draft hit tokens and zero-filled draft tokens."""

    prompts: list[tuple[int, ...]] = attrs.field(factory=list)
    answers: list[list[int]] = attrs.field(factory=list)
    proposals: list[list[tuple[int, ...]]] = attrs.field(factory=list)
    reuse: list[tuple[int, int, int]] = attrs.field(factory=list)


async def conversation(built: BuiltEngine, k: int, max_tokens: int, *, poison: bool = False) -> Conversation:
    """Run :data:`TURNS` as a conversation, one request a turn (with ``poison``, garbage in the free draft
    pages before each turn)."""
    out = Conversation()
    manager = built.cache.primary
    history: tuple[int, ...] = ()
    with anyio.fail_after(120):
        async with built.engine as engine:
            for i, new in enumerate(TURNS):
                prompt = (*history, *new)
                if poison:
                    poison_free_draft_pages(built, seed=i)
                before = manager.statistics()
                g = engine.generate(prompt, max_tokens=max_tokens, spec_k=k)
                answer = await g.collect()
                after = manager.statistics()
                out.reuse.append(
                    (
                        g.statistics().reused_tokens,
                        after.draft_hit_tokens - before.draft_hit_tokens,
                        after.draft_zeroed_tokens - before.draft_zeroed_tokens,
                    )
                )
                out.prompts.append(prompt)
                out.answers.append(answer)
                out.proposals.append(g.request.draft_history)
                history = (*prompt, *answer)
    return out


@pytest.mark.anyio
@pytest.mark.parametrize("tp", [1, 2])
async def test_a_conversation_gives_fresh_tokens_and_its_draft_match_grows_turn_over_turn(tp: int) -> None:
    """Each turn of a conversation reuses the turn before; snapshots at every block let the target's reuse
    reach past the draft KV the turn before could index (its catch-up lags one step), so each turn has a gap.
    With draft reuse the blocks computed after a gap are indexed and the next turn's draft match covers them;
    without it the reused prefix's draft KV is zero-filled. Tokens are a fresh run's either way, and garbage
    in recycled draft pages changes no proposal."""
    k, max_tokens = 3, 12
    runs = {}
    for draft_reuse, poison in ((True, False), (True, True), (False, True)):
        built = build_engine(
            "tiny", options(tp=tp, max_spec_k=k, snapshot_interval=4, draft_reuse=draft_reuse)
        )
        initial = free_counts(built)
        runs[draft_reuse, poison] = await conversation(built, k, max_tokens, poison=poison)
        assert_all_free(built, initial)
    on, off = runs[True, False], runs[False, True]
    fresh = await run_all(
        build_engine("tiny", options(tp=tp, max_spec_k=k, enable_reuse=False)),
        on.prompts,
        [max_tokens] * len(on.prompts),
        spec_k=k,
        sequential=True,
    )
    assert on.answers == fresh
    assert (off.prompts, off.answers) == (on.prompts, fresh)
    poisoned = runs[True, True]
    assert (poisoned.answers, poisoned.proposals, poisoned.reuse) == (on.answers, on.proposals, on.reuse)
    reused = [r for r, _, _ in on.reuse]
    hits = [h for _, h, _ in on.reuse]
    assert all(r > 0 for r in reused[1:])
    assert any(z for _, _, z in on.reuse)  # gaps happened
    # the draft match grows turn over turn, past the whole reuse of the turn before (so it covers what that
    # turn's drafter wrote after its gap), and is never longer than the target's reuse
    assert all(hits[i] > reused[i - 1] for i in range(2, len(hits)))
    assert all(h <= r for r, h, _ in on.reuse)
    # without draft reuse nothing of the draft KV is reused: the whole reused prefix is zero-filled
    assert [(h, z) for _, h, z in off.reuse] == [(0, r) for r, _, _ in off.reuse]
