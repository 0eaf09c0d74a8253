"""Host-side overhead of the engine per decode step (scheduler and cache manager, sampling and delivery)
against the model step measured in the same run.

For each batch size (``--sizes``, default 1, 64 and 256 concurrent requests) the engine serves that many
requests at once over the paged reference model (``tiny``); only steps where every request decodes are
measured. Per step, as medians over those steps: ``schedule_us`` (the scheduler, including the manager's
grow/resume and the previous step's commits), ``apply_us`` (sampling, draft acceptance, recording commits,
handing tokens to the streams), ``host_us`` (their sum per step; its median is not the sum of the two
medians), ``model_ms`` and ``host_fraction`` = host / (host + model). The whole measurement runs ``--repeat``
times, each with a fresh engine: every figure is the median of the runs' medians, ``_spread`` their
``[min, max]``. ``host_us_p90``: the 90th percentile over a run's measured steps. Goal: host under 1 ms per step
at 256 requests, p90 under 2 ms.

Each size runs in every mode of ``--mode`` (default all four). ``loop``: the model step runs on the event loop
(``step_in_thread=False``), everything else between steps. ``thread``: the step runs in its worker thread, nothing
overlapped. ``overlap`` (``EngineOptions.overlap``, the default of ``build_engine``): the step runs in its worker
thread and the loop hands the last step's commits to the manager and grows the next step's decodes meanwhile;
``overlapped_us`` is that work (not in ``host_us``: it runs under the model step), and the streams take the step's
tokens meanwhile too (a worker thread even on CUDA). ``launched`` (``EngineOptions.launch_on_loop``, the default on
CUDA): as ``overlap``, but a step of plain decodes is launched from the loop itself, the loop's work runs while
the device computes and the step's tokens are polled; no worker thread (on the CPU the launch computes the step
before it returns, so only the hand-off's cost shows). ``between_us``: the loop's time from one step's end to the
next one's start, outside ``host_us`` (the streams taking their tokens, unless overlapped; reaping cancels). What stays between steps in
every mode: planning (which requests, their tokens) and sampling, which need the step's tokens.

    python benchmarks/host_overhead.py [--sizes 1 64 256] [--steps 32] [--spec-k 0] [--device cpu|cuda]
        [--mode launched overlap thread loop] [--repeat 3] [--decode-graphs] [--arithmetic run|replay]
        [--json benchmarks/results/<machine>/host_overhead.json] [--plot FILE.png]

``step_own_us``: the model step's time less the loop's work done under it, per step: the step's own time where it
runs on the loop (``loop``, ``launched``: with ``--arithmetic replay`` on the CPU, the host's time of the launch
and the read-back); for the worker thread a lower bound only (the thread's Python and the loop's work interleave).

``--decode-graphs`` runs the decode rows through the decode path (on the CPU eagerly, with the torch forms of its
kernels; on CUDA it is on anyway). ``--arithmetic replay`` (with it) measures the host's share of the model step
alone: the decode step's arithmetic runs once per batch bucket and later steps hand back those outputs, as the
replay of a captured graph costs the host almost nothing; ``model_ms`` is then the runner's, the model's and the
read-back's Python around it (the tokens differ from a real run's: a benchmark of host time only).

The scheduler hands a step's commits to the manager in one ``commit_many`` when the next step is scheduled,
and grows every decode that needs a page with one ``grow_many``; ``num_accepted`` of verify windows is
written once per step by the runner, inside the model's time.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import anyio
import torch
from _provenance import median_spread, write_result

from kvferry.engine.runner import EngineOptions, build_engine

PROMPT_LEN = 8
#: the figures of a run that are summarised over the runs
FIGURES = (
    "schedule_us",
    "apply_us",
    "host_us",
    "host_us_per_request",
    "host_us_p90",
    "overlapped_us",
    "between_us",
    "model_ms",
    "step_own_us",
    "host_fraction",
)


def replay_arithmetic() -> None:
    """Make every decode step after a bucket's first hand back that step's outputs (host time only)."""
    from kvferry.model.decode_graph import DecodeGraphs

    forward = DecodeGraphs._forward
    outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def replayed(
        self: DecodeGraphs, bucket: int, width: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(self), bucket)
        if key not in outputs:
            outputs[key] = forward(self, bucket, width)
        return outputs[key]

    DecodeGraphs._forward = replayed  # type: ignore[method-assign]


async def measure(
    size: int, steps: int, spec_k: int, device: str, dtype: str, mode: str, decode_graphs: bool | None = None
) -> dict[str, Any]:
    tpb = 4
    tokens_per_request = PROMPT_LEN + steps + 8 + 2 * (spec_k + 1)
    pages_per_request = -(-tokens_per_request // tpb) + 1
    options = EngineOptions(
        dtype=dtype,
        device=device,
        num_pages=size * pages_per_request + 1,
        num_slots=2 * size + 1,
        max_running=size,
        # room to admit every prompt in one step, so the measured steps are pure decode
        token_budget=size * (1 + spec_k) + size * PROMPT_LEN + 1,
        max_prefill_chunk=PROMPT_LEN,
        max_spec_k=spec_k,
        enable_reuse=True,
        step_in_thread=mode != "loop",
        overlap=mode in ("overlap", "launched"),
        launch_on_loop=mode == "launched",
        decode_graphs=decode_graphs,
    )
    built = build_engine("tiny", options)
    engine = built.engine
    max_tokens = steps + 4

    async def one(i: int) -> None:
        prompt = [(7 * i + j) % 256 for j in range(PROMPT_LEN)]
        await engine.generate(prompt, max_tokens=max_tokens, spec_k=spec_k).collect()

    async with engine, anyio.create_task_group() as tg:
        for i in range(size):
            tg.start_soon(one, i)
    decode_steps = [t for t in engine.step_timings if t.num_decodes == size and t.num_items == size]
    decode_steps = decode_steps[1:]  # the first decode step pays one-off allocation costs
    if not decode_steps:
        raise RuntimeError(f"no pure decode step at batch {size}")

    def median_us(values: list[float]) -> float:
        return statistics.median(values) * 1e6

    schedule_us = median_us([t.schedule_seconds for t in decode_steps])
    apply_us = median_us([t.apply_seconds for t in decode_steps])
    host_us = median_us([t.host_seconds for t in decode_steps])
    model_us = median_us([t.model_seconds for t in decode_steps])
    return {
        "batch": size,
        "mode": mode,
        "measured_steps": len(decode_steps),
        "schedule_us": schedule_us,
        "apply_us": apply_us,
        "host_us": host_us,
        "host_us_per_request": host_us / size,
        "host_us_p90": sorted(t.host_seconds for t in decode_steps)[int(0.9 * (len(decode_steps) - 1))] * 1e6,
        "host_us_mean": statistics.mean(t.host_seconds for t in decode_steps) * 1e6,
        "overlapped_us": median_us([t.overlapped_seconds for t in decode_steps]),
        "between_us": median_us([t.between_seconds for t in decode_steps]),
        "model_ms": model_us / 1e3,
        "step_own_us": median_us([t.model_seconds - t.overlapped_seconds for t in decode_steps]),
        "host_fraction": host_us / (host_us + model_us),
        "under_1ms": host_us < 1000.0,
    }


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    sizes = [f"{r['batch']} {r['mode']}" for r in results]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(sizes, [r["schedule_us"] for r in results], label="schedule (+ manager grow, commit)")
    left.bar(
        sizes,
        [r["apply_us"] for r in results],
        bottom=[r["schedule_us"] for r in results],
        label="apply (sampling, bookkeeping)",
    )
    left.axhline(1000, color="red", linestyle="--", label="goal: 1 ms")
    left.set_xlabel("concurrent decode requests")
    left.set_ylabel("host time per step (us, median)")
    tallest = max([1000.0] + [r["schedule_us"] + r["apply_us"] for r in results])
    left.set_ylim(0, 1.45 * tallest)  # room for the legend above the bars
    left.legend(loc="upper left")
    right.bar(sizes, [100 * r["host_fraction"] for r in results])
    right.set_xlabel("concurrent decode requests")
    right.set_ylabel("host share of the step (%)")
    for i, r in enumerate(results):
        right.annotate(
            f"model {r['model_ms']:.1f} ms", (i, 100 * r["host_fraction"]), ha="center", va="bottom"
        )
    fig.suptitle("kvferry engine: host overhead per decode step (tiny reference model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One batch size's runs as one row: every figure's median over the runs and its ``[min, max]``."""
    row: dict[str, Any] = {"batch": runs[0]["batch"], "mode": runs[0]["mode"], "runs": len(runs)}
    row["measured_steps"] = sum(r["measured_steps"] for r in runs)
    for key in FIGURES:
        row[key], row[f"{key}_spread"] = median_spread(r[key] for r in runs)
    row["under_1ms"] = row["host_us"] < 1000.0
    row["p90_under_2ms"] = row["host_us_p90"] < 2000.0
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 64, 256])
    parser.add_argument("--steps", type=int, default=32, help="decode steps per request")
    parser.add_argument("--spec-k", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--mode",
        nargs="+",
        choices=["launched", "overlap", "thread", "loop"],
        default=["launched", "overlap", "thread", "loop"],
        help="how the loop runs the model step (see above)",
    )
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--repeat", type=int, default=3, help="runs per batch size (median and spread)")
    parser.add_argument("--decode-graphs", action="store_true", help="decode rows through the decode path")
    parser.add_argument(
        "--arithmetic",
        choices=["run", "replay"],
        default="run",
        help="replay: the decode step's outputs replayed after a bucket's first step (host time only)",
    )
    parser.add_argument("--json", default=None, help="write the stamped result here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the result into this PNG (matplotlib)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    if args.arithmetic == "replay":
        if not args.decode_graphs:
            parser.error("--arithmetic replay needs --decode-graphs")
        replay_arithmetic()
    torch.set_num_threads(args.threads)
    results = [
        summarise(
            [
                anyio.run(
                    measure,
                    size,
                    args.steps,
                    args.spec_k,
                    args.device,
                    args.dtype,
                    mode,
                    True if args.decode_graphs else None,
                )
                for _ in range(args.repeat)
            ]
        )
        for size in args.sizes
        for mode in args.mode
    ]
    for r in results:
        print(
            f"batch {r['batch']:4d} {r['mode']:7s}: host {r['host_us']:8.1f} us/step "
            f"(p90 {r['host_us_p90']:.1f}; schedule {r['schedule_us']:.1f}, apply {r['apply_us']:.1f}; "
            f"{r['host_us_per_request']:.2f} us/request; under the step {r['overlapped_us']:.1f}; between steps "
            f"{r['between_us']:.1f}), "
            f"model {r['model_ms']:.2f} ms ({r['model_ms_spread'][0]:.2f}-{r['model_ms_spread'][1]:.2f}), "
            f"own {r['step_own_us']:.0f} us, host share {100 * r['host_fraction']:.1f}% (spread of host_us over "
            f"{r['runs']} runs: {r['host_us_spread'][0]:.1f}-{r['host_us_spread'][1]:.1f})"
        )
    config = {
        "model": "tiny",
        "device": args.device,
        "dtype": args.dtype,
        "spec_k": args.spec_k,
        "modes": args.mode,
        "steps": args.steps,
        "threads": args.threads,
        "decode_graphs": args.decode_graphs,
        "arithmetic": args.arithmetic,
        "repeat": args.repeat,
        "statistic": "per run the median over its pure decode steps; the median and [min, max] over --repeat runs",
        "ceiling": "the model's own step time in the same run (host_fraction = host / (host + model))",
    }
    if args.json:
        write_result(args.json, "host_overhead", {"config": config, "results": results}, args.device)
    if args.plot is not None and not plot(results, args.plot):
        print("matplotlib is not installed: no plot (pip install 'kvferry[bench]')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
