"""The load generator behind ``kvferry bench serve``: one list of requests, driven through a service (in this
process, aggregated or disaggregated) or a running ``kvferry serve`` (over HTTP), measured per request.

A run is built from one seed: each request's prompt length, output length and prompt (random token ids in the
model's vocabulary), and with ``rate`` the Poisson arrival times. Every request is greedy with no stop tokens,
so it ends after exactly ``max_tokens`` tokens, and its tokens can be checked against offline greedy generation
(:func:`offline_reference`: a fresh engine of the same model, one request at a time).

The load is a closed loop (``concurrency`` requests in flight; a finished one is replaced at once) or an open
loop (``rate`` requests per second, Poisson arrivals, however many are in flight). Each request has a deadline
(``timeout``); one that misses it is cancelled and counted as a ``timeout`` error.

Disaggregated, the same requests run twice, through an aggregated service and through the disaggregated one
(same model, engine options and seed), and the handoff latency is judged as TTFT(disaggregated) -
TTFT(aggregated) per request (:func:`judge_handoff`). The aggregated pass runs its engine's steps on the event
loop, as the disaggregated generation engine does, so that the difference is the handoff and not where the
steps run.

Times are ``time.perf_counter()`` seconds. In this process a request's times are its
:class:`~kvferry.serving.RequestHandle`'s (submit, each token as the engine delivers it); over HTTP they are the
client's (just before the request is sent, each event as it arrives; tokens of one event share its time).
"""

from __future__ import annotations

import itertools
import random
import statistics
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractContextManager, asynccontextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import attrs
from attrs import define, frozen

from kvferry._percentile import nearest_rank
from kvferry.errors import ConfigError, KvferryError, MissingExtraError

if TYPE_CHECKING:
    from kvferry.engine.engine import Engine
    from kvferry.engine.runner import EngineOptions
    from kvferry.serving import DisaggOptions, Service

__all__ = [
    "BenchRequest",
    "LengthRange",
    "Outcome",
    "PassRun",
    "ServeBenchConfig",
    "ServeBenchRun",
    "judge_handoff",
    "make_requests",
    "offline_reference",
    "percentiles",
    "run_pass",
    "run_serve_bench",
    "summarize",
]

#: the handoff goal: median TTFT(disaggregated) - TTFT(aggregated) within one model step plus this
HANDOFF_SLACK_SECONDS = 0.002
#: seconds a cancelled request (its deadline passed) has to end before it is left behind
CANCEL_DEADLINE = 10.0


@frozen
class LengthRange:
    """A length drawn uniformly from ``[low, high]`` (one value when they are equal)."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """``"16:128"`` (uniform, both ends included) or ``"32"`` (fixed).

        :raises ValueError: not that form, or a length below 1, or ``low > high`` (the message says which).
        """
        parts = text.split(":")
        if len(parts) > 2:
            raise ValueError(f"not a length or a range LOW:HIGH: {text!r}")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"not a length or a range LOW:HIGH: {text!r}") from None
        low, high = values[0], values[-1]
        if low < 1:
            raise ValueError(f"lengths must be at least 1, got {text!r}")
        if low > high:
            raise ValueError(f"the range {text!r} is empty (LOW must not exceed HIGH)")
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@frozen
class BenchRequest:
    """One request of the run."""

    index: int
    prompt_ids: tuple[int, ...]
    max_tokens: int
    #: seconds after the pass starts at which it is sent (None: closed loop, sent when a slot is free)
    arrival: float | None


def make_requests(
    count: int,
    *,
    prompt_len: LengthRange,
    output_len: LengthRange,
    vocab_size: int,
    seed: int,
    rate: float | None = None,
    purpose: str = "requests",
) -> list[BenchRequest]:
    """``count`` requests from ``seed``: lengths and prompt token ids from one generator, Poisson arrivals
    (``rate`` per second; None: closed loop) from another, so that the prompts do not depend on ``rate``.
    Another ``purpose`` (``"warmup"``) draws other prompts from the same seed."""
    rng = random.Random(f"kvferry bench serve {seed} {purpose}")
    arrivals = random.Random(f"kvferry bench serve {seed} {purpose} arrivals")
    requests: list[BenchRequest] = []
    clock = 0.0
    for index in range(count):
        prompt = tuple(rng.randrange(vocab_size) for _ in range(prompt_len.draw(rng)))
        max_tokens = output_len.draw(rng)
        arrival = None
        if rate is not None:
            arrival = clock
            clock += arrivals.expovariate(rate)
        requests.append(BenchRequest(index, prompt, max_tokens, arrival))
    return requests


@define
class Outcome:
    """What happened to one request (times are ``perf_counter`` seconds)."""

    index: int
    prompt_tokens: int
    max_tokens: int
    sent_at: float
    ended_at: float
    token_ids: list[int] = attrs.field(factory=list)
    #: when each token arrived (tokens delivered together share a time)
    token_times: list[float] = attrs.field(factory=list)
    #: None: it completed; else a short name of what went wrong (an error type, ``timeout``, ``http_503``...)
    error_kind: str | None = None
    error: str | None = None
    #: submit -> admitted by the engine that decodes it (None: not known, e.g. over HTTP)
    queue_seconds: float | None = None
    #: the service's own measure of a disaggregated request's cache transfer (None: aggregated or unknown)
    transfer_seconds: float | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def inter_token(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in itertools.pairwise(times)]


class Target(Protocol):
    """Where requests go: :meth:`send` runs one request to its end and never raises for its failure."""

    async def send(self, request: BenchRequest, time_limit: float) -> Outcome: ...


@frozen
class ServiceTarget:
    """A :class:`~kvferry.serving.Service` in this process."""

    service: Service

    async def send(self, request: BenchRequest, time_limit: float) -> Outcome:
        sent = time.perf_counter()
        try:
            handle = await self.service.submit(request.prompt_ids, max_tokens=request.max_tokens)
        except KvferryError as exc:
            return _failed(request, sent, type(exc).__name__, str(exc))
        kind: str | None = None
        with anyio.move_on_after(time_limit) as deadline:
            await handle.wait()
        if deadline.cancelled_caught:
            kind = "timeout"
            handle.cancel()
            with anyio.move_on_after(CANCEL_DEADLINE):
                await handle.wait()
        result = await handle.result() if handle.done else None
        outcome = Outcome(
            request.index,
            len(request.prompt_ids),
            request.max_tokens,
            handle.submitted_at,
            handle.finished_at if handle.finished_at is not None else time.perf_counter(),
            list(handle.tokens),
            list(handle.token_times),
            queue_seconds=None if result is None else result.timing.queue_seconds,
            transfer_seconds=handle.handoff_seconds,
        )
        if kind is not None:
            outcome.error_kind, outcome.error = kind, f"no end within {time_limit:g} s: cancelled"
        elif result is not None and not result.ok:
            error = result.error
            outcome.error_kind = result.finish_reason.value if error is None else type(error).__name__
            outcome.error = None if error is None else str(error)
        return outcome


def _failed(request: BenchRequest, sent: float, kind: str, message: str) -> Outcome:
    return Outcome(
        request.index,
        len(request.prompt_ids),
        request.max_tokens,
        sent,
        time.perf_counter(),
        error_kind=kind,
        error=message,
    )


@define
class PassRun:
    """One pass of the request list through one target."""

    name: str
    outcomes: list[Outcome]
    started: float
    ended: float
    #: the engine that decoded (in this process): its model step timings during the pass
    model_step_seconds: list[float] = attrs.field(factory=list)


class ProgressCounter(Protocol):
    """Counts finished requests (:class:`kvferry.commands._common.Progress` is one)."""

    def advance(self, n: int = 1) -> None: ...


#: ``progress(label, total)``: a context manager whose value counts finished requests
ProgressFactory = Callable[[str, int], AbstractContextManager[ProgressCounter]]


class _NoProgress:
    def advance(self, n: int = 1) -> None:
        pass


async def run_pass(
    name: str,
    target: Target,
    requests: Sequence[BenchRequest],
    *,
    concurrency: int | None,
    time_limit: float,
    progress: ProgressFactory | None = None,
    engine: Engine | None = None,
) -> PassRun:
    """Send every request to ``target`` (each with ``time_limit`` seconds to end): a closed loop of ``concurrency`` in flight, or (None) each at its
    ``arrival``. ``engine``: the engine that decodes, whose model steps during the pass are kept."""
    outcomes: list[Outcome | None] = [None] * len(requests)
    steps_before = engine.statistics().num_steps if engine is not None else 0
    counter_cm: AbstractContextManager[ProgressCounter] = (
        progress(name, len(requests)) if progress is not None else nullcontext(_NoProgress())
    )
    with counter_cm as counter:

        async def one(request: BenchRequest) -> None:
            outcomes[request.index] = await target.send(request, time_limit)
            counter.advance()

        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            if concurrency is not None:
                pending: Iterator[BenchRequest] = iter(requests)

                async def worker() -> None:
                    for request in pending:
                        await one(request)

                for _ in range(min(concurrency, len(requests))):
                    tg.start_soon(worker)
            else:
                for request in requests:
                    assert request.arrival is not None
                    await anyio.sleep(max(0.0, started + request.arrival - time.perf_counter()))
                    tg.start_soon(one, request)
    done = [o for o in outcomes if o is not None]
    assert len(done) == len(requests)
    run = PassRun(name, done, started, max((o.ended_at for o in done), default=started))
    if engine is not None:
        taken = engine.statistics().num_steps - steps_before
        timings = list(engine.step_timings)[-taken:] if taken > 0 else []
        run.model_step_seconds = [t.model_seconds for t in timings]
    return run


# --- figures -------------------------------------------------------------------------------------------


def percentiles(values: Sequence[float], scale: float = 1e3) -> dict[str, float | int | None]:
    """``{"p50", "p99", "mean", "samples"}`` of ``values`` times ``scale`` (nearest-rank percentiles, so that
    p50 <= p99 always; None for no values)."""
    if not values:
        return {"p50": None, "p99": None, "mean": None, "samples": 0}
    ordered = sorted(values)

    def rank(q: float) -> float:
        value = nearest_rank(ordered, q)
        assert value is not None
        return value * scale

    return {
        "p50": rank(50),
        "p99": rank(99),
        "mean": statistics.fmean(ordered) * scale,
        "samples": len(ordered),
    }


def summarize(run: PassRun) -> dict[str, Any]:
    """One pass's figures (the keys are :data:`PASS_KEYS`)."""
    outcomes = run.outcomes
    ok = [o for o in outcomes if o.ok]
    duration = max(run.ended - run.started, 1e-9)
    output_tokens = sum(len(o.token_ids) for o in ok)
    errors = Counter(o.error_kind for o in outcomes if o.error_kind is not None)
    result = {
        "requests": len(outcomes),
        "completed": len(ok),
        "failed": len(outcomes) - len(ok),
        "errors": dict(sorted(errors.items())),
        "duration_seconds": duration,
        "requests_per_second": len(ok) / duration,
        "output_tokens": output_tokens,
        "output_tokens_per_second": output_tokens / duration,
        "prompt_tokens": sum(o.prompt_tokens for o in ok),
        "ttft_ms": percentiles([t for o in ok if (t := o.ttft) is not None]),
        "itl_ms": percentiles([g for o in ok for g in o.inter_token]),
        "e2e_ms": percentiles([o.ended_at - o.sent_at for o in ok]),
        "queue_ms": percentiles([q for o in ok if (q := o.queue_seconds) is not None]),
        "transfer_ms": percentiles([t for o in ok if (t := o.transfer_seconds) is not None]),
        "model_step_ms_median": _median_ms(run.model_step_seconds),
        "engine_steps": len(run.model_step_seconds),
    }
    assert tuple(result) == PASS_KEYS
    return result


#: the keys of one pass's figures (``passes`` in the JSON); ``*_ms`` are ``{"p50", "p99", "mean", "samples"}``
#: over the completed requests, in milliseconds
PASS_KEYS = (
    "requests",  # sent
    "completed",  # ended after all their tokens (requests = completed + failed)
    "failed",
    "errors",  # {kind: count} of the failed ones: an error type, "timeout", "http_503_overloaded", ...
    "duration_seconds",  # first send -> last end
    "requests_per_second",  # completed / duration
    "output_tokens",  # generated by the completed requests
    "output_tokens_per_second",
    "prompt_tokens",
    "ttft_ms",  # send -> first token
    "itl_ms",  # gaps between consecutive tokens, every gap of every request
    "e2e_ms",  # send -> end
    "queue_ms",  # send -> admitted by the decoding engine (in this process only; samples 0 over HTTP)
    "transfer_ms",  # the cache transfer as the service measures it (disaggregated only)
    "model_step_ms_median",  # the decoding engine's median model step in the pass (in this process only)
    "engine_steps",  # that engine's steps in the pass
)


def judge_handoff(aggregated: PassRun, disaggregated: PassRun) -> dict[str, Any]:
    """The handoff latency as TTFT(disaggregated) - TTFT(aggregated) of each request that completed in both
    passes, and the goal: its median within one model step (the disaggregated generation engine's median in its
    pass: the step that a handoff may add) plus :data:`HANDOFF_SLACK_SECONDS`. ``goal_met`` is None when either
    figure is missing. Under load TTFT is mostly queueing, and the difference carries both passes' queueing
    noise: ``--concurrency 1`` isolates the handoff."""
    differences = [
        d.ttft - a.ttft
        for a, d in zip(aggregated.outcomes, disaggregated.outcomes, strict=True)
        if a.ok and d.ok and a.ttft is not None and d.ttft is not None
    ]
    figures = percentiles(differences)
    step_ms = _median_ms(disaggregated.model_step_seconds)
    median = figures["p50"]
    goal_ms = None if step_ms is None else step_ms + HANDOFF_SLACK_SECONDS * 1e3
    met = None if median is None or goal_ms is None else median <= goal_ms
    if met is None:
        verdict = "not judged: " + (
            "no request completed in both passes" if median is None else "no engine steps"
        )
    else:
        verdict = (
            f"{'met' if met else 'not met'}: median handoff {median:.2f} ms "
            f"{'<=' if met else '>'} one model step {step_ms:.2f} ms + 2 ms = {goal_ms:.2f} ms"
        )
        if median is not None and median < 0:
            verdict += (
                " (below 0: the passes' TTFTs differ by more than the handoff, through queueing or a noisy "
                "machine; --concurrency 1 leaves queueing out)"
            )
    return {
        "definition": "per request TTFT(disaggregated) - TTFT(aggregated), same requests, same run",
        "median_ms": median,
        "p99_ms": figures["p99"],
        "mean_ms": figures["mean"],
        "requests": figures["samples"],
        "model_step_ms_median": step_ms,
        "aggregated_model_step_ms_median": _median_ms(aggregated.model_step_seconds),
        "goal_ms": goal_ms,
        "goal_met": met,
        "verdict": verdict,
    }


def _median_ms(seconds: Sequence[float]) -> float | None:
    return statistics.median(seconds) * 1e3 if seconds else None


# --- the offline reference -----------------------------------------------------------------------------


async def offline_reference(
    model: str,
    options: EngineOptions,
    requests: Sequence[BenchRequest],
    progress: ProgressFactory | None = None,
) -> list[list[int]]:
    """Greedy tokens of every request from a fresh aggregated engine of ``model`` (``options``' dtype and
    weights seed, one rank, no speculation), one request at a time."""
    from kvferry.engine.runner import build_engine

    tokens_per_block = _tokens_per_block(model)
    longest = max((len(r.prompt_ids) + r.max_tokens for r in requests), default=1)
    pages = max(options.num_pages, -(-longest // tokens_per_block) + 2)
    reference_options = attrs.evolve(
        options,
        tp=1,
        max_spec_k=0,
        max_running=1,
        num_pages=pages,
        num_slots=0,
        num_draft_pages=0,
        token_budget=0,
        step_in_thread=False,
    )
    built = build_engine(model, reference_options)
    out: list[list[int]] = []
    counter_cm: AbstractContextManager[ProgressCounter] = (
        progress("offline reference", len(requests)) if progress is not None else nullcontext(_NoProgress())
    )
    with counter_cm as counter:
        async with built.engine:
            for request in requests:
                generation = built.engine.generate(request.prompt_ids, max_tokens=request.max_tokens)
                out.append(list(await generation.collect()))
                counter.advance()
    return out


def _tokens_per_block(model: str) -> int:
    from kvferry.pools.spec import preset

    if model == "tiny":
        return preset("tiny").tokens_per_block
    return 32  # a checkpoint's (kvferry.engine.runner)


def check_tokens(passes: Sequence[PassRun], reference: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Every completed request's tokens against ``reference``, per pass: ``{"passed", "requests",
    "mismatched": {pass: [indices]}, "unchecked": {pass: [indices of requests that did not complete]}}``."""
    mismatched: dict[str, list[int]] = {}
    unchecked: dict[str, list[int]] = {}
    for run in passes:
        mismatched[run.name] = [
            o.index for o in run.outcomes if o.ok and o.token_ids != list(reference[o.index])
        ]
        unchecked[run.name] = [o.index for o in run.outcomes if not o.ok]
    passed = not any(mismatched.values()) and not any(unchecked.values())
    return {
        "passed": passed,
        "requests": len(reference),
        "mismatched": mismatched,
        "unchecked": unchecked,
    }


# --- a whole run -----------------------------------------------------------------------------------------


@frozen
class ServeBenchConfig:
    """What ``kvferry bench serve`` runs (see the module docstring)."""

    requests: int
    #: closed loop: requests in flight; None with ``rate``
    concurrency: int | None
    #: open loop: requests per second (Poisson arrivals); None with ``concurrency``
    rate: float | None
    prompt_len: LengthRange
    output_len: LengthRange
    seed: int
    #: seconds each request has to end
    timeout: float
    model: str
    #: the engine that decodes in this process (``dtype`` and ``seed`` also size the offline reference)
    engine: EngineOptions
    disagg: DisaggOptions | None = None
    max_queued: int = 1024
    #: a running server instead of a service in this process
    url: str | None = None
    check: bool = False
    #: requests (other prompts of the same shape) sent to each target before its pass, and not measured
    warmup: int = 2

    def __attrs_post_init__(self) -> None:
        if (self.concurrency is None) == (self.rate is None):
            raise ConfigError("give either a concurrency or a rate")
        if self.url is not None and self.disagg is not None:
            raise ConfigError("a server's own flags decide whether it is disaggregated")

    def describe(self) -> dict[str, Any]:
        """The configuration as JSON."""
        import torch

        engine = self.engine
        return {
            "model": self.model,
            "requests": self.requests,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "prompt_len": [self.prompt_len.low, self.prompt_len.high],
            "output_len": [self.output_len.low, self.output_len.high],
            "seed": self.seed,
            "timeout_seconds": self.timeout,
            "warmup": self.warmup,
            "url": self.url,
            "dtype": engine.dtype,
            "weights_seed": engine.seed,
            "tp": None if self.url else engine.tp,
            "spec_k": None if self.url else engine.max_spec_k,
            "num_pages": None if self.url else engine.num_pages,
            "max_running": None if self.url else engine.max_running,
            "max_queued": None if self.url else self.max_queued,
            "disagg": self.disagg is not None,
            "transport": None if self.disagg is None else self.disagg.transport,
            "ctx_tp": None if self.disagg is None else self.disagg.ctx_tp,
            "check": self.check,
            "torch_threads": torch.get_num_threads(),
        }


@define
class ServeBenchRun:
    """A finished run: its passes (in order) and the JSON result (:data:`JSON_KEYS`)."""

    passes: list[PassRun]
    result: dict[str, Any]


#: the keys of the JSON result, in order
JSON_KEYS = (
    "target",  # what was measured: "in-process aggregated ...", "in-process disaggregated ...", or the URL
    "config",  # the load and engine settings as run (transport "auto" resolved)
    "passes",  # {pass name: figures (PASS_KEYS)}: "aggregated", "disaggregated" (--disagg), "server" (--url)
    "handoff",  # --disagg: judge_handoff's figures and verdict; else null
    "check",  # --check: check_tokens's result; else null
    "wall_seconds",  # the whole run, engines' start and the offline reference included
)


async def run_serve_bench(
    config: ServeBenchConfig,
    *,
    say: Callable[[str], None] = lambda _: None,
    progress: ProgressFactory | None = None,
) -> ServeBenchRun:
    """Run ``config``: its passes, then (``check``) the offline reference.

    :raises ~kvferry.errors.ConfigError: a request that can never fit the engine, a server that cannot be
        reached or serves another model.
    :raises ~kvferry.errors.MissingExtraError: ``url`` without httpx.
    """
    started = time.perf_counter()
    passes: list[PassRun] = []
    target_name: str
    if config.url is not None:
        try:
            from kvferry.tools.serve_bench_http import http_target
        except ImportError as exc:
            raise MissingExtraError(f"{exc.name or 'httpx'} (for --url)", "bench") from None

        async with http_target(config.url, config.model, config.timeout) as (target, vocab_size):
            requests = _requests(config, vocab_size)
            warmup = _requests(config, vocab_size, "warmup")
            say(f"{config.url}: {_load_text(config, requests)}")
            passes.append(await _pass("server", target, requests, warmup, config, progress, None))
        target_name = config.url
    else:
        aggregated_options = config.engine
        if config.disagg is not None:
            # as the disaggregated generation engine: its steps run on the event loop
            aggregated_options = attrs.evolve(config.engine, step_in_thread=False)
        modes: list[tuple[str, EngineOptions, DisaggOptions | None]] = [
            ("aggregated", aggregated_options, None)
        ]
        if config.disagg is not None:
            modes.append(("disaggregated", config.engine, config.disagg))
        for name, options, disagg in modes:
            say(f"starting the {name} service")
            async with _service(config, options, disagg) as service:
                requests = _requests(config, service.vocab_size)
                warmup = _requests(config, service.vocab_size, "warmup")
                _check_fits(service, [*requests, *warmup])
                target_name = f"in-process {service.backend.describe()}"
                say(f"{service.backend.describe()}: {_load_text(config, requests)}")
                passes.append(
                    await _pass(
                        name, ServiceTarget(service), requests, warmup, config, progress, _engine(service)
                    )
                )
    check = None
    if config.check:
        say(f"offline reference: {len(requests)} requests one at a time")
        reference = await offline_reference(config.model, config.engine, requests, progress)
        check = check_tokens(passes, reference)
    by_name = {run.name: run for run in passes}
    handoff = None
    if "disaggregated" in by_name:
        handoff = judge_handoff(by_name["aggregated"], by_name["disaggregated"])
    result = {
        "target": target_name,
        "config": config.describe(),
        "passes": {run.name: summarize(run) for run in passes},
        "handoff": handoff,
        "check": check,
        "wall_seconds": time.perf_counter() - started,
    }
    assert tuple(result) == JSON_KEYS
    return ServeBenchRun(passes, result)


def _requests(config: ServeBenchConfig, vocab_size: int, purpose: str = "requests") -> list[BenchRequest]:
    return make_requests(
        config.warmup if purpose == "warmup" else config.requests,
        prompt_len=config.prompt_len,
        output_len=config.output_len,
        vocab_size=vocab_size,
        seed=config.seed,
        rate=config.rate,
        purpose=purpose,
    )


def _load_text(config: ServeBenchConfig, requests: Sequence[BenchRequest]) -> str:
    load = f"concurrency {config.concurrency}" if config.rate is None else f"{config.rate:g} requests/s"
    tokens = sum(r.max_tokens for r in requests)
    return (
        f"{len(requests)} requests, {load}, prompts {config.prompt_len} tokens, "
        f"outputs {config.output_len} tokens ({tokens} in all)"
    )


async def _pass(
    name: str,
    target: Target,
    requests: Sequence[BenchRequest],
    warmup: Sequence[BenchRequest],
    config: ServeBenchConfig,
    progress: ProgressFactory | None,
    engine: Engine | None,
) -> PassRun:
    if warmup:
        # the first requests of a process pay for lazy setup (allocations, kernels' first calls)
        await run_pass(f"{name} warm-up", target, warmup, concurrency=len(warmup), time_limit=config.timeout)
    return await run_pass(
        name,
        target,
        requests,
        concurrency=config.concurrency,
        time_limit=config.timeout,
        progress=progress,
        engine=engine,
    )


@asynccontextmanager
async def _service(
    config: ServeBenchConfig, engine: EngineOptions, disagg: DisaggOptions | None
) -> AsyncIterator[Service]:
    from kvferry.serving import open_service

    async with open_service(config.model, engine=engine, disagg=disagg, max_queued=config.max_queued) as s:
        yield s


def _engine(service: Service) -> Engine | None:
    built = getattr(service.backend, "built", None)
    return None if built is None else built.engine


def _check_fits(service: Service, requests: Sequence[BenchRequest]) -> None:
    """Every request must fit the pools: the first that cannot is refused before the pass runs."""
    for request in requests:
        service.backend.check_fits(len(request.prompt_ids), request.max_tokens, service.max_spec_k)
