"""What ``kvferry bench serve`` shows: the table on stdout (:func:`table`) and the picture (:func:`plot`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvferry.tools.serve_bench import PassRun

__all__ = ["plot", "table"]


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f}" if value >= 100 else f"{value:.2f}"


def _pair(figures: dict[str, Any]) -> str:
    if not figures["samples"]:
        return "-"
    return f"{_ms(figures['p50'])} / {_ms(figures['p99'])}"


def table(result: dict[str, Any]) -> str:
    """The result as a table, one column per pass, then the handoff judgement and the check."""
    passes: dict[str, dict[str, Any]] = result["passes"]
    names = list(passes)
    rows: list[tuple[str, list[str]]] = [
        ("requests completed / sent", [f"{p['completed']} / {p['requests']}" for p in passes.values()]),
        ("duration s", [f"{p['duration_seconds']:.2f}" for p in passes.values()]),
        ("requests/s", [f"{p['requests_per_second']:.2f}" for p in passes.values()]),
        ("output tokens/s", [f"{p['output_tokens_per_second']:.1f}" for p in passes.values()]),
        ("TTFT p50 / p99 ms", [_pair(p["ttft_ms"]) for p in passes.values()]),
        ("ITL p50 / p99 ms", [_pair(p["itl_ms"]) for p in passes.values()]),
        ("end to end p50 / p99 ms", [_pair(p["e2e_ms"]) for p in passes.values()]),
        ("queue p50 / p99 ms", [_pair(p["queue_ms"]) for p in passes.values()]),
    ]
    if any(p["transfer_ms"]["samples"] for p in passes.values()):
        rows.append(("transfer p50 / p99 ms", [_pair(p["transfer_ms"]) for p in passes.values()]))
    if any(p["model_step_ms_median"] is not None for p in passes.values()):
        rows.append(
            (
                "model step median ms",
                [
                    f"{_ms(p['model_step_ms_median'])} ({p['engine_steps']} steps)"
                    if p["model_step_ms_median"] is not None
                    else "-"
                    for p in passes.values()
                ],
            )
        )
    rows.append(
        (
            "errors",
            [", ".join(f"{k} {n}" for k, n in p["errors"].items()) or "none" for p in passes.values()],
        )
    )
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(name), *(len(values[i]) for _, values in rows)) for i, name in enumerate(names)]
    lines = [f"target: {result['target']}"]
    lines.append(" " * label_width + "".join(f"  {n:>{w}}" for n, w in zip(names, widths, strict=True)))
    for label, values in rows:
        cells = "".join(f"  {v:>{w}}" for v, w in zip(values, widths, strict=True))
        lines.append(f"{label:<{label_width}}{cells}")
    handoff = result["handoff"]
    if handoff is not None:
        lines.append(
            f"handoff (TTFT disaggregated - aggregated, {handoff['requests']} requests): "
            f"median {_ms(handoff['median_ms'])} ms, p99 {_ms(handoff['p99_ms'])} ms"
        )
        lines.append(f"goal: median handoff within one model step + 2 ms: {handoff['verdict']}")
    check = result["check"]
    if check is not None:
        lines.append(_check_line(check))
    return "\n".join(lines)


def _check_line(check: dict[str, Any]) -> str:
    if check["passed"]:
        return f"check: every request's tokens equal offline greedy generation ({check['requests']} requests per pass)"
    parts = []
    for name, indices in check["mismatched"].items():
        if indices:
            parts.append(f"{name}: {len(indices)} differ (requests {_few(indices)})")
    for name, indices in check["unchecked"].items():
        if indices:
            parts.append(f"{name}: {len(indices)} did not complete (requests {_few(indices)})")
    return "check FAILED: " + "; ".join(parts)


def _few(indices: Sequence[int]) -> str:
    shown = ", ".join(map(str, indices[:10]))
    return shown + (" ..." if len(indices) > 10 else "")


# --- the picture -----------------------------------------------------------------------------------------


def _cdf(ax: Any, values_ms: Sequence[float], label: str) -> None:
    ordered = sorted(values_ms)
    if not ordered:
        return
    n = len(ordered)
    ax.step(ordered, [(i + 1) / n for i in range(n)], where="post", label=f"{label} ({n})")


def _throughput(run: PassRun) -> tuple[list[float], list[float]]:
    """Output tokens/s over the pass (seconds since its start, tokens/s), in at most 40 bins of at least four
    median token gaps each (tokens arrive once per engine step: finer bins only show the steps)."""
    ok = [o for o in run.outcomes if o.ok]
    times = [t - run.started for o in ok for t in o.token_times]
    gaps = sorted(g for o in ok for g in o.inter_token if g > 0)
    span = max(run.ended - run.started, 1e-6)
    width = max(span / 40, 4 * gaps[len(gaps) // 2] if gaps else 0.0)
    bins = max(1, math.ceil(span / width))
    counts = [0] * bins
    for t in times:
        counts[min(bins - 1, max(0, int(t / width)))] += 1
    return [(i + 0.5) * width for i in range(bins)], [c / width for c in counts]


def plot(runs: Sequence[PassRun], result: dict[str, Any], path: str) -> None:
    """TTFT and inter-token latency distributions (CDF) per pass, output tokens/s over time per pass, and
    either the per-request handoff (disaggregated) or each request's life over time (the last pass)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ttft_ax, itl_ax), (rate_ax, fourth_ax) = axes
    for run in runs:
        ok = [o for o in run.outcomes if o.ok]
        _cdf(ttft_ax, [o.ttft * 1e3 for o in ok if o.ttft is not None], run.name)
        _cdf(itl_ax, [g * 1e3 for o in ok for g in o.inter_token], run.name)
        xs, ys = _throughput(run)
        rate_ax.plot(xs, ys, drawstyle="steps-mid", label=run.name)
    ttft_ax.set_title("time to first token (CDF over requests)")
    ttft_ax.set_xlabel("ms")
    itl_ax.set_title("inter-token latency (CDF over token gaps)")
    itl_ax.set_xlabel("ms")
    # log, with a linear stretch below 1 ms for the tokens of one step (their gaps are about 0)
    itl_ax.set_xscale("symlog", linthresh=1.0)
    for ax in (ttft_ax, itl_ax):
        ax.set_ylabel("fraction")
        ax.set_ylim(0, 1.02)
    rate_ax.set_title("output tokens/s over the run")
    rate_ax.set_xlabel("seconds since the pass started")
    rate_ax.set_ylabel("tokens/s")
    rate_ax.set_ylim(bottom=0)
    if result["handoff"] is not None and len(runs) == 2:
        _handoff(fourth_ax, runs[0], runs[1], result["handoff"])
    else:
        _timeline(fourth_ax, runs[-1])
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.suptitle(_headline(result))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _timeline(ax: Any, run: PassRun) -> None:
    """Each request as a line: waiting for its first token (grey), then generating (blue); failed ones red."""
    waiting: tuple[list[int], list[float], list[float]] = ([], [], [])
    generating: tuple[list[int], list[float], list[float]] = ([], [], [])
    failed: tuple[list[int], list[float], list[float]] = ([], [], [])
    for row, outcome in enumerate(sorted(run.outcomes, key=lambda o: o.sent_at)):
        sent, end = outcome.sent_at - run.started, outcome.ended_at - run.started
        if not outcome.ok:
            target = failed
        elif outcome.token_times:
            first = outcome.token_times[0] - run.started
            for series, start, stop in ((waiting, sent, first), (generating, first, end)):
                series[0].append(row)
                series[1].append(start)
                series[2].append(stop)
            continue
        else:
            target = waiting
        target[0].append(row)
        target[1].append(sent)
        target[2].append(end)
    for (rows, starts, stops), color, label in (
        (waiting, "0.75", "waiting for the first token"),
        (generating, "tab:blue", "generating"),
        (failed, "tab:red", "failed"),
    ):
        if rows:
            ax.hlines(rows, starts, stops, colors=color, linewidth=1.2, label=label)
    ax.set_title(f"each request over time ({run.name}, in the order sent)")
    ax.set_xlabel("seconds since the pass started")
    ax.set_ylabel("request")
    ax.set_ylim(len(run.outcomes), -1)


def _handoff(ax: Any, aggregated: PassRun, disaggregated: PassRun, handoff: dict[str, Any]) -> None:
    differences = [
        (d.ttft - a.ttft) * 1e3
        for a, d in zip(aggregated.outcomes, disaggregated.outcomes, strict=True)
        if a.ok and d.ok and a.ttft is not None and d.ttft is not None
    ]
    _cdf(ax, differences, "TTFT disaggregated - aggregated")
    if handoff["median_ms"] is not None:
        ax.axvline(
            handoff["median_ms"], color="black", linestyle=":", label=f"median {_ms(handoff['median_ms'])} ms"
        )
    if handoff["goal_ms"] is not None:
        ax.axvline(
            handoff["goal_ms"], color="red", linestyle="--", label=f"goal {_ms(handoff['goal_ms'])} ms"
        )
    met = handoff["goal_met"]
    ax.set_title(
        "handoff per request (CDF): goal "
        + ("met" if met else "not met" if met is not None else "not judged")
    )
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction")
    ax.set_ylim(0, 1.02)


def _headline(result: dict[str, Any]) -> str:
    config = result["config"]
    load = (
        f"concurrency {config['concurrency']}" if config["rate"] is None else f"{config['rate']:g} requests/s"
    )
    first = next(iter(result["passes"].values()))
    return (
        f"{config['model']}, {first['requests']} requests, {load}, prompts "
        f"{_range(config['prompt_len'])}, outputs {_range(config['output_len'])} tokens — {result['target']}"
    )


def _range(bounds: Sequence[int]) -> str:
    low, high = bounds
    return str(low) if low == high else f"{low}:{high}"
