"""Serving under load (``kvferry bench serve`` in this process) against the engine alone, and the disaggregated
handoff against the aggregated service, both measured in the same run on the same requests.

Two cases per repetition, each with fresh engines of the reference model (``tiny``):

- ``aggregated``: ``--requests`` requests (prompts ``--prompt-len``, outputs ``--output-len`` tokens, seeded)
  at ``--concurrency`` in flight through the service (:func:`kvferry.open_service`): requests/s, output
  tokens/s, TTFT and inter-token latency (p50, p99), the median model step. Ceiling: the same requests through
  the engine alone (``Engine.generate``, same options, same concurrency, no service): ``ratio_engine`` = the
  service's output tokens/s over the engine's. The first repetition also checks every request's tokens against
  offline greedy generation (``check_passed``).
- ``handoff``: ``--handoff-requests`` requests, one at a time, through an aggregated service and then a
  disaggregated one (``--transport``): the handoff is TTFT(disaggregated) - TTFT(aggregated) per request
  (``handoff_ms``: median, ``handoff_ms_p99``), judged against the goal "median within one model step of the
  generation engine plus 2 ms" (``goal_met``, per repetition). One at a time, TTFT holds no queueing, so the
  difference is the handoff's.

Every figure is the median over ``--repeat`` repetitions, ``_spread`` their ``[min, max]``.

    python benchmarks/serve.py [--requests 200] [--concurrency 200] [--prompt-len 16:128] [--output-len 16:64]
        [--handoff-requests 20] [--transport auto|nixl|ucx|local] [--repeat 3] [--threads 1]
        [--json benchmarks/results/<machine>/serve.json]

``--threads`` sets torch's intra-op threads in this process and (``OMP_NUM_THREADS``) in the context process the
handoff case starts: on a machine shared with other work, pools of several threads per process stall steps.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import anyio
import torch
from _provenance import median_spread, write_result

from kvferry.commands._common import resolve_transport
from kvferry.engine.runner import EngineOptions, build_engine
from kvferry.serving import DisaggOptions
from kvferry.tools.serve_bench import (
    BenchRequest,
    LengthRange,
    ServeBenchConfig,
    make_requests,
    run_serve_bench,
)

#: the figures of the aggregated case summarised over the repetitions
AGGREGATED = (
    "requests_per_second",
    "output_tokens_per_second",
    "engine_output_tokens_per_second",
    "ratio_engine",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "model_step_ms",
)
#: and of the handoff case
HANDOFF = (
    "handoff_ms",
    "handoff_ms_p99",
    "model_step_ms",
    "goal_ms",
    "aggregated_ttft_ms",
    "disaggregated_ttft_ms",
    "transfer_ms",
)


async def engine_alone(
    requests: list[BenchRequest], warmup: list[BenchRequest], options: EngineOptions, concurrency: int
) -> float:
    """Output tokens/s of ``requests`` through a fresh engine's own ``generate``, ``concurrency`` at a time,
    after the same warm-up requests as the service's pass."""
    built = build_engine("tiny", options)
    tokens = 0

    async def run(batch: list[BenchRequest], in_flight: int) -> None:
        pending = iter(batch)

        async def worker() -> None:
            nonlocal tokens
            for request in pending:
                out = await built.engine.generate(request.prompt_ids, max_tokens=request.max_tokens).collect()
                tokens += len(out)

        async with anyio.create_task_group() as tg:
            for _ in range(min(in_flight, len(batch))):
                tg.start_soon(worker)

    async with built.engine:
        await run(warmup, len(warmup))
        tokens = 0
        started = time.perf_counter()
        await run(requests, concurrency)
        return tokens / (time.perf_counter() - started)


async def aggregated_case(args: argparse.Namespace, check: bool) -> dict[str, Any]:
    options = EngineOptions(dtype=args.dtype)
    config = ServeBenchConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        rate=None,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
        timeout=600.0,
        model="tiny",
        engine=options,
        check=check,
    )
    run = await run_serve_bench(config, say=print)
    figures = run.result["passes"]["aggregated"]
    requests, warmup = (
        make_requests(
            count,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            vocab_size=256,
            seed=args.seed,
            purpose=purpose,
        )
        for count, purpose in ((args.requests, "requests"), (config.warmup, "warmup"))
    )
    engine_tps = await engine_alone(requests, warmup, options, args.concurrency)
    row = {
        "completed": figures["completed"],
        "failed": figures["failed"],
        "requests_per_second": figures["requests_per_second"],
        "output_tokens_per_second": figures["output_tokens_per_second"],
        "engine_output_tokens_per_second": engine_tps,
        "ratio_engine": figures["output_tokens_per_second"] / engine_tps,
        "ttft_ms_p50": figures["ttft_ms"]["p50"],
        "ttft_ms_p99": figures["ttft_ms"]["p99"],
        "itl_ms_p50": figures["itl_ms"]["p50"],
        "itl_ms_p99": figures["itl_ms"]["p99"],
        "model_step_ms": figures["model_step_ms_median"],
        "check_passed": None if run.result["check"] is None else run.result["check"]["passed"],
    }
    print(f"  aggregated: {row}")
    return row


async def handoff_case(args: argparse.Namespace, transport: str, separate: bool) -> dict[str, Any]:
    config = ServeBenchConfig(
        requests=args.handoff_requests,
        concurrency=1,
        rate=None,
        prompt_len=args.prompt_len,
        output_len=args.output_len,
        seed=args.seed,
        timeout=600.0,
        model="tiny",
        engine=EngineOptions(dtype=args.dtype),
        disagg=DisaggOptions(transport=transport, separate_process=separate),
    )
    run = await run_serve_bench(config, say=print)
    handoff = run.result["handoff"]
    passes = run.result["passes"]
    row = {
        "completed": min(p["completed"] for p in passes.values()),
        "handoff_ms": handoff["median_ms"],
        "handoff_ms_p99": handoff["p99_ms"],
        "model_step_ms": handoff["model_step_ms_median"],
        "goal_ms": handoff["goal_ms"],
        "goal_met": handoff["goal_met"],
        "aggregated_ttft_ms": passes["aggregated"]["ttft_ms"]["p50"],
        "disaggregated_ttft_ms": passes["disaggregated"]["ttft_ms"]["p50"],
        "transfer_ms": passes["disaggregated"]["transfer_ms"]["p50"],
    }
    print(f"  handoff: {row}")
    return row


def summarise(case: str, rows: list[dict[str, Any]], figures: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"case": case, "runs": len(rows), "completed": [r["completed"] for r in rows]}
    for name in figures:
        values = [r[name] for r in rows if r[name] is not None]
        if values:
            out[name], out[f"{name}_spread"] = median_spread(values)
        else:
            out[name], out[f"{name}_spread"] = None, None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--prompt-len", type=LengthRange.parse, default=LengthRange(16, 128))
    parser.add_argument("--output-len", type=LengthRange.parse, default=LengthRange(16, 64))
    parser.add_argument("--handoff-requests", type=int, default=20)
    parser.add_argument("--transport", choices=["auto", "nixl", "ucx", "local"], default="auto")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads, here and in a context process (default 1)",
    )
    parser.add_argument("--json", default=None, metavar="PATH")
    args = parser.parse_args()
    # the context process of the handoff case reads it when it starts: an oversubscribed intra-op pool (two
    # processes' threads on shared cores) stalls a step by orders of magnitude
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    transport, separate = resolve_transport(args.transport)
    aggregated: list[dict[str, Any]] = []
    handoffs: list[dict[str, Any]] = []
    for repetition in range(args.repeat):
        print(f"repetition {repetition + 1}/{args.repeat}")
        aggregated.append(anyio.run(aggregated_case, args, repetition == 0))
        handoffs.append(anyio.run(handoff_case, args, transport, separate))
    aggregated_row = summarise("aggregated", aggregated, AGGREGATED)
    aggregated_row["check_passed"] = aggregated[0]["check_passed"]
    handoff_row = summarise("handoff", handoffs, HANDOFF)
    handoff_row["goal_met"] = [r["goal_met"] for r in handoffs]
    handoff_row["goal_met_by_median"] = (
        None
        if handoff_row["handoff_ms"] is None or handoff_row["goal_ms"] is None
        else handoff_row["handoff_ms"] <= handoff_row["goal_ms"]
    )
    for row in (aggregated_row, handoff_row):
        print({k: v for k, v in row.items() if not k.endswith("_spread")})
    if args.json:
        config = {
            "model": "tiny",
            "device": "cpu",
            "dtype": args.dtype,
            "requests": args.requests,
            "concurrency": args.concurrency,
            "prompt_len": [args.prompt_len.low, args.prompt_len.high],
            "output_len": [args.output_len.low, args.output_len.high],
            "handoff_requests": args.handoff_requests,
            "transport": transport,
            "seed": args.seed,
            "threads": args.threads,
            "repeat": args.repeat,
            "statistic": (
                "per repetition the run's figures (p50/p99 nearest-rank over requests or token gaps); the median "
                "and [min, max] over --repeat repetitions"
            ),
            "ceiling": (
                "aggregated: the same requests through the engine alone (Engine.generate, same options and "
                "concurrency, no service) in the same repetition; handoff: the aggregated service's TTFT of the "
                "same requests in the same repetition, judged against one model step of the generation engine "
                "+ 2 ms"
            ),
        }
        write_result(args.json, "serve", {"config": config, "results": [aggregated_row, handoff_row]})


if __name__ == "__main__":
    main()
