"""``kvferry demo``: aggregated vs disaggregated serving of a model, token for token.

The model (``--model``) is a preset (``tiny``, the default; ``tiny-kimi``, the KimiLinear reference) or a local
NemotronH or KimiLinear checkpoint directory; both passes serve the same one.

Runs N generated prompts of mixed lengths through one aggregated engine (the reference), then through a
context engine (prefill, another OS process when a cross-process transport is installed) and a generation
engine (decode, this process) that hand each request's cache over a real transport, and compares every
request's tokens and draft proposals. With speculation (``--spec-k``, default 2) it runs the disaggregated pass
twice, with and without the draft KV transfer, to show what leaving the draft KV behind costs.

Progress goes to stderr; stdout gets the summary table, or with ``--json`` exactly one JSON object with the
keys of :data:`JSON_KEYS`. Library output (NIXL's log lines, anything written to file descriptor 1) is sent
to stderr so that stdout stays parseable.

Exit status: 0 identical, 1 a request differs, 2 bad arguments, 3 a typed runtime failure (one line on
stderr), 130 interrupted (the context process is ended too).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvferry._percentile import nearest_rank
from kvferry.commands._common import (
    DTYPES,
    PRESETS,
    check_device,
    check_model,
    check_tp,
    non_negative_int,
    positive_int,
    progress,
    resolve_transport,
    say,
    seed_int,
)
from kvferry.errors import ConfigError

MAX_TOKENS = 12
#: requests in flight at once (every one of them: the engines queue what they cannot run yet)
CONCURRENCY = 1 << 16

#: the keys of ``--json``, in order
JSON_KEYS = (
    "transport",  # the transport actually used ("auto" resolved)
    "ctx_tp",
    "gen_tp",
    "requests",
    "spec_k",
    "draft_transfer",  # False with --no-draft-transfer, and without speculation (there is no draft KV)
    "identical",  # see _judge: tokens in every pass; proposals too where the draft KV travels
    "mismatched_requests",  # indices of the requests that differ
    "bytes_transferred",  # of the reported pass (with draft KV unless --no-draft-transfer)
    "fragments",
    "bytes_per_request",  # mean over the requests whose cache moved
    "handoff_ms_median",  # per request: receive request -> last writer's report that its bytes landed
    "handoff_ms_p99",
    "acceptance_rate",  # accepted / drafted drafts of the reported pass (null without speculation)
    "acceptance_rate_without_draft_transfer",  # the other pass; null without speculation
    "tokens_identical_without_draft_transfer",  # null without speculation
    "wall_seconds",  # the whole demo
)


def _at_least_two(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (the first token and one decoded), got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="a preset (tiny, tiny-kimi, ...) or a local NemotronH / KimiLinear checkpoint directory "
        "(default tiny)",
    )
    parser.add_argument(
        "--transport",
        choices=["auto", "nixl", "ucx", "local"],
        default="auto",
        help="auto: nixl, else ucx; without either the context engine runs in this process over local",
    )
    parser.add_argument("--ctx-tp", type=positive_int, default=1, metavar="N", help="context engine TP ranks")
    parser.add_argument(
        "--gen-tp", type=positive_int, default=1, metavar="M", help="generation engine TP ranks"
    )
    parser.add_argument("--requests", type=positive_int, default=8, metavar="N")
    parser.add_argument("--seed", type=seed_int, default=0, metavar="S", help="prompts and weights seed")
    parser.add_argument(
        "--spec-k", type=non_negative_int, default=None, metavar="K", help="draft tokens per step (default 2)"
    )
    parser.add_argument("--no-draft-transfer", action="store_true", help="leave the draft KV behind")
    parser.add_argument("--max-tokens", type=_at_least_two, default=MAX_TOKENS, metavar="N")
    parser.add_argument(
        "--device", default="cpu", help="where both engines' weights and caches live: cpu, cuda or cuda:N"
    )
    parser.add_argument(
        "--ctx-device",
        default=None,
        metavar="DEVICE",
        help="the context engine's device instead (cuda:0 here and --device cuda:1: one GPU each)",
    )
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float64",
        help="weights and caches of every engine (default float64)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="the secret both engines authenticate with (default: $KVFERRY_SECRET_FILE, $KVFERRY_SECRET, "
        "else a fresh random one)",
    )


def _drafter_available() -> bool:
    try:
        import kvferry.model.drafter  # noqa: F401
    except ImportError:
        return False
    return True


def _check_fits(args: argparse.Namespace) -> None:
    """Refuse a ``--max-tokens`` that the engines' pages cannot hold for the longest prompt, before anything
    runs (it failed with PoolExhausted once the aggregated pass had decoded that far: minutes)."""
    from kvferry.disagg.serve import _options

    tokens_per_block, vocab = _model_shape(args.model)
    pages = _options(1, 0, args.seed, "float64").num_pages - 1  # per rank; page 0 is reserved
    longest = max(map(len, _prompts(args.requests, args.seed, vocab)))
    most = pages * tokens_per_block - longest + 1  # the last token's KV is never written
    if args.max_tokens > most:
        raise ConfigError(
            f"--max-tokens {args.max_tokens}: the longest prompt ({longest} tokens) leaves room for at most "
            f"{most} generated tokens in the engines' {pages} pages of {tokens_per_block} tokens"
        )


def _model_shape(model: str) -> tuple[int, int]:
    """(tokens per block, vocabulary size) of ``model``: a preset's spec, or a checkpoint's ``config.json``
    with the block size :func:`~kvferry.engine.runner.build_engine` gives checkpoints."""
    from kvferry.engine.runner import CHECKPOINT_TOKENS_PER_BLOCK

    if model in PRESETS:
        from kvferry.pools.spec import preset

        spec = preset(model)
        return spec.tokens_per_block, spec.vocab_size
    from kvferry.model.weights import args_from_config

    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    return CHECKPOINT_TOKENS_PER_BLOCK, args_from_config(config).vocab_size


def _prompts(n: int, seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice((3, 7, 16, 33, 61, 100)) + rng.randrange(4) for _ in range(n)]
    return [[rng.randrange(min(256, vocab)) for _ in range(length)] for length in lengths]


async def _each(n: int, one: Callable[[int], Awaitable[None]]) -> None:
    """``one(i)`` for every ``i < n``, at most :data:`CONCURRENCY` at a time."""
    import anyio

    indices = iter(range(n))

    async def worker() -> None:
        for i in indices:
            await one(i)

    async with anyio.create_task_group() as tg:
        for _ in range(min(CONCURRENCY, n)):
            tg.start_soon(worker)


async def _aggregated(
    prompts: list[list[int]], args: argparse.Namespace, spec_k: int
) -> list[dict[str, Any]]:
    from kvferry.disagg.serve import _options
    from kvferry.engine.runner import build_engine

    built = build_engine(args.model, _options(1, spec_k, args.seed, args.dtype, device=args.device))
    out: list[dict[str, Any]] = [{}] * len(prompts)
    with progress("aggregated reference", len(prompts)) as bar:
        async with built.engine:

            async def one(i: int) -> None:
                g = built.engine.generate(prompts[i], max_tokens=args.max_tokens, spec_k=spec_k)
                tokens = await g.collect()
                out[i] = {"tokens": tokens, "drafts": list(g.request.draft_history)}
                bar.advance()

            await _each(len(prompts), one)
    return out


def _percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    return nearest_rank(sorted(values), q)


async def _disaggregated(
    prompts: list[list[int]],
    args: argparse.Namespace,
    spec_k: int,
    transport: str,
    separate_process: bool,
    children: list[Any],
) -> dict[str, Any]:
    from kvferry.disagg.serve import disaggregated

    passes: dict[str, Any] = {}
    started = time.perf_counter()
    where = "another OS process" if separate_process else "this process"
    say(f"starting a context engine (TP {args.ctx_tp}, {where}) and a generation engine (TP {args.gen_tp})")
    async with disaggregated(
        model=args.model,
        transport=transport,
        ctx_tp=args.ctx_tp,
        gen_tp=args.gen_tp,
        spec_k=spec_k,
        seed=args.seed,
        dtype=args.dtype,
        device=args.device,
        ctx_device=args.ctx_device,
        separate_process=separate_process,
        secret=args.secret,
    ) as (router, parts):
        worker = parts["worker"]
        context = parts["context"]
        if separate_process:
            children.append(context.proc)
        pid = f", context engine pid {context.pid}" if separate_process else ""
        say(f"  connected over {parts['transport'].name} in {time.perf_counter() - started:.1f} s{pid}")
        order = [not args.no_draft_transfer]
        if spec_k and not args.no_draft_transfer:
            order.append(False)
        for transfer_draft in order:
            worker.transfer_draft = transfer_draft and worker.transfer_draft
            results: list[dict[str, Any]] = [{}] * len(prompts)
            t0 = time.perf_counter()
            label = f"disaggregated, {'with' if transfer_draft else 'without'} draft KV transfer"
            with progress(label, len(prompts)) as bar:

                async def one(i: int, results: list[dict[str, Any]] = results, bar: Any = bar) -> None:
                    g = router.generate(prompts[i], max_tokens=args.max_tokens, spec_k=spec_k)
                    tokens = await g.collect()
                    request = None if g.generation is None else g.generation.request
                    results[i] = {
                        "tokens": tokens,
                        "drafts": g.draft_history,
                        "drafted": 0 if request is None else request.num_drafted,
                        "accepted": 0 if request is None else request.num_accepted,
                        "transfer": g.transfer,
                    }
                    bar.advance()

                await _each(len(prompts), one)
            say(f"  done in {time.perf_counter() - t0:.1f} s")
            passes["with" if transfer_draft else "without"] = results
    return {"transport": transport, "passes": passes}


def _pass_stats(results: list[dict[str, Any]], spec_k: int) -> dict[str, Any]:
    transfers = [r["transfer"] for r in results if r["transfer"] is not None]
    drafted = sum(r["drafted"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    latencies = [t.seconds * 1e3 for t in transfers]
    nbytes = sum(t.nbytes for t in transfers)
    return {
        "bytes": nbytes,
        "fragments": sum(t.fragments for t in transfers),
        "bytes_per_request": nbytes / len(transfers) if transfers else None,
        "handoff_ms_median": statistics.median(latencies) if latencies else None,
        "handoff_ms_p99": _percentile(latencies, 99),
        # no speculation: no rate (a 0.0 would read as "every draft rejected")
        "acceptance": (accepted / drafted if drafted else 0.0) if spec_k else None,
    }


def _judge(
    reference: list[dict[str, Any]], passes: dict[str, list[dict[str, Any]]]
) -> tuple[list[int], bool | None]:
    """(mismatched request indices, tokens identical in the pass without draft KV or None if it did not run).

    What the demo reproduces: every request's tokens in every pass, and its draft proposals in the pass that
    transfers the draft KV (without it the drafter starts from zeros, so its proposals are expected to
    differ; the tokens must not)."""
    mismatched: set[int] = set()
    for name, results in passes.items():
        for i, (a, b) in enumerate(zip(reference, results, strict=True)):
            if a["tokens"] != b["tokens"] or (name == "with" and a["drafts"] != b["drafts"]):
                mismatched.add(i)
    without = passes.get("without")
    tokens_without = (
        None
        if without is None
        else all(a["tokens"] == b["tokens"] for a, b in zip(reference, without, strict=True))
    )
    return sorted(mismatched), tokens_without


async def _run_interruptible(
    args: argparse.Namespace, spec_k: int, transport: str, separate_process: bool, children: list[Any]
) -> dict[str, Any]:
    """:func:`_run`, ended by Ctrl-C as a cancellation of its own scope, then ``KeyboardInterrupt``.

    Left to asyncio's runner, Ctrl-C cancels the main task natively, which a wait shielded from cancellation
    (a model step in its worker thread) can absorb: the demo would run on to its end."""
    import signal

    import anyio

    interrupted = False
    result: dict[str, Any] = {}
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            nonlocal interrupted
            with anyio.open_signal_receiver(signal.SIGINT) as signals:
                async for _ in signals:
                    interrupted = True
                    tg.cancel_scope.cancel()
                    return

        tg.start_soon(watch)
        result = await _run(args, spec_k, transport, separate_process, children)
        tg.cancel_scope.cancel()
    if interrupted:
        raise KeyboardInterrupt
    return result


async def _run(
    args: argparse.Namespace, spec_k: int, transport: str, separate_process: bool, children: list[Any]
) -> dict[str, Any]:
    t0 = time.perf_counter()
    prompts = _prompts(args.requests, args.seed, _model_shape(args.model)[1])
    say(
        f"aggregated reference: {len(prompts)} requests, prompts of {min(map(len, prompts))}.."
        f"{max(map(len, prompts))} tokens, spec_k={spec_k}"
    )
    reference = await _aggregated(prompts, args, spec_k)
    say(f"  done in {time.perf_counter() - t0:.1f} s")
    disagg = await _disaggregated(prompts, args, spec_k, transport, separate_process, children)
    passes = disagg["passes"]
    mismatched, tokens_without = _judge(reference, passes)
    main = _pass_stats(passes["without" if args.no_draft_transfer else "with"], spec_k)
    other = _pass_stats(passes["without"], spec_k) if spec_k and "without" in passes else None
    result = {
        "transport": disagg["transport"],
        "ctx_tp": args.ctx_tp,
        "gen_tp": args.gen_tp,
        "requests": len(prompts),
        "spec_k": spec_k,
        "draft_transfer": bool(spec_k) and not args.no_draft_transfer,
        "identical": not mismatched,
        "mismatched_requests": mismatched,
        "bytes_transferred": main["bytes"],
        "fragments": main["fragments"],
        "bytes_per_request": main["bytes_per_request"],
        "handoff_ms_median": main["handoff_ms_median"],
        "handoff_ms_p99": main["handoff_ms_p99"],
        "acceptance_rate": main["acceptance"],
        "acceptance_rate_without_draft_transfer": None if other is None else other["acceptance"],
        "tokens_identical_without_draft_transfer": tokens_without if spec_k else None,
        "wall_seconds": time.perf_counter() - t0,
    }
    assert tuple(result) == JSON_KEYS
    return result


def _fmt(value: Any, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _table(result: dict[str, Any]) -> str:
    mismatched = result["mismatched_requests"]
    judged = "tokens and draft proposals" if result["draft_transfer"] else "tokens"
    rows = [
        ("transport", result["transport"]),
        ("tp (context -> generation)", f"{result['ctx_tp']} -> {result['gen_tp']}"),
        ("requests", result["requests"]),
        (
            f"{judged} identical to aggregated",
            "yes"
            if result["identical"]
            else f"NO: requests {mismatched[:20]}{' ...' if len(mismatched) > 20 else ''}",
        ),
        ("bytes transferred", result["bytes_transferred"]),
        ("fragments", result["fragments"]),
        ("bytes per request", _fmt(result["bytes_per_request"], ".0f")),
        (
            "handoff ms (median / p99)",
            f"{_fmt(result['handoff_ms_median'], '.2f')} / {_fmt(result['handoff_ms_p99'], '.2f')}",
        ),
        ("spec_k", result["spec_k"]),
        ("acceptance rate", _fmt(result["acceptance_rate"], ".3f", "- (no speculation)")),
    ]
    if result["acceptance_rate_without_draft_transfer"] is not None:
        rows.append(
            ("acceptance without draft KV", f"{result['acceptance_rate_without_draft_transfer']:.3f}")
        )
    if result["tokens_identical_without_draft_transfer"] is not None and result["draft_transfer"]:
        rows.append(
            (
                "tokens identical without draft KV",
                "yes" if result["tokens_identical_without_draft_transfer"] else "NO",
            )
        )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    import anyio

    from kvferry._stdio import quiet_library_env, stdout_to_stderr
    from kvferry.transports.handshake import load_secret

    check_device(args.device)
    if args.ctx_device is not None:
        check_device(args.ctx_device, "--ctx-device")
    check_model(args.model)
    check_tp(args.model, "--ctx-tp", args.ctx_tp)
    check_tp(args.model, "--gen-tp", args.gen_tp)
    _check_fits(args)
    args.secret = load_secret(args.secret_file)  # before anything runs: a bad secret is a usage error
    spec_k = args.spec_k
    if spec_k is None:
        spec_k = 2 if _drafter_available() else 0
    if spec_k and not _drafter_available():
        raise ConfigError("--spec-k needs the drafter (kvferry.model.drafter), not available in this build")
    quiet_library_env()  # before nixl or ucxx loads, and inherited by the context process
    children: list[Any] = []
    try:
        # the libraries print to file descriptor 1 (from their import on): it points at stderr until the result
        with stdout_to_stderr():
            transport, separate_process = resolve_transport(args.transport)
            result = anyio.run(_run_interruptible, args, spec_k, transport, separate_process, children)
    finally:
        for proc in children:  # normally gone already; on Ctrl-C or a failure make sure
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    print(json.dumps(result) if args.json else _table(result), flush=True)
    return 0 if result["identical"] else 1
