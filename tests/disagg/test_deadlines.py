"""Every wait of disaggregated serving on the other side has a deadline and ends in a typed error.

A context side that stops answering (its handling paused, its engine stalled in a model step, its process
stopped with SIGSTOP) fails the prefill with :class:`~kvferry.errors.PrefillTimeout` within the generation
worker's ``prefill_timeout``; the context side is told to drop the request, so once it runs again it frees
everything (it stops the prefill, never answers, never pushes), and the next requests on the same connection
get aggregated serving's tokens. A silent peer fails the handshake (:class:`~kvferry.errors.PeerTimeout`), a
context process that never says where it listens fails its start, and a prefill asked of a peer that is gone
fails at once.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from kvferry.disagg.protocol import ContextRequest, decode_control
from kvferry.disagg.roles import ContextWorker, GenerationWorker
from kvferry.disagg.serve import _await_address, disaggregated, start_context_process
from kvferry.engine.runner import build_engine
from kvferry.errors import (
    ConfigError,
    PeerDisconnected,
    PeerTimeout,
    PrefillTimeout,
    TransferError,
    TransferTimeout,
    WireFormatError,
)
from kvferry.transports import Peer, Transport, get_transport
from tests.support.disagg_pair import Pair, StepGate, counts, first_chunk_of, gate_steps, options, pair, until
from tests.support.disagg_reference import MAX_TOKENS, PROMPTS, SPEC_K, aggregated

pytestmark = pytest.mark.timeout(120)

#: a prompt of three prefill chunks
LONG = [random.Random(21).randrange(256) for _ in range(150)]
#: the deadline of the tests' prefills (seconds)
PREFILL = 0.5

_expected: dict[tuple[int, ...], list[int]] = {}


async def expected(prompt: Sequence[int]) -> list[int]:
    if not _expected:
        prompts = [LONG, *PROMPTS]
        tokens, _ = await aggregated(prompts)
        _expected.update({tuple(p): t for p, t in zip(prompts, tokens, strict=True)})
    return _expected[tuple(prompt)]


async def serves_on(p: Pair) -> None:
    """The same connection serves the next requests with aggregated serving's tokens."""
    with anyio.fail_after(30):
        for prompt in (PROMPTS[0], LONG):
            tokens = await p.router.generate(prompt, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
            assert tokens == await expected(prompt)


async def times_out(p: Pair, prompt: Sequence[int]) -> float:
    """Route ``prompt``; it must fail with PrefillTimeout: the seconds it took."""
    started = anyio.current_time()
    with anyio.fail_after(10), pytest.raises(PrefillTimeout) as info:
        await p.router.generate(prompt, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
    assert isinstance(info.value, TransferTimeout) and isinstance(info.value, TimeoutError)
    return anyio.current_time() - started


@pytest.mark.parametrize("stall", ["handling_paused", "step_stalled"])
@pytest.mark.anyio
async def test_a_context_side_that_never_answers_fails_the_prefill_in_time_and_frees_everything(
    stall: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await expected(LONG)
    gate = StepGate(first_chunk_of(LONG))
    paused = anyio.Event()
    resumed = anyio.Event()
    if stall == "handling_paused":
        # the context side reads the request and then does nothing with it (a stopped handler)
        original = ContextWorker._prefill_and_push

        async def prefill_and_push(self: ContextWorker, *args: Any) -> None:
            if not resumed.is_set():
                paused.set()
                await resumed.wait()
            await original(self, *args)

        monkeypatch.setattr(ContextWorker, "_prefill_and_push", prefill_and_push)
    ctx_options = options(step_in_thread=True)
    async with pair(ctx_options=ctx_options, worker={"prefill_timeout": PREFILL}) as p:
        if stall == "step_stalled":
            # the context engine runs the prompt's first chunk and then hangs in that step
            gate_steps(monkeypatch, p.ctx.runner, gate)
        ctx_before, gen_before = counts(p.ctx), counts(p.gen)
        try:
            seconds = await times_out(p, LONG)
            # the deadline, plus at most the bounded ReleaseContext (control_timeout) and some scheduling
            assert PREFILL <= seconds < PREFILL + p.worker.control_timeout + 0.5, seconds
            assert paused.is_set() or gate.entered.is_set()
            assert not any(link.waiting for link in p.worker.links)  # nothing is left waiting for the answer
            assert counts(p.gen) == gen_before  # nothing was allocated for it
        finally:
            resumed.set()  # the context side runs again
            gate.open()
        # it was told to drop the request: it stops the prefill, never answers it, frees everything
        await until(lambda: not p.context.statistics()["held"], 5, p.context.statistics)
        await p.ctx.engine.wait_idle()
        await until(lambda: counts(p.ctx) == ctx_before, 5, lambda: (counts(p.ctx), ctx_before))
        s = p.context.statistics()
        assert (s["prefilled"], s["released"], s["pushed"], s["failed"]) == (0, 1, 0, 0), s
        await serves_on(p)
        await p.gen.engine.wait_idle()
        await p.ctx.engine.wait_idle()
        assert counts(p.gen) == gen_before and counts(p.ctx) == ctx_before


class _CancelOnRequest:
    """The generation side's transport: cancels ``scope`` right after a ContextRequest went out."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.scope: anyio.CancelScope | None = None

    async def send_message(self, peer: Peer, data: bytes) -> None:
        await self.inner.send_message(peer, data)
        try:
            message = decode_control(data)
        except WireFormatError:  # the handshake
            return
        if isinstance(message, ContextRequest) and self.scope is not None:
            self.scope.cancel()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _Together:
    """The context side's transport: the first ContextRequest is handed to the reader together with the message
    after it, with no scheduling point between the two (the prefill task started for the first has not run yet
    when the second is handled)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self._pending: list[bytes] = []
        self._armed = True

    async def receive_message(self, peer: Peer) -> bytes:
        if self._pending:
            return self._pending.pop(0)
        data = await self.inner.receive_message(peer)
        try:
            message = decode_control(data)
        except WireFormatError:  # the handshake
            return data
        if isinstance(message, ContextRequest) and self._armed:
            self._armed = False
            self._pending.append(await self.inner.receive_message(peer))
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.mark.anyio
async def test_a_request_released_before_its_prefill_task_runs_is_never_prefilled() -> None:
    """The caller gives up right after asking: its ReleaseContext reaches the context side with the request
    (before its prefill task first ran). The release finds the request (before: it was ignored, the prompt was
    prefilled and its cache held for ``hold_timeout``), and the prefill never runs."""
    await expected(LONG)
    tap: list[_CancelOnRequest] = []

    def wrap_gen(transport: Transport) -> _CancelOnRequest:
        tap.append(_CancelOnRequest(transport))
        return tap[0]

    async with pair(wrap_gen=wrap_gen, wrap_ctx=_Together) as p:
        ctx_before, gen_before = counts(p.ctx), counts(p.gen)
        with anyio.fail_after(10):
            with anyio.CancelScope() as scope:
                tap[0].scope = scope
                await p.router.generate(LONG, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
            tap[0].scope = None
            assert scope.cancelled_caught
            await until(lambda: p.context.statistics()["released"] == 1, 5, p.context.statistics)
        s = p.context.statistics()
        assert (s["prefilled"], s["held"]) == (0, 0), s
        await p.ctx.engine.wait_idle()
        assert p.ctx.engine.statistics().num_steps == 0  # never prefilled
        assert counts(p.ctx) == ctx_before and counts(p.gen) == gen_before
        await serves_on(p)


@pytest.mark.anyio
async def test_a_prefill_asked_of_a_peer_that_is_gone_fails_at_once() -> None:
    async with pair(worker={"prefill_timeout": 60.0}) as p:
        await p.peer.aclose()
        await until(lambda: p.worker.receiver is not None and p.worker.receiver.lost, 5, lambda: p.worker)
        with anyio.fail_after(5), pytest.raises(TransferError, match="went away"):
            await p.router.generate(PROMPTS[0], max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
        assert p.worker.links == []  # the gone peer, with nothing left in flight, is forgotten


@pytest.mark.anyio
async def test_a_prompt_the_context_engine_refuses_is_answered_and_it_serves_on() -> None:
    """A request the context engine refuses outright (a token outside its vocabulary) is answered as failed
    (before: the refusal escaped the worker's task group and ended the whole connection)."""
    await expected(LONG)
    async with pair() as p:
        vocab = p.ctx.runner.vocab_size
        with anyio.fail_after(10), pytest.raises(TransferError, match="ConfigError"):
            await p.router.generate([1, vocab + 5], max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
        assert p.context.statistics()["failed"] == 1
        await serves_on(p)


@asynccontextmanager
async def silent_peer() -> AsyncIterator[tuple[Any, Any, Any]]:
    """Two connected local transports whose far side never says anything: (ours, our peer, theirs)."""
    factory = get_transport("local")
    async with factory() as ours, factory() as theirs:
        peer = await ours.connect(theirs.address)
        await theirs.accept()
        yield ours, peer, theirs


@pytest.mark.parametrize("role", ["generation", "context"])
@pytest.mark.anyio
async def test_a_handshake_with_a_silent_peer_times_out(role: str) -> None:
    built = build_engine("tiny", options())
    async with silent_peer() as (ours, peer, _):
        started = anyio.current_time()
        async with anyio.create_task_group() as tg:
            with anyio.fail_after(5), pytest.raises(PeerTimeout) as info:
                if role == "generation":
                    await GenerationWorker(built, ours, handshake_timeout=0.3).connect(peer, tg)
                else:
                    await ContextWorker(built, ours, handshake_timeout=0.3).serve(peer)
        assert 0.3 <= anyio.current_time() - started < 2.0
        assert isinstance(info.value, PeerDisconnected) and isinstance(info.value, TimeoutError)


def test_a_context_process_that_never_listens_is_killed_after_its_start_deadline() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; print('noise', flush=True); time.sleep(60)"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerTimeout, match="did not listen"):
            _await_address(proc, 0.5)
        assert time.monotonic() - t0 < 5
        assert proc.poll() is not None  # killed
    finally:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def test_deadlines_must_be_positive() -> None:
    built = build_engine("tiny", options())
    for field in ("prefill_timeout", "handshake_timeout", "control_timeout", "stall_timeout"):
        with pytest.raises(ConfigError, match=field):
            GenerationWorker(built, object(), **{field: 0})  # type: ignore[arg-type]
    for field in ("hold_timeout", "handshake_timeout", "control_timeout"):
        with pytest.raises(ConfigError, match=field):
            ContextWorker(built, object(), **{field: -1.0})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="start_timeout"):
        start_context_process("local", 1, 0, 0, start_timeout=0)


@pytest.mark.slow  # two OS processes over nixl (about 30 s on 2 cores)
@pytest.mark.anyio
async def test_a_stopped_context_process_fails_the_prefill_in_time() -> None:
    """The issue's case: the context engine's process is stopped (SIGSTOP). The prefill fails within its
    deadline instead of waiting until the process runs again; afterwards the same connection serves on."""
    await expected(LONG)
    async with disaggregated(transport="nixl", spec_k=SPEC_K, separate_process=True) as (router, parts):
        worker, gen = parts["worker"], parts["gen"]
        gen_before = counts(gen)
        with anyio.fail_after(60):  # the first prefill of a fresh process warms it up (seconds on 2 cores)
            for prompt in (PROMPTS[0], LONG):
                tokens = await router.generate(prompt, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
                assert tokens == await expected(prompt)
        await gen.engine.wait_idle()
        worker.prefill_timeout = 1.0
        with pytest.raises(ConfigError):
            worker.prefill_timeout = 0.0  # checked when set too
        pid = parts["context"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            started = anyio.current_time()
            with anyio.fail_after(10), pytest.raises(PrefillTimeout):
                await router.generate(LONG, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
            seconds = anyio.current_time() - started
            assert 1.0 <= seconds < 1.0 + worker.control_timeout + 1.0, seconds
            assert counts(gen) == gen_before
        finally:
            os.kill(pid, signal.SIGCONT)
        with anyio.fail_after(30):
            for prompt in (LONG, PROMPTS[1]):
                tokens = await router.generate(prompt, max_tokens=MAX_TOKENS, spec_k=SPEC_K).collect()
                assert tokens == await expected(prompt)
        await gen.engine.wait_idle()
        assert counts(gen) == gen_before
