"""``kvferry bench decode``: decode and prefill throughput of the real engine against ceilings measured in the
same run, and against transformers' ``generate`` on the same weights.

**Decode.** One engine (:func:`~kvferry.engine.runner.build_engine`, the model and dtype asked for, prefix reuse
off, no speculation) serves every batch size. Per batch size and run, ``batch`` requests of ``prompt_tokens``
seeded random tokens (different per request and run) are submitted together and each generates exactly
``new_tokens`` greedy tokens. Time per step comes from the engine's own step statistics
(:attr:`Engine.step_timings <kvferry.engine.engine.Engine.step_timings>`): only the **pure decode steps**
count, those whose every item is a decode of one of the ``batch`` requests (no prefill chunk in them); a step's
time is its schedule + model + apply seconds (the model's time ends when the greedy argmax read the logits: on
CUDA that waits for the GPU). ``ms_per_step`` is their mean in a run, ``tokens_per_s`` is ``batch`` over it;
both the median over ``repeat`` runs with ``[min, max]`` (``_spread``).

**Roofline.** The bytes one decode step at batch ``B`` must move at the least: every weight once (the embedding
table only for the ``B`` rows looked up), for each attention layer the K and V of every sequence's context
(its mean length over the run: ``prompt_tokens + new_tokens / 2``) read and one position written, for each
Mamba2 layer the conv window and SSM state of every sequence read and written, and the ``B x vocab`` logits
written and read. ``roofline_ms`` is those bytes over the device's copy bandwidth measured in the same run (a
``tensor.copy_`` of ``COPY_BYTES``, read plus write, median of 3; on CUDA synchronized), ``roofline_ratio`` is
``roofline_ms / ms_per_step`` (1.0: the step runs at the memory bound).

**Peer.** transformers' ``generate`` (greedy, the same batch, prompt length and new tokens, every token forced
by ``min_new_tokens``) over the very same tensors (:func:`~kvferry.model.weights.hf_model` with ``share``),
timed end to end, prefill included: ``hf_tokens_per_s`` counts the new tokens, and ``vs_transformers`` is
kvferry's ``tokens_per_s`` over it. transformers' NemotronH falls back to plain PyTorch without the
``mamba_ssm`` / ``causal_conv1d`` kernels (it says so on stderr).

**Prefill.** One request of ``prefill_tokens`` tokens prefilled in chunks of ``max_prefill_chunk`` (as the
engine schedules it; it then generates one token); ``prefill_tokens_per_s`` is the prompt over the summed time of
the steps that ran its chunks. The ceiling: the model's FLOPs per prompt token (2 x every matrix parameter but
the embeddings, plus the attention scores over the mean context, the SSM update and readout, and the LM head
once per chunk) times the rate of one large matmul in the model's dtype measured in the same run
(``matmul_tflops``); ``prefill_ratio`` is the measured tokens/s over that ceiling.
"""

from __future__ import annotations

import math
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import torch
from attrs import frozen

from kvferry.engine.engine import Engine
from kvferry.engine.runner import EngineOptions, build_engine
from kvferry.errors import ConfigError, KvferryError
from kvferry.model.device import resolve_device
from kvferry.model.weights import ModelWeights
from kvferry.pools.spec import LayerKind, ModelSpec, dtype_from_name

__all__ = [
    "COPY_BYTES",
    "DecodeBenchConfig",
    "decode_step_bytes",
    "plot",
    "prefill_flops_per_token",
    "run_decode_bench",
    "table",
]

#: bytes of the copy that measures the device's bandwidth (source and destination each)
COPY_BYTES = {"cuda": 1 << 30, "cpu": 256 << 20}
#: side of the square matmul that measures the device's FLOP rate
MATMUL_N = {"cuda": 8192, "cpu": 1024}
#: how long one measurement (a batch's run, the peer, the prefill) may take before the benchmark gives up
DEADLINE_S = 1800.0


@frozen
class DecodeBenchConfig:
    device: str = "cpu"
    model: str = "tiny"
    dtype: str = "float32"
    batches: tuple[int, ...] = (1, 32, 128)
    prompt_tokens: int = 128
    new_tokens: int = 64
    repeat: int = 3
    prefill_tokens: int = 8192  # 0: no prefill measurement
    max_prefill_chunk: int = 512
    transformers: bool = True
    seed: int = 0
    preset_scale: int = 1
    #: EngineOptions.decode_graphs / launch_on_loop (None: the engine's default for the device)
    decode_graphs: bool | None = None
    launch_on_loop: bool | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_spread(values: Sequence[float]) -> tuple[float, list[float]]:
    return statistics.median(values), [min(values), max(values)]


def copy_bandwidth(device: torch.device, nbytes: int, runs: int = 3) -> float:
    """Bytes per second of one ``dst.copy_(src)`` of ``nbytes`` on ``device`` (read plus write), median."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / statistics.median(times)


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int, runs: int = 3) -> float:
    """FLOP per second of one ``n x n`` matmul in ``dtype`` on ``device``, median."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen, device=device, dtype=dtype)
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def decode_step_bytes(weights: ModelWeights, spec: ModelSpec, batch: int, context: float) -> dict[str, float]:
    """The least bytes one decode step of ``batch`` sequences of mean ``context`` tokens moves, by part."""
    itemsize = weights.dtype.itemsize
    embeddings = weights["model.embeddings.weight"]
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.tensors.values())
    # the embedding table is looked up, not read: B rows (a tied table is read whole as the LM head)
    if not weights.args.tie_word_embeddings:
        weight_bytes -= embeddings.numel() * embeddings.element_size()
    weight_bytes += batch * embeddings.shape[1] * itemsize
    kv = 0.0
    if spec.attention is not None:
        per_token = spec.attention.kv_bytes_per_token()
        kv = len(spec.attention_layer_ids) * batch * per_token * (context + 1)
    state = 0.0
    if spec.mamba2 is not None:
        m = spec.mamba2
        conv = (m.conv_kernel - 1) * m.conv_dim * dtype_from_name(m.conv_dtype).itemsize
        ssm = m.num_heads * m.head_dim * m.state_size * dtype_from_name(m.ssm_dtype).itemsize
        state = 2 * len(spec.layer_ids(LayerKind.MAMBA2)) * batch * (conv + ssm)
    logits = 2 * batch * spec.vocab_size * itemsize
    return {"weights": weight_bytes, "kv": kv, "state": state, "logits": logits}


def prefill_flops_per_token(weights: ModelWeights, spec: ModelSpec, tokens: int, chunk: int) -> float:
    """FLOPs per prompt token of a ``tokens``-token prefill in chunks of ``chunk``."""
    args = weights.args
    matrices = sum(
        t.numel()
        for name, t in weights.tensors.items()
        if t.dim() == 2 and name not in ("model.embeddings.weight", "lm_head.weight")
    )
    flops = 2.0 * matrices
    if spec.attention is not None:
        a = spec.attention
        # q.k and p.v over the mean causal context
        flops += len(spec.attention_layer_ids) * 2 * 2 * a.num_query_heads * a.head_dim * (tokens + 1) / 2
    if spec.mamba2 is not None:
        m = spec.mamba2
        flops += len(spec.layer_ids(LayerKind.MAMBA2)) * 2 * 2 * m.num_heads * m.head_dim * m.state_size
    flops += 2.0 * args.vocab_size * args.hidden_size * math.ceil(tokens / chunk) / tokens
    return flops


def _prompts(vocab: int, batch: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, length), generator=gen).tolist()


async def _serve(engine: Engine, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]

    async def one(index: int) -> None:
        async for token in engine.generate(prompts[index], max_tokens=new_tokens):
            out[index].append(token)

    with anyio.fail_after(DEADLINE_S):
        async with anyio.create_task_group() as tg:
            for index in range(len(prompts)):
                tg.start_soon(one, index)
    return out


async def _measure_decode(
    engine: Engine, vocab: int, batch: int, config: DecodeBenchConfig, run: int
) -> dict[str, float]:
    """One run at ``batch``: its pure decode steps' mean seconds (whole and model part), their number, and the
    wall seconds of the whole run (prefill included)."""
    prompts = _prompts(vocab, batch, config.prompt_tokens, config.seed * 7919 + batch * 131 + run)
    engine.step_timings.clear()
    t0 = time.perf_counter()
    tokens = await _serve(engine, prompts, config.new_tokens)
    wall = time.perf_counter() - t0
    if any(len(t) != config.new_tokens for t in tokens):
        raise KvferryError(f"a request of the batch of {batch} ended early")
    steps = [s for s in engine.step_timings if s.num_decodes == s.num_items == batch]
    if not steps:
        raise KvferryError(f"no step decoded the whole batch of {batch} at once")
    total = sum(s.schedule_seconds + s.model_seconds + s.apply_seconds for s in steps)
    model = sum(s.model_seconds for s in steps)
    return {"step": total / len(steps), "model": model / len(steps), "steps": len(steps), "wall": wall}


async def _measure_prefill(engine: Engine, vocab: int, config: DecodeBenchConfig) -> float:
    """Seconds of the steps that prefilled one ``prefill_tokens`` prompt (chunked as the engine schedules it)."""
    prompt = _prompts(vocab, 1, config.prefill_tokens, config.seed + 104729)[0]
    engine.step_timings.clear()
    await _serve(engine, [prompt], 1)
    steps = [s for s in engine.step_timings if s.num_decodes == 0]
    return sum(s.schedule_seconds + s.model_seconds + s.apply_seconds for s in steps)


def _hf_run(weights: ModelWeights, batch: int, config: DecodeBenchConfig, device: torch.device) -> float:
    """Seconds of transformers' greedy ``generate`` of ``new_tokens`` for ``batch`` prompts (prefill included)."""
    from kvferry.model.weights import hf_model

    model = hf_model(weights, share=True)
    ids = torch.tensor(
        _prompts(weights.args.vocab_size, batch, config.prompt_tokens, config.seed), device=device
    )
    kwargs: dict[str, Any] = {
        "attention_mask": torch.ones_like(ids),
        "max_new_tokens": config.new_tokens,
        "min_new_tokens": config.new_tokens,
        "do_sample": False,
        "pad_token_id": 0,
    }
    warm = ids[:, :8]
    with torch.no_grad():
        model.generate(
            warm,
            **{**kwargs, "attention_mask": torch.ones_like(warm), "max_new_tokens": 2, "min_new_tokens": 2},
        )
        _sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kwargs)
        _sync(device)
        seconds = time.perf_counter() - t0
    if out.shape[1] != config.prompt_tokens + config.new_tokens:
        raise KvferryError(
            f"transformers generated {out.shape[1] - config.prompt_tokens} tokens, not {config.new_tokens}"
        )
    return seconds


def _hardware(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine(), "cpu": _cpu_name(), "cpu_count": _cpu_count()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda=torch.version.cuda)
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _cpu_count() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _commit() -> str:
    root = Path(__file__).resolve().parent.parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _options(config: DecodeBenchConfig, tokens_per_block: int) -> EngineOptions:
    largest = max(config.batches)
    per_request = math.ceil((config.prompt_tokens + config.new_tokens) / tokens_per_block) + 1
    prefill = math.ceil((config.prefill_tokens + 2) / tokens_per_block) + 1 if config.prefill_tokens else 0
    return EngineOptions(
        dtype=config.dtype,
        seed=config.seed,
        device=config.device,
        num_pages=max(largest * per_request, prefill) + 2,
        num_slots=largest + 2,
        max_running=largest,
        # every prompt of the largest batch fits in one step: the decode steps that follow are pure
        token_budget=largest * (config.prompt_tokens + 1) + config.max_prefill_chunk,
        max_prefill_chunk=config.max_prefill_chunk,
        enable_reuse=False,
        preset_scale=config.preset_scale,
        decode_graphs=config.decode_graphs,
        launch_on_loop=config.launch_on_loop,
    )


def _tokens_per_block(config: DecodeBenchConfig) -> int:
    from kvferry.pools.spec import preset, preset_names

    return preset(config.model).tokens_per_block if config.model in preset_names() else 32


def run_decode_bench(config: DecodeBenchConfig, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run the benchmark (see the module's docstring); the result as JSON-ready dicts.

    :raises ~kvferry.errors.ConfigError: a device, model or size that cannot work (before anything is timed).
    """
    device = resolve_device(config.device)
    if not config.batches or min(config.batches) < 1:
        raise ConfigError("batch sizes must be at least 1")
    if config.new_tokens < 2:
        raise ConfigError("--new-tokens must be at least 2 (the first token comes from the prefill)")
    progress(f"building {config.model} ({config.dtype}) on {device}")
    built = build_engine(config.model, _options(config, _tokens_per_block(config)))
    weights = built.runner.model.weights
    spec = built.runner.model.spec
    progress("measuring the device's copy bandwidth and matmul rate")
    bandwidth = copy_bandwidth(device, COPY_BYTES[device.type])
    flop_rate = matmul_rate(device, weights.dtype, MATMUL_N[device.type])
    rows: list[dict[str, Any]] = []
    prefill: dict[str, Any] | None = None

    async def main() -> None:
        nonlocal prefill
        async with built.engine as engine:
            await _serve(engine, _prompts(spec.vocab_size, 1, 8, config.seed + 1), 2)  # warm-up
            for batch in config.batches:
                runs = []
                for run in range(config.repeat):
                    progress(f"decode: batch {batch}, run {run + 1}/{config.repeat}")
                    runs.append(await _measure_decode(engine, spec.vocab_size, batch, config, run))
                rows.append(_row(batch, runs, weights, spec, config, bandwidth))
            if config.prefill_tokens:
                times = []
                for run in range(config.repeat):
                    progress(f"prefill: {config.prefill_tokens} tokens, run {run + 1}/{config.repeat}")
                    times.append(await _measure_prefill(engine, spec.vocab_size, config))
                prefill = _prefill_row(times, weights, spec, config, flop_rate)

    anyio.run(main)
    if config.transformers:
        for row in rows:
            progress(f"transformers: batch {row['batch']}")
            seconds = [_hf_run(weights, row["batch"], config, device) for _ in range(config.repeat)]
            rates = [row["batch"] * config.new_tokens / s for s in seconds]
            row["hf_tokens_per_s"], row["hf_tokens_per_s_spread"] = _median_spread(rates)
            row["vs_transformers"] = row["e2e_tokens_per_s"] / row["hf_tokens_per_s"]
    return {
        "benchmark": "decode",
        "config": {
            "device": str(device),
            "model": config.model,
            "model_name": spec.name,
            "parameters": weights.args.num_parameters,
            "dtype": config.dtype,
            "batches": list(config.batches),
            "prompt_tokens": config.prompt_tokens,
            "new_tokens": config.new_tokens,
            "repeat": config.repeat,
            "prefill_tokens": config.prefill_tokens,
            "max_prefill_chunk": config.max_prefill_chunk,
            "transformers": config.transformers,
            "seed": config.seed,
            "preset_scale": config.preset_scale,
            "decode_graphs": built.runner.model.decode_graphs is not None,
            "launch_on_loop": built.engine.config.launch_on_loop,
            "timing": "engine step statistics of the pure decode steps (schedule + model + apply)",
        },
        "hardware": _hardware(device),
        "torch": torch.__version__,
        "commit": _commit(),
        "ceilings": {"copy_gbps": bandwidth / 1e9, "matmul_tflops": flop_rate / 1e12},
        "rows": rows,
        "prefill": prefill,
    }


def _row(
    batch: int,
    runs: Sequence[dict[str, float]],
    weights: ModelWeights,
    spec: ModelSpec,
    config: DecodeBenchConfig,
    bandwidth: float,
) -> dict[str, Any]:
    parts = decode_step_bytes(weights, spec, batch, config.prompt_tokens + config.new_tokens / 2)
    roofline_s = sum(parts.values()) / bandwidth
    row: dict[str, Any] = {"batch": batch, "runs": len(runs)}
    for name, values in (
        ("ms_per_step", [1e3 * r["step"] for r in runs]),
        ("model_ms_per_step", [1e3 * r["model"] for r in runs]),
        ("tokens_per_s", [batch / r["step"] for r in runs]),
        ("roofline_ratio", [roofline_s / r["step"] for r in runs]),
        ("e2e_tokens_per_s", [batch * config.new_tokens / r["wall"] for r in runs]),
    ):
        row[name], row[f"{name}_spread"] = _median_spread(values)
    row["decode_steps"] = int(statistics.median(r["steps"] for r in runs))
    row["roofline_ms"] = 1e3 * roofline_s
    row["roofline_bytes"] = {k: int(v) for k, v in parts.items()}
    return row


def _prefill_row(
    times: Sequence[float],
    weights: ModelWeights,
    spec: ModelSpec,
    config: DecodeBenchConfig,
    flop_rate: float,
) -> dict[str, Any]:
    flops = prefill_flops_per_token(weights, spec, config.prefill_tokens, config.max_prefill_chunk)
    ceiling = flop_rate / flops
    row: dict[str, Any] = {
        "tokens": config.prefill_tokens,
        "chunk": config.max_prefill_chunk,
        "runs": len(times),
        "flops_per_token": flops,
        "ceiling_tokens_per_s": ceiling,
    }
    rates = [config.prefill_tokens / t for t in times]
    row["prefill_tokens_per_s"], row["prefill_tokens_per_s_spread"] = _median_spread(rates)
    row["prefill_ratio"], row["prefill_ratio_spread"] = _median_spread([r / ceiling for r in rates])
    return row


def table(result: dict[str, Any]) -> str:
    """The result as text: one line per batch size, then the prefill and the ceilings."""
    cfg, ceilings = result["config"], result["ceilings"]
    lines = [
        f"{cfg['model_name']} ({cfg['parameters'] / 1e9:.2f} B parameters, {cfg['dtype']}) on {cfg['device']}: "
        f"prompt {cfg['prompt_tokens']}, {cfg['new_tokens']} new tokens, median of {cfg['repeat']} runs; decode "
        f"path {'on' if cfg.get('decode_graphs') else 'off'}, steps "
        f"{'launched from the loop' if cfg.get('launch_on_loop') else 'in a worker thread'}",
        f"{'batch':>6}{'tok/s':>11}{'ms/step':>10}{'[min, max]':>20}{'roofline ms':>13}{'ratio':>8}"
        f"{'e2e tok/s':>11}{'hf tok/s':>10}{'vs hf':>7}",
    ]
    for r in result["rows"]:
        lo, hi = r["ms_per_step_spread"]
        hf = r.get("hf_tokens_per_s")
        lines.append(
            f"{r['batch']:>6}{r['tokens_per_s']:>11.1f}{r['ms_per_step']:>10.3f}{f'[{lo:.3f}, {hi:.3f}]':>20}"
            f"{r['roofline_ms']:>13.3f}{r['roofline_ratio']:>8.3f}{r['e2e_tokens_per_s']:>11.1f}"
            + (f"{hf:>10.1f}{r['vs_transformers']:>7.2f}" if hf is not None else f"{'-':>10}{'-':>7}")
        )
    p = result["prefill"]
    if p is not None:
        lines.append(
            f"prefill of {p['tokens']} tokens in chunks of {p['chunk']}: {p['prefill_tokens_per_s']:.1f} tok/s, "
            f"{p['prefill_ratio']:.3f} of the matmul ceiling ({p['ceiling_tokens_per_s']:.1f} tok/s)"
        )
    lines.append(
        f"ceilings: copy {ceilings['copy_gbps']:.1f} GB/s, matmul {ceilings['matmul_tflops']:.2f} TFLOP/s"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Decode tokens/s against batch size, with the roofline's tokens/s dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    rows = result["rows"]
    batches = [r["batch"] for r in rows]
    ax.plot(batches, [r["tokens_per_s"] for r in rows], marker="o", label="kvferry decode steps")
    ax.plot(
        batches, [r["e2e_tokens_per_s"] for r in rows], marker=".", linestyle=":", label="kvferry end to end"
    )
    ax.plot(
        batches,
        [r["batch"] / (r["roofline_ms"] / 1e3) for r in rows],
        linestyle="--",
        alpha=0.6,
        label="memory roofline",
    )
    if all("hf_tokens_per_s" in r for r in rows):
        ax.plot(
            batches,
            [r["hf_tokens_per_s"] for r in rows],
            marker="s",
            label="transformers generate, end to end",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch")
    ax.set_ylabel("tokens/s")
    cfg = result["config"]
    ax.set_title(f"decode: {cfg['model_name']} {cfg['dtype']} on {cfg['device']}")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
