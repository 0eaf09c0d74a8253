"""Mapping and staging of one disaggregated request on one device (no transport): the bounce path's
throughput against one contiguous copy of the same bytes in the same run (the ceiling: a memcpy on the host, a
device copy on CUDA).

For one request of ``--preset`` (default nemotron-h-8b, 8K-token prompt) and each case (``--cases``: sender TP
- receiver TP, ``xN`` for a receiver with N times the tokens per block): the mapping time of every (sender,
receiver) rank pair, fragment counts before and after coalescing, and the bounce path run for real on the
device: gather into a staging buffer (kernels.copy), one contiguous device copy standing in for the transport
write, scatter on the receiver. Its GB/s is set against a contiguous copy of the same bytes (the ceiling,
:class:`~kvferry.tools.ceiling.CopyCeiling`), timed alternately with it: ``ratio`` and ``ratio_memcpy`` (host) or
``ratio_device_copy`` (CUDA) are the median of the per-run ratios. Times are medians over ``--repeat`` runs
(``_spread``: their ``[min, max]``). Every receiver byte is
checked against the sender's through the direct plan's fragments, so the bounce path is also checked bit-exact
on the device (Triton kernels on CUDA).

    python benchmarks/disagg_transfer.py [--device cpu|cuda] [--preset nemotron-h-8b] [--tokens 8192]
        [--cases 1-1,1-1x2,1-2] [--repeat 3] [--json benchmarks/results/<machine>/disagg_transfer.json]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import torch
from _provenance import median_spread, write_result

from kvferry._glibc import reexec_tuned
from kvferry.disagg.mapping import BouncePolicy, MappingStatistics, PeerMap, RequestCache, TokenRange
from kvferry.kernels.copy import gather_fragments
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.spec import ModelSpec, preset
from kvferry.tools.ceiling import CopyCeiling

CASES = "1-1,1-1x2,1-2,2-1,2-4,4-2,1-4,4-1"


def parse_case(text: str) -> tuple[int, int, int]:
    """``"S-D"`` or ``"S-DxN"``: sender TP, receiver TP, the receiver's tokens per block over the sender's."""
    pair, _, factor = text.partition("x")
    src, dst = pair.split("-")
    return int(src), int(dst), int(factor or 1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, repeat: int) -> list[float]:
    """Seconds of ``repeat`` calls of ``fn`` (each waiting for the device), after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - began)
    return times


def build_arenas(spec: ModelSpec, tp: int, tokens: int, device: torch.device) -> list[CacheArena]:
    assert spec.drafter is not None
    pages = -(-tokens // spec.tokens_per_block) * 2
    draft = -(-tokens // spec.drafter.tokens_per_block) * 2
    out = []
    for rank in range(tp):
        layout = CacheLayout.build(spec.shard(tp, rank), num_pages=pages, num_slots=3, num_draft_pages=draft)
        arena = CacheArena(layout, device)
        for tensor in arena.pool_tensors().values():
            tensor.random_(0, 256)
        out.append(arena)
    return out


def request(spec: ModelSpec, tokens: int, rng: np.random.Generator, slot: int) -> RequestCache:
    assert spec.drafter is not None
    n, d = -(-tokens // spec.tokens_per_block), -(-tokens // spec.drafter.tokens_per_block)
    # even ids from a shuffled half: realistic scatter, never two adjacent pages
    return RequestCache(
        {"attention": 2 * rng.permutation(n)[:n], "draft": 2 * rng.permutation(d)[:d]}, slot=slot
    )


def pool_bytes(arenas: list[CacheArena], fragments: np.ndarray) -> torch.Tensor:
    """The bytes at absolute-address ``fragments`` (any pool of ``arenas``), concatenated in order."""
    tensors = sorted((t for a in arenas for t in a.pool_tensors().values()), key=lambda t: t.data_ptr())
    starts = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
    table = fragments.astype(np.int64)
    which = np.searchsorted(starts, table[:, 0], side="right") - 1
    parts = []
    cuts = np.flatnonzero(np.concatenate(([True], which[1:] != which[:-1], [True])))
    for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist(), strict=True):
        t = tensors[int(which[a])]
        rel = table[a:b].copy()
        rel[:, 0] -= t.data_ptr()
        parts.append(gather_fragments(t, rel))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def run_case(
    spec: ModelSpec, src_tp: int, dst_tp: int, tpb_factor: int, tokens: int, device: torch.device, repeat: int
) -> dict[str, Any]:
    assert spec.drafter is not None
    dst_spec = attrs.evolve(spec, tokens_per_block=spec.tokens_per_block * tpb_factor)
    src_arenas = build_arenas(spec, src_tp, tokens, device)
    dst_arenas = build_arenas(dst_spec, dst_tp, tokens, device)
    began = time.perf_counter()
    peer = PeerMap.build([a.page_table() for a in src_arenas], [a.page_table() for a in dst_arenas])
    build_s = time.perf_counter() - began
    rng = np.random.default_rng(0)
    src_req, dst_req = request(spec, tokens, rng, 1), request(dst_spec, tokens, rng, 2)
    span = TokenRange(0, tokens)
    pairs = [(s, d) for s in range(src_tp) for d in peer.targets(s)]

    def plan_all(policy: BouncePolicy) -> list[Any]:
        return [peer.pair(s, d).plan(src_req, dst_req, span, policy=policy) for s, d in pairs]

    map_s, map_spread = median_spread(timed(lambda: plan_all(BouncePolicy()), device, repeat))
    direct = plan_all(BouncePolicy.never())
    bounced = plan_all(BouncePolicy.always())
    scatter = [peer.pair(s, d).scatter_plan(dst_req, span) for s, d in pairs]
    nbytes = sum(p.nbytes for p in direct)
    staging_src = torch.empty(max(p.nbytes for p in direct), dtype=torch.uint8, device=device)
    staging_dst = torch.empty_like(staging_src)

    def bounce() -> None:
        for (s, d), plan, rx in zip(pairs, bounced, scatter, strict=True):
            assert plan.gather is not None
            packed = plan.gather.gather(src_arenas[s].pool_tensors(), staging_src)
            staging_dst[: plan.nbytes].copy_(packed)  # stands in for the transport's one write
            rx.scatter(dst_arenas[d].pool_tensors(), staging_dst)

    ceiling = CopyCeiling(nbytes, str(device))
    timed(bounce, device, 1)  # warm-up
    bounce_times, ceiling_times = [], []
    for _ in range(repeat):  # alternately, so that load from other processes hits both alike
        bounce_times += timed(bounce, device, 1)
        ceiling_times.append(ceiling.seconds())
    bounce_s, bounce_spread = median_spread(bounce_times)
    ceiling_s, ceiling_spread = median_spread(ceiling_times)
    ratio, ratio_spread = median_spread(c / b for c, b in zip(ceiling_times, bounce_times, strict=True))
    identical = all(
        torch.equal(pool_bytes(src_arenas, p.src), pool_bytes(dst_arenas, p.dst))
        for p in direct
        if not p.empty
    )
    stats = MappingStatistics.total(p.statistics for p in direct)
    auto = MappingStatistics.total(p.statistics for p in plan_all(BouncePolicy()))
    return {
        "src_tp": src_tp,
        "dst_tp": dst_tp,
        "src_tokens_per_block": spec.tokens_per_block,
        "dst_tokens_per_block": dst_spec.tokens_per_block,
        "tokens": tokens,
        "pairs": len(pairs),
        "bytes": nbytes,
        "units": stats.units,
        "fragments": stats.fragments,
        "auto_bounce_pairs": auto.bounced,
        "gather_fragments": sum(p.gather.num_fragments for p in bounced if p.gather is not None),
        "scatter_fragments": sum(r.num_fragments for r in scatter),
        "peer_build_ms": build_s * 1e3,
        "map_ms": map_s * 1e3,
        "map_ms_spread": [x * 1e3 for x in map_spread],
        "bounce_gbps": nbytes / bounce_s / 1e9,
        "bounce_gbps_spread": [nbytes / bounce_spread[1] / 1e9, nbytes / bounce_spread[0] / 1e9],
        "ceiling_gbps": nbytes / ceiling_s / 1e9,
        "ceiling_gbps_spread": [nbytes / ceiling_spread[1] / 1e9, nbytes / ceiling_spread[0] / 1e9],
        "ratio": ratio,
        "ratio_spread": ratio_spread,
        ceiling.key: ratio,
        f"{ceiling.key}_spread": ratio_spread,
        "identical": identical,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="nemotron-h-8b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--cases", default=CASES, help=f"comma-separated S-D[xN] (default {CASES})")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per figure (median and spread)")
    parser.add_argument("--json", default=None, help="write the stamped result here")
    args = parser.parse_args()
    reexec_tuned()  # host copies of fragments near a memcpy, as the kvferry command runs (kvferry._glibc)
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    device = torch.device(args.device)
    spec = preset(args.preset)
    results = []
    for src_tp, dst_tp, factor in (parse_case(c) for c in args.cases.split(",")):
        row = run_case(spec, src_tp, dst_tp, factor, args.tokens, device, args.repeat)
        results.append(row)
        print(
            f"tp {src_tp}->{dst_tp} tpb x{factor}: {row['bytes'] / 1e6:.0f} MB, units {row['units']}, "
            f"fragments {row['fragments']}, gather/scatter {row['gather_fragments']}/{row['scatter_fragments']}, "
            f"map {row['map_ms']:.1f} ms, bounce {row['bounce_gbps']:.1f} GB/s vs ceiling "
            f"{row['ceiling_gbps']:.1f} GB/s ({row['ratio']:.2f} of a {'memcpy' if device.type == 'cpu' else 'device copy'}), identical {row['identical']}",
            flush=True,
        )
    config = {
        "preset": args.preset,
        "tokens": args.tokens,
        "device": str(device),
        "cases": args.cases,
        "repeat": args.repeat,
        "env": {k: v for k, v in os.environ.items() if k.startswith("TRITON_")},
        "statistic": "median over --repeat runs ([min, max] in _spread); ratio: per run the ceiling's seconds "
        "over the bounce path's (timed alternately), then the median",
        "ceiling": "one contiguous copy of the request's bytes on the same device: libc memcpy on the host, "
        "copy_ on CUDA",
    }
    if args.json:
        write_result(args.json, "disagg_transfer", {"config": config, "results": results}, str(device))
    return 0 if all(r["identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
