"""The public serving API (:func:`kvferry.open_service`): submit validates and queues, handles stream and end with
a finish reason, cancel frees everything, a request that can never fit is refused with its sizes, and statistics
add up; aggregated and disaggregated (local transport) alike."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

import kvferry
from kvferry import (
    ConfigError,
    DisaggOptions,
    EngineClosed,
    FinishReason,
    RequestTooLarge,
    Service,
    ServiceOverloaded,
)
from kvferry.engine.engine import Engine
from kvferry.engine.runner import EngineOptions, build_engine
from tests.support.disagg_pair import until

pytestmark = pytest.mark.timeout(120)

OPTIONS = EngineOptions(dtype="float64", max_spec_k=2, num_pages=64, max_running=4)
MODES = ["aggregated", "disaggregated"]


@asynccontextmanager
async def service(mode: str, **kwargs: object) -> AsyncIterator[Service]:
    disagg = DisaggOptions(transport="local", separate_process=False) if mode == "disaggregated" else None
    async with kvferry.open_service("tiny", engine=OPTIONS, disagg=disagg, **kwargs) as s:  # type: ignore[arg-type]
        yield s


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


async def offline(batch: list[list[int]], max_tokens: int) -> list[list[int]]:
    built = build_engine("tiny", OPTIONS)
    async with built.engine:
        return [await built.engine.generate(p, max_tokens=max_tokens, spec_k=2).collect() for p in batch]


def occupancy(s: Service) -> tuple[int, int, int]:
    pools = s.statistics().pools
    return pools.slots_live, pools.requests_on_host, pools.draft_pages_used


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.anyio
async def test_many_concurrent_requests_complete_with_offline_tokens(mode: str) -> None:
    batch = prompts(30)
    expected = await offline(batch, 10)
    async with service(mode) as s:
        handles = [await s.submit(p, max_tokens=10) for p in batch]
        results = [await h.result() for h in handles]
        assert [list(r.token_ids) for r in results] == expected
        assert all(r.finish_reason is FinishReason.LENGTH and r.error is None for r in results)
        # a second reader of a finished handle sees every token too
        assert [t async for t in handles[0]] == expected[0]
        stats = s.statistics()
        assert stats.submitted == 30 and stats.finished["length"] == 30 and stats.active == 0
        assert stats.tokens_generated == 300
        assert stats.ttft_seconds.samples == 30 and stats.queue_seconds.samples == 30
        assert stats.ttft_seconds.p50 is not None and stats.ttft_seconds.p99 is not None
        assert stats.ttft_seconds.p50 <= stats.ttft_seconds.p99
        assert stats.inter_token_seconds.samples == 30 * 9
        if mode == "disaggregated":
            assert stats.handoff_seconds.samples == 30 and stats.backend["transfers"] == 30
        else:
            assert stats.handoff_seconds.samples == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.anyio
async def test_stop_ids_end_with_stop(mode: str) -> None:
    prompt = prompts(1, seed=2)[0]
    [tokens] = await offline([prompt], 8)
    async with service(mode) as s:
        result = await s.generate(prompt, max_tokens=8, stop_ids=[tokens[2]])
        assert result.finish_reason is FinishReason.STOP
        assert list(result.token_ids) == tokens[: tokens.index(tokens[2]) + 1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.anyio
async def test_cancel_frees_everything_and_it_serves_on(mode: str) -> None:
    async with service(mode) as s:
        await s.generate([1, 2, 3], max_tokens=2)  # the first request builds what stays (prefix cache)
        before = occupancy(s)
        handles = [await s.submit(p, max_tokens=200) for p in prompts(8, seed=4)]
        # wait until some tokens flow, then cancel everything: running, queued and in transfer alike
        await until(lambda: any(h.tokens for h in handles), 60, lambda: handles)
        for h in handles:
            h.cancel()
        results = [await h.result() for h in handles]
        assert all(r.finish_reason is FinishReason.CANCELLED and r.error is None for r in results)
        await until(
            lambda: occupancy(s) == before and not s.statistics().backend["running"], 10, s.statistics
        )
        assert s.statistics().finished["cancelled"] == 8
        assert (await s.generate([4, 5, 6], max_tokens=3)).finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.anyio
async def test_impossible_requests_are_refused_at_submission(mode: str) -> None:
    async with service(mode) as s:
        with pytest.raises(RequestTooLarge, match=r"needs \d+ pages .* lower max_tokens to \d+ or less"):
            await s.submit([1, 2, 3], max_tokens=10_000)
        with pytest.raises(RequestTooLarge, match="--num-pages"):
            await s.submit([7] * 1000, max_tokens=1)
        cases: list[tuple[dict[str, Any], str]] = [
            ({"prompt_ids": []}, "at least one"),
            ({"prompt_ids": [1, 100_000]}, r"in \[0, "),
            ({"prompt_ids": "text"}, "not text"),
            ({"prompt_ids": [1.5]}, "ints only"),
            ({"prompt_ids": [1], "max_tokens": 0}, "max_tokens"),
            ({"prompt_ids": [1], "spec_k": 9}, "spec_k"),
            ({"prompt_ids": [1], "temperature": -1.0, "seed": 3}, "temperature"),
            ({"prompt_ids": [1], "seed": -4}, "seed"),
        ]
        for bad, match in cases:
            kwargs = {"max_tokens": 4, **bad}
            with pytest.raises(ConfigError, match=match):
                await s.submit(**kwargs)
        stats = s.statistics()
        assert stats.submitted == 0 and stats.active == 0
        assert (await s.generate([1, 2], max_tokens=2)).ok


@pytest.mark.anyio
async def test_an_overfull_queue_refuses_and_a_closed_service_too() -> None:
    async with service("aggregated", max_queued=2) as s:
        held = [await s.submit([9, 9, 9], max_tokens=50) for _ in range(2)]
        # at most 4 rows: a burst beyond rows + max_queued is refused (the first two may be admitted already)
        refused = 0
        extra = []
        for _ in range(8):
            try:
                extra.append(await s.submit([8, 8], max_tokens=50))
            except ServiceOverloaded:
                refused += 1
        assert refused > 0
        for h in held + extra:
            h.cancel()
    with pytest.raises(EngineClosed):
        await s.submit([1], max_tokens=1)


@pytest.mark.anyio
async def test_leaving_the_service_cancels_running_requests() -> None:
    async with service("disaggregated") as s:
        handles = [await s.submit(p, max_tokens=200) for p in prompts(5, seed=8)]
        await until(lambda: all(h.tokens for h in handles), 30, lambda: handles)
    results = [await h.result() for h in handles]
    assert all(r.finish_reason is FinishReason.CANCELLED for r in results)


@pytest.mark.anyio
async def test_a_failed_request_ends_with_error_and_its_iteration_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A prompt the context engine refuses is answered as failed: the handle ends ``error`` with a typed
    error, iterating it raises that error, and the service serves on."""
    async with service("disaggregated") as s:
        ctx_engine = s.backend.parts["ctx"].engine  # type: ignore[attr-defined]
        original = Engine.generate

        def generate(self: Engine, *args: Any, **kwargs: Any) -> Any:
            if self is ctx_engine and list(args[0]) == [4, 5, 6]:
                raise ConfigError("refused by the test")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(Engine, "generate", generate)
        failed = await s.submit([4, 5, 6], max_tokens=4)
        result = await failed.result()
        assert result.finish_reason is FinishReason.ERROR and result.error is not None
        assert "refused by the test" in str(result.error)
        with pytest.raises(kvferry.TransferError, match="refused by the test"):
            async for _ in failed:
                pass
        assert s.statistics().finished["error"] == 1
        assert (await s.generate([4, 5, 7], max_tokens=3)).ok
