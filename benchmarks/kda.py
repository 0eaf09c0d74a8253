"""KimiLinear's delta attention (KDA) over state slots, per form, against the memory roofline measured in the
same run.

Forms: ``torch`` (kvferry's own arithmetic: the chunked WY form for prefill, the per-token recurrence for
decode; the CPU's oracle) and, where ``fla`` imports on CUDA, ``fla`` (flash-linear-attention's ``chunk_kda``
for prefill, ``fused_recurrent_kda`` for decode), both called through :func:`kvferry.kernels.kda.kda_scan` on a
slot pool, gather and write-back included. Per row: seconds (median of ``--repeat``, with ``[min, max]``),
tokens/s, the bytes the scan must move (q, k, v, log gate, beta, output; every touched slot's float32 state read
and written) over the same-run ``copy_`` bandwidth (``roofline_ms``) and ``roofline_ratio``; and per shape
``fla_speedup`` (torch seconds over fla seconds). Each fla row is also checked against the torch row's output
and state (``max_abs_diff``), so a speed figure never stands for a wrong result.

Shapes: one prompt of ``--prefill-tokens`` (batch 1, chunked), and decode steps (one token) at each ``--batch``.
Dims default to KimiLinear-48B-A3B's KDA layer (32 heads of 128).

    python benchmarks/kda.py [--device cuda] [--dtype bfloat16] [--heads 32] [--head-dim 128]
        [--prefill-tokens 8192] [--batch 1 32 128] [--repeat 3] [--json benchmarks/results/<machine>/kda.json]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from typing import Any

import torch
from _provenance import median_spread, write_result

from kvferry.kernels.kda import fla_available, kda_scan
from kvferry.tools.decode_bench import COPY_BYTES, copy_bandwidth

#: per shape, enough calls to time so that one timing is not one launch's latency
MIN_SECONDS = 0.05


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _inputs(batch: int, length: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> tuple[
    torch.Tensor, ...
]:  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(batch * 7919 + length)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32)

    q, k, v = (rand(batch, length, heads, head_dim).to(dtype) for _ in range(3))
    g = -torch.rand(batch, length, heads, head_dim, generator=gen, device=device) * 0.7
    beta = torch.rand(batch, length, heads, generator=gen, device=device).to(dtype)
    return q, k, v, g, beta


def scan_bytes(batch: int, length: int, heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one scan must read and write: q, k, v, output (``dtype``), g (float32), beta; the slots' float32
    state read once and written once."""
    size = torch.empty(0, dtype=dtype).element_size()
    per_token = heads * head_dim * (4 * size + 4) + heads * size
    return batch * length * per_token + 2 * batch * heads * head_dim * head_dim * 4


def _time(run: Any, device: torch.device, repeat: int) -> tuple[float, list[float]]:
    run()  # compile / warm
    _sync(device)
    began = time.perf_counter()
    run()
    _sync(device)
    calls = max(1, int(MIN_SECONDS / max(time.perf_counter() - began, 1e-6)))
    seconds = []
    for _ in range(repeat):
        _sync(device)
        began = time.perf_counter()
        for _ in range(calls):
            run()
        _sync(device)
        seconds.append((time.perf_counter() - began) / calls)
    return median_spread(seconds)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    heads, head_dim = args.heads, args.head_dim
    bandwidth = copy_bandwidth(device, COPY_BYTES[device.type])
    forms = ["torch"] + (["fla"] if fla_available(device) else [])
    shapes = ([("prefill", 1, args.prefill_tokens)] if args.prefill_tokens else []) + [
        ("decode", b, 1) for b in args.batch
    ]
    rows: list[dict[str, Any]] = []
    for phase, batch, length in shapes:
        q, k, v, g, beta = _inputs(batch, length, heads, head_dim, dtype, device)
        num_slots = batch + 1
        start = torch.randn(num_slots, heads, head_dim, head_dim, device=device) * 0.1
        # slots in a random order, so that the gather and the write-back are scattered as in a pool
        order = torch.randperm(num_slots, generator=torch.Generator().manual_seed(batch))
        slots = order[:batch].to(device)
        results: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        row_of: dict[str, dict[str, Any]] = {}
        for form in forms:
            pool = start.clone()

            run = functools.partial(
                kda_scan, q, k, v, g, beta, pool, slots,
                chunked=phase == "prefill", use_fla=form == "fla", check=False,
            )  # fmt: skip
            pool.copy_(start)
            out = run()
            results[form] = (out.float(), pool[slots].clone())
            median, spread = _time(run, device, args.repeat)
            nbytes = scan_bytes(batch, length, heads, head_dim, dtype)
            roofline = nbytes / bandwidth
            row: dict[str, Any] = {
                "phase": phase,
                "form": form,
                "batch": batch,
                "tokens": length,
                "ms": median * 1e3,
                "ms_spread": [s * 1e3 for s in spread],
                "tokens_per_s": batch * length / median,
                "bytes": nbytes,
                "roofline_ms": roofline * 1e3,
                "roofline_ratio": roofline / median,
            }
            row_of[form] = row
            rows.append(row)
        if "fla" in row_of:
            out_fla, state_fla = results["fla"]
            out_ref, state_ref = results["torch"]
            row_of["fla"]["max_abs_diff"] = {
                "output": float((out_fla - out_ref).abs().max()),
                "state": float((state_fla - state_ref).abs().max()),
            }
            row_of["fla"]["fla_speedup"] = row_of["torch"]["ms"] / row_of["fla"]["ms"]
    return {
        "device": args.device,
        "dtype": args.dtype,
        "heads": heads,
        "head_dim": head_dim,
        "forms": forms,
        "ceilings": {"copy_gbps": bandwidth / 1e9},
        "rows": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"KDA scan, {result['heads']} heads x {result['head_dim']}, {result['dtype']}, "
        f"copy {result['ceilings']['copy_gbps']:.0f} GB/s",
        f"{'phase':8} {'form':6} {'batch':>5} {'tokens':>6} {'ms':>9} {'tok/s':>11} {'roofline':>9} {'speedup':>8}",
    ]
    for r in result["rows"]:
        speedup = f"{r['fla_speedup']:.1f}x" if "fla_speedup" in r else ""
        lines.append(
            f"{r['phase']:8} {r['form']:6} {r['batch']:5d} {r['tokens']:6d} {r['ms']:9.3f} "
            f"{r['tokens_per_s']:11.0f} {r['roofline_ratio']:9.3f} {speedup:>8}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--prefill-tokens", type=int, default=8192)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if (
        args.repeat < 1
        or args.heads < 1
        or args.head_dim < 16
        or min(args.batch) < 1
        or args.prefill_tokens < 0
    ):
        parser.error("--repeat, --heads and --batch take positive numbers, --head-dim at least 16")
    result = measure(args)
    print(table(result))
    if args.json:
        write_result(args.json, "kda", result, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
