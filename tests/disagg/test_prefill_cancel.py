"""A context prefill cancelled at any point leaves the context engine's step loop running and frees everything.

The hazard (a SIGINT during ``kvferry demo`` reaches it): a context worker's cleanup that closes the request in
the cache manager while the engine still has it, either running a step over its pages (a step in a worker
thread) or holding that step's commit for the next flush (a prompt prefilled in several chunks: the commits of
a step reach the manager when the next step is planned or the request ends). The engine's next flush (reaping
the cancelled request) would then commit tokens of a request the manager no longer holds:
:class:`~kvferry.errors.UnknownRequest` out of the step loop, which ends the engine.

Each case cancels the prefill task exactly at one point, forced with hooks (a model step held in its worker
thread, a commit hook, a push slowed down), while another request runs on the same engine; then the engine
must serve that request and the next ones with the tokens of aggregated serving, and both sides must be back
to their free memory.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Sequence
from typing import Any

import anyio
import pytest

from kvferry.disagg.roles import ContextWorker, HandoffCache
from kvferry.engine.request import Request
from kvferry.engine.runner import build_engine
from kvferry.engine.scheduler import Scheduler
from tests.support.disagg_pair import Pair, StepGate, counts, first_chunk_of, gate_steps, options, pair, until
from tests.support.disagg_reference import MAX_TOKENS, PROMPTS, SPEC_K, aggregated

pytestmark = pytest.mark.timeout(120)

#: three prefill chunks of at most 64 tokens (the engine's max_prefill_chunk): commits wait between steps
LONG = [random.Random(11).randrange(256) for _ in range(150)]
#: a request that runs on the context engine throughout (started before the cancel, ends after it)
BYSTANDER = [random.Random(12).randrange(256) for _ in range(70)]

_expected: dict[tuple[int, ...], list[int]] = {}


async def expected(prompt: Sequence[int]) -> list[int]:
    if not _expected:
        prompts = [LONG, BYSTANDER, *PROMPTS]
        tokens, _ = await aggregated(prompts)
        _expected.update({tuple(p): t for p, t in zip(prompts, tokens, strict=True)})
    return _expected[tuple(prompt)]


class Prefills:
    """Runs every context prefill task in a cancel scope the test can reach; records when each one ended, and
    what the engine still had of the request when the worker released its cache."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, p: Pair) -> None:
        self.scopes: list[anyio.CancelScope] = []
        self.ended = anyio.Event()
        #: per release of a context request: (still a request of the engine, its commits not yet flushed)
        self.releases: list[tuple[bool, int]] = []
        original = ContextWorker._prefill_and_push
        original_release = HandoffCache.release
        prefills = self

        async def prefill_and_push(self: ContextWorker, *args: Any) -> None:
            with anyio.CancelScope() as scope:
                prefills.scopes.append(scope)
                try:
                    await original(self, *args)
                finally:
                    prefills.ended.set()

        def release(self: HandoffCache, request_id: int) -> None:
            if self is p.context.cache:
                engine = p.ctx.engine
                # private state on purpose: it proves the interleaving each case forces
                pending = sum(1 for c in engine.scheduler._commits if c[0] == request_id)
                prefills.releases.append((request_id in engine._requests, pending))
            original_release(self, request_id)

        monkeypatch.setattr(ContextWorker, "_prefill_and_push", prefill_and_push)
        monkeypatch.setattr(HandoffCache, "release", release)

    def cancel(self) -> None:
        (scope,) = self.scopes
        scope.cancel()


@pytest.mark.parametrize("point", ["queued", "in_step", "after_step", "in_push"])
@pytest.mark.anyio
async def test_a_prefill_cancelled_at_any_point_leaves_the_engine_serving(
    point: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await expected(LONG)
    # model steps in a worker thread (the event loop runs while a step does: a cancel can land in it)
    ctx_options = options(step_in_thread=True)
    context: dict[str, Any] = {}
    if point == "in_push":
        context = {"write_delay": 0.05, "max_chunk_bytes": 2048}  # the push lasts
    async with pair(ctx_options=ctx_options, context=context) as p:
        ctx_before, gen_before = counts(p.ctx), counts(p.gen)
        prefills = Prefills(monkeypatch, p)
        gate = StepGate(first_chunk_of(BYSTANDER if point == "queued" else LONG))
        if point in ("queued", "in_step"):
            gate_steps(monkeypatch, p.ctx.runner, gate)
        if point == "after_step":
            original_commit = Scheduler.commit

            def commit(self: Scheduler, request: Request, num_computed: int, **kwargs: Any) -> None:
                original_commit(self, request, num_computed, **kwargs)
                ours = self is p.ctx.engine.scheduler and request.prompt_ids == tuple(LONG)
                if ours and num_computed < len(LONG):  # the first chunk's commit: recorded, not flushed yet
                    prefills.cancel()

            monkeypatch.setattr(Scheduler, "commit", commit)
        bystander: list[int] = []
        routed = anyio.CancelScope()
        with anyio.fail_after(30), contextlib.ExitStack() as stack:
            stack.callback(gate.open)  # never leave a step held, whatever fails
            async with anyio.create_task_group() as tg:

                async def run_bystander() -> None:
                    bystander.extend(
                        await p.ctx.engine.generate(BYSTANDER, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
                    )

                async def run_routed() -> None:
                    # ended by the test once the context side gave up (it would wait until its deadlines)
                    with routed:
                        await p.router.generate(LONG, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
                        pytest.fail("the routed request ended before it was cancelled")

                tg.start_soon(run_bystander)
                if point == "queued":
                    await (
                        gate.entered.wait()
                    )  # the bystander's step runs; the loop plans nothing else meanwhile
                tg.start_soon(run_routed)
                if point == "queued":
                    scheduler = p.ctx.engine.scheduler
                    await until(
                        lambda: any(r.prompt_ids == tuple(LONG) for r in scheduler.waiting),
                        10,
                        lambda: scheduler.waiting,
                    )
                    prefills.cancel()
                elif point == "in_step":
                    await gate.entered.wait()  # LONG's first chunk is in the model step, not applied
                    prefills.cancel()
                elif point == "in_push":
                    await until(lambda: p.context.statistics()["sending"] == 1, 10, p.context.statistics)
                    prefills.cancel()
                await prefills.ended.wait()
                gate.open()
                routed.cancel()
        assert bystander == await expected(BYSTANDER)
        (still_engine, pending) = prefills.releases[0]
        if point in ("in_step", "after_step"):
            # the worker let go while the engine still had the request: running a step over its pages, or
            # with that step's commit not yet in the manager
            assert still_engine
            assert pending == (1 if point == "after_step" else 0)
        if point == "in_push":
            assert not still_engine  # the engine closed it into the hold before the push
        await p.ctx.engine.wait_idle()
        await until(lambda: counts(p.ctx) == ctx_before, 5, lambda: (counts(p.ctx), ctx_before))
        await until(lambda: counts(p.gen) == gen_before, 10, lambda: (counts(p.gen), gen_before, p.worker))
        s = p.context.statistics()
        assert (s["held"], s["sending"], s["staging_used"]) == (0, 0, 0), s
        # the context engine serves on, alone and through the router, with aggregated serving's tokens
        assert await p.ctx.engine.generate(LONG, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect() == (
            await expected(LONG)
        )
        with anyio.fail_after(30):
            for prompt in (LONG, PROMPTS[0]):
                routed_tokens = await p.router.generate(
                    prompt, max_tokens=MAX_TOKENS, spec_k=SPEC_K
                ).collect()
                assert routed_tokens == await expected(prompt)
        await p.ctx.engine.wait_idle()
        await p.gen.engine.wait_idle()
        assert counts(p.ctx) == ctx_before and counts(p.gen) == gen_before


def test_a_request_whose_admission_did_not_fit_is_not_held() -> None:
    """The scheduler closes a request whose admission did not fit and creates it again later: that close must
    not hold it (it would exist twice), only the close of a request whose prompt is all committed does."""
    built = build_engine("tiny", options())
    cache = HandoffCache(built.cache)
    manager = built.cache.primary
    free = manager.statistics().pages_free
    held: list[int] = []
    prompt = list(range(1, 40))
    cache.hold(7, held.append)
    cache.create(7, prompt)
    cache.close(7)  # the admission's roll-back: nothing committed
    assert held == [] and 7 not in manager.request_ids()
    cache.create(7, prompt)  # admitted again
    cache.resume(7)
    cache.commit(7, prompt[:20])
    cache.close(7)  # cancelled mid-prefill: closed, not held
    assert held == [] and 7 not in manager.request_ids()
    cache.release(7)  # the worker's cleanup afterwards: nothing left to free, the hold dropped
    assert 7 not in manager.request_ids()
    cache.hold(7, held.append)  # a later request with the same id
    cache.create(7, prompt)
    cache.resume(7)
    cache.commit(7, prompt)
    cache.close(7)  # the prompt is all there: held, suspended
    assert held == [7] and 7 in manager.request_ids()
    cache.release(7)
    assert 7 not in manager.request_ids() and manager.statistics().pages_free == free


def test_release_of_a_request_the_engine_still_has_waits_for_the_engine() -> None:
    built = build_engine("tiny", options())
    cache = HandoffCache(built.cache)
    manager = built.cache.primary
    prompt = list(range(1, 100))
    cache.hold(3, lambda rid: None)
    cache.create(3, prompt)
    cache.resume(3)
    cache.commit(3, prompt[:64])
    cache.release(3)  # the engine has it (a step may run over its pages): nothing freed yet
    assert 3 in manager.request_ids()
    cache.commit(3, prompt[64:])  # the engine's pending commit still lands
    cache.close(3)  # the engine's close frees it (the hold was dropped)
    assert 3 not in manager.request_ids()
