"""``kvferry demo``: aggregated vs disaggregated serving of the reference model, token for token.

Runs N generated prompts of mixed lengths through one aggregated engine (the reference), then through a
context engine (prefill, another OS process by default) and a generation engine (decode, this process) that
hand each request's cache over a real transport, and compares every request's tokens and draft proposals.
With speculation (``--spec-k``, default 2) it runs the disaggregated pass twice, with and without the draft KV
transfer, to show what leaving the draft KV behind costs.

Progress goes to stderr; stdout gets the summary table, or with ``--json`` exactly one JSON object with the
keys of :data:`JSON_KEYS`. Library output (NIXL's log lines, anything written to file descriptor 1) is sent
to stderr so that stdout stays parseable.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Any

import anyio

from kvferry.errors import KvferryError

MAX_TOKENS = 12

#: the keys of ``--json``, in order
JSON_KEYS = (
    "transport",  # the transport actually used ("auto" resolved)
    "ctx_tp",
    "gen_tp",
    "requests",
    "spec_k",
    "draft_transfer",  # False with --no-draft-transfer
    "identical",  # every request's tokens and draft proposals equal the aggregated run's
    "mismatched_requests",  # indices of the requests that differ
    "bytes_transferred",  # of the reported pass (with draft KV unless --no-draft-transfer)
    "fragments",
    "transfer_seconds",  # wall seconds with at least one transfer in flight (overlaps counted once)
    "transfer_gbps",  # bytes_transferred / transfer_seconds / 1e9
    "acceptance_rate",  # accepted / drafted drafts of the reported pass (0.0 without speculation)
    "acceptance_rate_without_draft_transfer",  # the other pass; null without speculation
    "tokens_identical_without_draft_transfer",  # null without speculation
    "wall_seconds",  # the whole demo
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport", choices=["auto", "nixl", "ucx", "local"], default="auto")
    parser.add_argument("--ctx-tp", type=int, default=1, metavar="N", help="context engine TP ranks")
    parser.add_argument("--gen-tp", type=int, default=1, metavar="M", help="generation engine TP ranks")
    parser.add_argument("--requests", type=int, default=8, metavar="N")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="prompts and weights seed")
    parser.add_argument(
        "--spec-k", type=int, default=None, metavar="K", help="draft tokens per step (default 2)"
    )
    parser.add_argument("--no-draft-transfer", action="store_true", help="leave the draft KV behind")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, metavar="N")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _drafter_available() -> bool:
    try:
        import kvferry.engine.drafter  # noqa: F401
    except ImportError:
        return False
    return True


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [rng.choice((3, 7, 16, 33, 61, 100)) + rng.randrange(4) for _ in range(n)]
    return [[rng.randrange(256) for _ in range(length)] for length in lengths]


def _say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr, flush=True)


async def _aggregated(
    prompts: list[list[int]], args: argparse.Namespace, spec_k: int
) -> list[dict[str, Any]]:
    from kvferry.engine.disagg.serve import _options
    from kvferry.engine.runner import build_engine

    built = build_engine("tiny", _options(1, spec_k, args.seed, "float64"))
    out: list[dict[str, Any]] = [{}] * len(prompts)
    async with built.engine:

        async def one(i: int) -> None:
            g = built.engine.generate(prompts[i], max_tokens=args.max_tokens, spec_k=spec_k)
            tokens = await g.collect()
            out[i] = {"tokens": tokens, "drafts": list(g.request.draft_history)}

        async with anyio.create_task_group() as tg:
            for i in range(len(prompts)):
                tg.start_soon(one, i)
    return out


async def _disaggregated(
    prompts: list[list[int]], args: argparse.Namespace, spec_k: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from kvferry.engine.disagg.serve import disaggregated

    local = args.transport == "local"
    results: list[dict[str, Any]] = [{}] * len(prompts)
    extra: dict[str, Any] = {}
    started = time.perf_counter()
    where = "this process" if local else "another OS process"
    _say(
        args,
        f"starting a context engine (TP {args.ctx_tp}, {where}) and a generation engine (TP {args.gen_tp})",
    )
    async with disaggregated(
        transport=args.transport,
        ctx_tp=args.ctx_tp,
        gen_tp=args.gen_tp,
        spec_k=spec_k,
        seed=args.seed,
        separate_process=not local,
    ) as (router, parts):
        worker = parts["worker"]
        extra["transport"] = parts["transport"].name
        _say(args, f"  connected over {extra['transport']} in {time.perf_counter() - started:.1f} s")
        passes = [not args.no_draft_transfer]
        if spec_k and not args.no_draft_transfer:
            passes.append(False)
        for transfer_draft in passes:
            worker.transfer_draft = transfer_draft and worker.transfer_draft
            start = len(worker.transfers())
            done = 0
            pass_results: list[dict[str, Any]] = [{}] * len(prompts)
            t0 = time.perf_counter()

            async def one(i: int, results: list[dict[str, Any]] = pass_results) -> None:
                nonlocal done
                g = router.generate(prompts[i], max_tokens=args.max_tokens, spec_k=spec_k)
                tokens = await g.collect()
                request = None if g.generation is None else g.generation.request
                results[i] = {
                    "tokens": tokens,
                    "drafts": g.draft_history,
                    "drafted": 0 if request is None else request.num_drafted,
                    "accepted": 0 if request is None else request.num_accepted,
                }
                done += 1
                _say(
                    args,
                    f"  [{done}/{len(prompts)}] request {i}: {len(prompts[i])} prompt tokens -> {len(tokens)} tokens",
                )

            _say(args, f"disaggregated run ({'with' if transfer_draft else 'without'} draft KV transfer)")
            async with anyio.create_task_group() as tg:
                for i in range(len(prompts)):
                    tg.start_soon(one, i)
            transfers = worker.transfers()[start:]
            drafted = sum(r["drafted"] for r in pass_results)
            accepted = sum(r["accepted"] for r in pass_results)
            stats = {
                "bytes": sum(t.nbytes for t in transfers),
                "fragments": sum(t.fragments for t in transfers),
                "seconds": worker.transfer_seconds(start),
                "acceptance": accepted / drafted if drafted else 0.0,
                "wall": time.perf_counter() - t0,
            }
            _say(args, f"  done in {stats['wall']:.1f} s")
            if transfer_draft == (not args.no_draft_transfer):
                results = pass_results
                extra["main"] = stats
            extra["with" if transfer_draft else "without"] = stats
            extra["without_results"] = pass_results if not transfer_draft else extra.get("without_results")
    return results, extra


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.perf_counter()
    spec_k = args.spec_k
    if spec_k is None:
        spec_k = 2 if _drafter_available() else 0
    prompts = _prompts(args.requests, args.seed)
    _say(
        args,
        f"aggregated reference: {len(prompts)} requests, prompts of {min(map(len, prompts))}.."
        f"{max(map(len, prompts))} tokens, spec_k={spec_k}",
    )
    reference = await _aggregated(prompts, args, spec_k)
    _say(args, f"  done in {time.perf_counter() - t0:.1f} s")
    results, extra = await _disaggregated(prompts, args, spec_k)
    mismatched = [
        i
        for i, (a, b) in enumerate(zip(reference, results, strict=True))
        if a["tokens"] != b["tokens"] or a["drafts"] != b["drafts"]
    ]
    without = extra.get("without_results") or []
    tokens_identical_without = (
        all(a["tokens"] == b["tokens"] for a, b in zip(reference, without, strict=True)) if without else None
    )
    main = extra["main"]
    seconds = main["seconds"]
    result = {
        "transport": extra["transport"],
        "ctx_tp": args.ctx_tp,
        "gen_tp": args.gen_tp,
        "requests": len(prompts),
        "spec_k": spec_k,
        "draft_transfer": not args.no_draft_transfer,
        "identical": not mismatched,
        "mismatched_requests": mismatched,
        "bytes_transferred": main["bytes"],
        "fragments": main["fragments"],
        "transfer_seconds": seconds,
        "transfer_gbps": main["bytes"] / seconds / 1e9 if seconds else 0.0,
        "acceptance_rate": main["acceptance"],
        "acceptance_rate_without_draft_transfer": extra["without"]["acceptance"]
        if spec_k and "without" in extra
        else None,
        "tokens_identical_without_draft_transfer": tokens_identical_without if spec_k else None,
        "wall_seconds": time.perf_counter() - t0,
    }
    assert tuple(result) == JSON_KEYS
    return result


def _table(result: dict[str, Any]) -> str:
    rows = [
        ("transport", result["transport"]),
        ("tp (context -> generation)", f"{result['ctx_tp']} -> {result['gen_tp']}"),
        ("requests", result["requests"]),
        ("identical to aggregated", "yes" if result["identical"] else f"NO: {result['mismatched_requests']}"),
        ("bytes transferred", result["bytes_transferred"]),
        ("fragments", result["fragments"]),
        ("transfer seconds", f"{result['transfer_seconds']:.4f}"),
        ("transfer GB/s", f"{result['transfer_gbps']:.3g}"),
        ("spec_k", result["spec_k"]),
        ("acceptance rate", f"{result['acceptance_rate']:.3f}"),
    ]
    if result["acceptance_rate_without_draft_transfer"] is not None:
        rows.append(
            ("acceptance without draft KV", f"{result['acceptance_rate_without_draft_transfer']:.3f}")
        )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run(args: argparse.Namespace) -> int:
    if args.requests < 1 or args.ctx_tp < 1 or args.gen_tp < 1 or args.max_tokens < 2:
        print(
            "kvferry demo: --requests, --ctx-tp, --gen-tp must be >= 1 and --max-tokens >= 2", file=sys.stderr
        )
        return 2
    if args.spec_k and not _drafter_available():
        print(
            "kvferry demo: --spec-k needs the drafter (kvferry.engine.drafter), not available in this build",
            file=sys.stderr,
        )
        return 2
    # NIXL logs INFO lines to stdout (its own handler), and C libraries may print there too: quiet NIXL
    # (here and in the context process) and point file descriptor 1 at stderr for the whole run, keeping
    # the real stdout for our one result
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    sys.stdout.flush()
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        result = anyio.run(_run, args)
    except KvferryError as exc:
        print(f"kvferry demo: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        sys.stdout.flush()
    with stdout:
        if args.json:
            print(json.dumps(result), file=stdout)
        else:
            print(_table(result), file=stdout)
    return 0 if result["identical"] else 1
