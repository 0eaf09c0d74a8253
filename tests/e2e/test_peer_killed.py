"""The context engine's OS process is killed (SIGKILL) in the middle of a transfer: the generation side gets a
typed error within its deadline, gives back every page it had allocated, and keeps serving its other requests
with the right tokens."""

from __future__ import annotations

import os
import random
import signal
import time

import anyio
import pytest

from kvferry.disagg.roles import GenerationWorker
from kvferry.disagg.serve import _options, disaggregated
from kvferry.disagg.session import ReceiveState
from kvferry.engine.runner import BuiltEngine, build_engine
from kvferry.errors import KvferryError, TransferError

pytestmark = pytest.mark.timeout(120)

SPEC_K = 2
STALL_TIMEOUT = 20.0
DEADLINE = (
    10.0  # the typed error comes from the transport noticing the dead peer, well before the stall timeout
)
rng = random.Random(11)
ROUTED = [rng.randrange(256) for _ in range(60)]
LOCAL = [rng.randrange(256) for _ in range(20)]


async def aggregated(prompt: list[int], max_tokens: int) -> list[int]:
    built = build_engine("tiny", _options(1, SPEC_K, 0, "float64"))
    async with built.engine:
        return await built.engine.generate(prompt, max_tokens=max_tokens, spec_k=SPEC_K).collect()


def mid_transfer(worker: GenerationWorker) -> bool:
    """Some chunk of a requested transfer has landed (reported) and some has not."""
    assert worker.receiver is not None
    for live in worker.receiver._sessions.values():
        session = live.session
        if session.state is ReceiveState.REQUESTED and session._reports:
            return True
    return False


def free_counts(built: BuiltEngine) -> list[tuple[int, int, int, int]]:
    """Per rank: free pages, free draft pages, free slots (snapshots are evictable prefix cache), quarantines."""
    out = []
    for m in built.cache.managers:
        s = m.statistics()
        out.append((s.pages_free, s.draft_pages_free, s.slots_free + s.slots_snapshot, s.quarantines))
    return out


@pytest.mark.parametrize("transport", ["nixl", "ucx"])
@pytest.mark.anyio
async def test_context_process_killed_mid_transfer(transport: str) -> None:
    expected_local = await aggregated(LOCAL, 24)
    expected_routed = await aggregated(ROUTED, 6)
    async with disaggregated(
        transport=transport,
        spec_k=SPEC_K,
        stall_timeout=STALL_TIMEOUT,
        chunk_bytes=1024,
        write_delay=0.02,
    ) as (router, parts):
        gen, worker, context = parts["gen"], parts["worker"], parts["context"]
        initial = free_counts(gen)
        # a whole routed request first: the slow transfer works
        assert await router.generate(ROUTED, max_tokens=6, spec_k=SPEC_K).collect() == expected_routed
        outcome: dict[str, object] = {}

        async def routed() -> None:
            try:
                outcome["tokens"] = await router.generate(ROUTED, max_tokens=6, spec_k=SPEC_K).collect()
            except KvferryError as exc:
                outcome["error"] = exc
                outcome["at"] = time.monotonic()

        async def local() -> None:
            outcome["local"] = await gen.engine.generate(LOCAL, max_tokens=24, spec_k=SPEC_K).collect()

        async with anyio.create_task_group() as tg:
            tg.start_soon(routed)
            with anyio.fail_after(30):
                while not mid_transfer(worker):  # noqa: ASYNC110
                    await anyio.sleep(0.005)
            tg.start_soon(local)  # another request on the generation engine, decoding while the peer dies
            os.kill(context.pid, signal.SIGKILL)
            killed = time.monotonic()
        assert isinstance(outcome.get("error"), TransferError), outcome
        assert outcome["at"] - killed < DEADLINE  # type: ignore[operator]
        assert outcome["local"] == expected_local
        await gen.engine.wait_idle()
        with anyio.fail_after(DEADLINE):  # quarantined pages come back once the peer is known to be gone
            while free_counts(gen) != [(*free[:3], 0) for free in initial]:  # noqa: ASYNC110
                await anyio.sleep(0.05)
        assert worker.receiver is not None and worker.receiver.statistics()["sessions"] == 0
        assert not gen.runner._fed
