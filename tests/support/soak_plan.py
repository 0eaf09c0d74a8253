"""The soak's requests and their expected tokens (see :mod:`tests.support.soak`): :func:`make_plan` makes
the seeded random plan, :func:`reference` serves it on an unconstrained aggregated engine, and
:class:`ReferenceProcess` does that in another process while the soak runs (``python -m tests.support.soak_plan
ARGUMENTS`` prints the tokens as JSON).
"""

from __future__ import annotations

import enum
import json
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.abc
import attrs
from attrs import define, frozen

from kvferry.engine.runner import EngineOptions, build_engine

__all__ = ["SPEC_K", "Client", "ReferenceProcess", "SoakPlan", "SoakRequest", "make_plan", "reference"]

SPEC_K = 2
VOCAB = 256
#: the reference engine: pools and batch far beyond what the soak needs at once
REFERENCE = EngineOptions(
    dtype="float64", max_spec_k=SPEC_K, num_pages=2048, max_running=64, step_in_thread=False
)
#: the checkout this module belongs to (the reference process imports its kvferry)
ROOT = Path(__file__).resolve().parents[2]


class Client(enum.Enum):
    """What the client of one request does."""

    #: reads every token to the end
    READ = "read"
    #: cancels the request after a random delay
    CANCEL = "cancel"
    #: reads a few tokens, stops reading and cancels (a client that went away)
    DISCONNECT = "disconnect"


@frozen
class SoakRequest:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int
    #: None: greedy
    seed: int | None
    temperature: float
    spec_k: int
    stop_ids: tuple[int, ...]
    #: seconds after the previous request was submitted (and at most ``concurrency`` requests run at once)
    gap: float
    client: Client
    #: CANCEL: seconds after submit; DISCONNECT: tokens read before going away
    cancel_after: float = 0.0
    disconnect_after: int = 0


@frozen
class SoakPlan:
    #: what :func:`make_plan` was called with (it makes the same plan again from them)
    arguments: tuple[int, int, int, float, float]
    requests: tuple[SoakRequest, ...]
    #: before submitting the request of each index, a context engine restart starts (in its own task)
    restarts: tuple[int, ...]
    #: greedy requests read to the end before the measured run (they start the lazily started parts)
    warm_up: tuple[SoakRequest, ...]

    @property
    def seed(self) -> int:
        return self.arguments[1]


def make_plan(
    requests: int, seed: int, restarts: int, mean_gap: float = 0.02, mean_cancel: float = 0.5
) -> SoakPlan:
    """``requests`` seeded random requests (submitted ``mean_gap`` seconds apart on average; cancelling clients
    wait ``mean_cancel`` seconds on average) and ``restarts`` restart points spread over the middle of the run.

    Prompts of 1..60 tokens, some starting with one of a few shared prefixes (prefix-cache hits on both sides);
    max_tokens 1..40, half of them 1..12 (more requests start, transfer and end per second of decoding); greedy
    or seeded sampling; 0..2 draft tokens; now and then stop tokens.
    """
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(VOCAB) for _ in range(rng.randrange(4, 30))) for _ in range(4)]

    def prompt() -> tuple[int, ...]:
        length = rng.randint(1, 60)
        head = rng.choice(prefixes) if rng.random() < 0.3 else ()
        return (head + tuple(rng.randrange(VOCAB) for _ in range(length)))[:length]

    def one(index: int) -> SoakRequest:
        draw = rng.random()
        client = Client.CANCEL if draw < 0.10 else Client.DISCONNECT if draw < 0.15 else Client.READ
        max_tokens = rng.randint(1, 40 if rng.random() < 0.5 else 12)
        greedy = rng.random() < 0.5
        return SoakRequest(
            index,
            prompt(),
            max_tokens,
            None if greedy else rng.randrange(2**31),
            1.0 if greedy else rng.uniform(0.5, 1.5),
            rng.randint(0, SPEC_K),
            tuple(rng.randrange(VOCAB) for _ in range(3)) if rng.random() < 0.2 else (),
            rng.expovariate(1 / mean_gap),
            client,
            cancel_after=rng.expovariate(1 / mean_cancel),
            disconnect_after=rng.randint(1, max(1, max_tokens - 1)),
        )

    planned = tuple(one(i) for i in range(requests))
    middle = range(requests // 10, max(requests // 10 + restarts, 9 * requests // 10))
    points = tuple(sorted(rng.sample(middle, restarts)))
    warm = tuple(
        SoakRequest(requests + i, (7, 1, i + 2, 9, 5, 3), 4, None, 1.0, SPEC_K, (), 0.0, Client.READ)
        for i in range(4)
    )
    return SoakPlan((requests, seed, restarts, mean_gap, mean_cancel), planned, points, warm)


async def reference(requests: Sequence[SoakRequest]) -> dict[int, list[int]]:
    """Each request's tokens on one aggregated engine with ample pools (all at once), by index."""
    built = build_engine("tiny", REFERENCE)
    out: dict[int, list[int]] = {}

    async def one(r: SoakRequest) -> None:
        out[r.index] = await built.engine.generate(
            r.prompt,
            max_tokens=r.max_tokens,
            stop_ids=r.stop_ids,
            seed=r.seed,
            temperature=r.temperature,
            spec_k=r.spec_k,
        ).collect()

    async with built.engine, anyio.create_task_group() as tg:
        for r in requests:
            tg.start_soon(one, r)
    return out


@define(eq=False)
class ReferenceProcess:
    """:func:`reference` of one plan, computed by another process (``python -m tests.support.soak_plan``,
    running this checkout's kvferry) while the soak runs: on another core, where there is one."""

    process: anyio.abc.Process
    started: float = attrs.field(factory=time.perf_counter)
    #: seconds from its start to its end (0: not ended)
    seconds: float = 0.0
    _out: bytearray = attrs.field(factory=bytearray)
    _err: bytearray = attrs.field(factory=bytearray)
    _done: anyio.Event = attrs.field(factory=anyio.Event)

    @classmethod
    async def start(cls, plan: SoakPlan) -> ReferenceProcess:
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        process = await anyio.open_process(
            [sys.executable, "-m", "tests.support.soak_plan", json.dumps(plan.arguments)],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": path},
        )
        return cls(process)

    async def run(self) -> None:
        """Read what it prints until it ends."""
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_read_all, self.process.stdout, self._out)
                tg.start_soon(_read_all, self.process.stderr, self._err)
                await self.process.wait()
            self.seconds = time.perf_counter() - self.started
        finally:
            self._done.set()

    async def result(self, deadline: float) -> dict[int, list[int]]:
        """The tokens by request index."""
        with anyio.fail_after(deadline):
            await self._done.wait()
        code = self.process.returncode
        if code != 0:
            raise RuntimeError(f"the reference process failed ({code}): {self._err.decode()[-2000:]}")
        return {int(k): v for k, v in json.loads(self._out).items()}

    async def close(self) -> None:
        """End the process if it still runs (the soak failed before it needed the reference)."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                self.process.kill()
            await self.process.aclose()


async def _read_all(stream: anyio.abc.ByteReceiveStream | None, into: bytearray) -> None:
    assert stream is not None
    async for chunk in stream:
        into += chunk


def _reference_main(arguments: str) -> None:
    import torch

    torch.set_num_threads(1)  # as the test suites run
    plan = make_plan(*json.loads(arguments))
    print(json.dumps(anyio.run(reference, plan.requests + plan.warm_up)))


if __name__ == "__main__":
    _reference_main(sys.argv[1])
