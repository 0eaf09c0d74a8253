"""Why the span copy's grid form trails a plain copy on the H200, and what closes the gap: variants of its
kernel (one program per block of a piece, the piece's addresses looked up in a table) timed on the device
against ``copy_`` and a table-free Triton copy of the same bytes, each ceiling timed again beside every row.

The variants, each a constexpr of one kernel:

- ``hint``: 0 plain loads and stores; 1 data loaded ``.cg`` and stored ``.cs`` (past L1, so the table's lines
  stay there for the next programs of a piece); 2 data ``evict_first``, the table ``evict_last``;
- ``vec``: 0 the table row's three words as three loads; 1 one 32-byte vector load of a padded row; 2 a row
  of absolute byte addresses and lengths (source, bytes, destination, bytes: two fragment rows side by side),
  the words worked out in the kernel;
- ``table``: the table in device memory, or in pinned host memory read by the kernel over PCIe;
- ``uniform``: 1 when every piece is a whole number of blocks of one length: no length is loaded, no block is
  masked (the launch knows the blocks per piece);
- ``block`` words of 8 bytes and ``warps`` per program.

Cases are fragment sizes (KiB) over ``--mib``; layouts ``contiguous`` (both sides in order) and ``transfer``
(the destination's runs permuted, as ``kvferry bench transfer`` writes). Every variant's bytes are checked.
``--library`` also times :mod:`kvferry.kernels.span_copy`'s own launches of the same pages (``copy_spans`` with its
piece table, ``copy_fragments`` with the fragment rows, ``copy_indexed`` with an indexed table built once and
ids per launch), and ``copy_fragments`` over the rows ``kvferry bench transfer``'s writer gives it (its layout,
neighbouring runs merged where they join). CUDA events around one launch also count the host's work before it
while the device waits; ``--burst 5`` puts five launches between the events, which leaves the kernels' own time.

    python benchmarks/grid_kernel_probe.py --json $OUT/grid_kernel_probe_h200.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from kvferry.kernels import span_copy


@triton.jit  # type: ignore[untyped-decorator,misc]
def grid_variant(  # type: ignore[no-untyped-def]
    base_ptr,
    table_ptr,
    num_pieces,
    BLOCK: tl.constexpr,
    HINT: tl.constexpr,
    VEC: tl.constexpr,
    UNIFORM: tl.constexpr,
):
    words = base_ptr
    piece = tl.program_id(1)
    if piece < num_pieces:
        if VEC == 2:
            # a row of absolute byte addresses and lengths: (source, bytes, destination, bytes)
            row = table_ptr + 4 * piece.to(tl.int64)
            origin = base_ptr.to(tl.int64, bitcast=True)
            src = (tl.load(row) - origin) >> 3
            dst = (tl.load(row + 2) - origin) >> 3
            count = tl.load(row + 1) >> 3
        elif VEC:
            four = tl.arange(0, 4)
            if HINT == 2:
                v = tl.load(table_ptr + 4 * piece.to(tl.int64) + four, eviction_policy="evict_last")
            else:
                v = tl.load(table_ptr + 4 * piece.to(tl.int64) + four)
            src = tl.sum(tl.where(four == 0, v, 0), axis=0)
            dst = tl.sum(tl.where(four == 1, v, 0), axis=0)
            count = tl.sum(tl.where(four == 2, v, 0), axis=0)
        else:
            row = table_ptr + 3 * piece.to(tl.int64)
            if HINT == 2:
                src = tl.load(row, eviction_policy="evict_last")
                dst = tl.load(row + 1, eviction_policy="evict_last")
                count = tl.load(row + 2, eviction_policy="evict_last")
            else:
                src = tl.load(row)
                dst = tl.load(row + 1)
                count = tl.load(row + 2)
        start = tl.program_id(0).to(tl.int64) * BLOCK
        lanes = start + tl.arange(0, BLOCK)
        s = tl.max_contiguous(tl.multiple_of(src + lanes, 2), BLOCK)
        d = tl.max_contiguous(tl.multiple_of(dst + lanes, 2), BLOCK)
        if UNIFORM or start + BLOCK <= count:
            if HINT == 1:
                tl.store(words + d, tl.load(words + s, cache_modifier=".cg"), cache_modifier=".cs")
            elif HINT == 2:
                tl.store(
                    words + d,
                    tl.load(words + s, eviction_policy="evict_first"),
                    eviction_policy="evict_first",
                )
            else:
                tl.store(words + d, tl.load(words + s))
        elif start < count:
            mask = lanes < count
            tl.store(words + dst + lanes, tl.load(words + src + lanes, mask=mask), mask=mask)


@triton.jit  # type: ignore[untyped-decorator,misc]
def copy_flat(src, dst, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs))


def device_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """Median device seconds (CUDA events around the call), after two warm-ups; wall seconds of one call
    without CUDA (the interpreter's check)."""
    if not torch.cuda.is_available():
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--cases", type=int, nargs="*", default=[256, 1024, 4096, 16384], help="KiB")
    parser.add_argument("--layouts", nargs="*", default=["contiguous", "transfer"])
    parser.add_argument("--shapes", nargs="*", default=["512x4", "1024x4", "1024x8", "256x2"])
    parser.add_argument("--hints", type=int, nargs="*", default=[0, 1, 2])
    parser.add_argument("--vec", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--uniform", type=int, nargs="*", default=[0, 1])
    parser.add_argument("--tables", nargs="*", default=["device"], help="device, pinned")
    parser.add_argument("--burst", type=int, default=1, help="launches between the events (kernel time only)")
    parser.add_argument(
        "--library",
        action="store_true",
        help="also time kvferry.kernels.span_copy's copy_spans, copy_fragments and copy_indexed (same pages)",
    )
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument(
        "--device", default="cuda", help="cpu: a check of the variants under TRITON_INTERPRET=1"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    total = args.mib << 20
    # one allocation for both sides: the kernel's words count from its start
    both = torch.zeros(2 * total, dtype=torch.uint8, device=args.device)
    src8, dst8 = both[:total], both[total:]
    src8.random_(0, 256)
    base = both.view(torch.int64)
    src64, dst64 = src8.view(torch.int64), dst8.view(torch.int64)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []

    def ceilings() -> tuple[float, float]:
        def copy() -> None:
            for _ in range(args.burst):
                dst8.copy_(src8)

        def flat() -> None:
            for _ in range(args.burst):
                copy_flat[(total // 4096,)](src64, dst64, BLOCK=512, num_warps=4)

        return (
            device_seconds(copy, args.repeat) / args.burst,
            device_seconds(flat, args.repeat) / args.burst,
        )

    def measured(fn: Callable[[], Any], **fields: Any) -> tuple[float, float, float]:
        """Seconds per launch of ``fn`` and of both ceilings (timed right after it), recorded as a row."""
        seconds = device_seconds(fn, args.repeat) / args.burst
        copy, flat = ceilings()
        rows.append(
            {
                **fields,
                "burst": args.burst,
                "device_s": seconds,
                "copy_s": copy,
                "flat_s": flat,
                "ratio_copy": copy / seconds,
                "ratio_flat": flat / seconds,
            }
        )
        return seconds, copy, flat

    for case, layout in itertools.product(args.cases, args.layouts):
        length = case << 10
        n = total // length
        order = np.arange(n) if layout == "contiguous" else rng.permutation(n)
        s_words = np.arange(n, dtype=np.int64) * length // 8
        d_words = (total + order.astype(np.int64) * length) // 8
        if args.library and torch.cuda.is_available():
            # the library's own launch (table built, uploaded and launched per call), in bursts like the rest
            spans = (
                (both.data_ptr() + 8 * s_words).astype(np.uint64),
                (both.data_ptr() + 8 * d_words).astype(np.uint64),
                np.full(n, length, dtype=np.uint64),
            )

            fragments = (
                np.stack([spans[0], spans[2]], axis=1),
                np.stack([spans[1], spans[2]], axis=1),
            )

            def library(spans: tuple[Any, ...] = spans) -> None:
                keep: list[Any] = []
                for _ in range(args.burst):
                    span_copy.copy_spans(both.device, *spans, keep=keep)

            def library_fragments(fragments: tuple[Any, ...] = fragments) -> None:
                keep: list[Any] = []
                for _ in range(args.burst):
                    span_copy.copy_fragments(both.device, *fragments, keep=keep)

            # an indexed copy of the same pages (as a disaggregated writer's): row i copies page ids[i] of the
            # source to page ids[n + i] of the destination, its table built once, every launch passing the ids
            indexed = span_copy.indexed_table(
                both.device,
                np.arange(n),
                np.full(n, both.data_ptr()),
                np.full(n, length),
                n + np.arange(n),
                np.full(n, both.data_ptr() + total),
                np.full(n, length),
                np.full(n, length),
                ids=2 * n,
            )
            ids = np.concatenate([np.arange(n), order]).astype(np.int64)
            device_ids = torch.empty(2 * n, dtype=torch.int64, device=both.device)

            def library_indexed(ids: Any = ids, device_ids: Any = device_ids, table: Any = indexed) -> None:
                keep: list[Any] = []
                for _ in range(args.burst):
                    span_copy.copy_indexed(table, ids, keep=keep, device_ids=device_ids)

            # the rows as kvferry bench transfer's writer hands them to the kernel: its layout (runs permuted with
            # the fragment size as the seed), neighbouring runs merged where both sides are contiguous
            transfer_order = np.random.default_rng(length).permutation(n)
            starts = np.flatnonzero(np.diff(transfer_order, prepend=-2) != 1)
            runs = np.diff(starts, append=n).astype(np.uint64) * np.uint64(length)
            dst_runs = (both.data_ptr() + total + transfer_order[starts] * length).astype(np.uint64)
            merged = (np.stack([spans[0][starts], runs], axis=1), np.stack([dst_runs, runs], axis=1))

            def library_merged(merged: tuple[Any, ...] = merged) -> None:
                keep: list[Any] = []
                for _ in range(args.burst):
                    span_copy.copy_fragments(both.device, *merged, keep=keep)

            for kind, fn, expected_order in (
                ("library copy_spans", library, order),
                ("library copy_fragments", library_fragments, order),
                ("library copy_indexed", library_indexed, order),
                (f"library copy_fragments {len(starts)} rows, merged", library_merged, transfer_order),
            ):
                dst8.zero_()
                fn()
                torch.cuda.synchronize()
                landing = torch.from_numpy(expected_order).cuda()
                assert torch.equal(dst8.view(n, length)[landing], src8.view(n, length))
                seconds, copy, flat = measured(fn, case_kib=case, layout=layout, fragments=n, kind=kind)
                print(
                    f"{case:>6} KiB {layout:<10} {kind}: {seconds * 1e6:7.1f} us ratio {copy / seconds:.3f}"
                )
        table3 = np.stack([s_words, d_words, np.full(n, length // 8, dtype=np.int64)], axis=1)
        table4 = np.concatenate([table3, np.zeros((n, 1), dtype=np.int64)], axis=1)
        origin = both.data_ptr()
        absolute = np.stack(
            [origin + 8 * s_words, np.full(n, length), origin + 8 * d_words, np.full(n, length)], axis=1
        ).astype(np.int64)
        tables: dict[tuple[str, int], torch.Tensor] = {}
        for memory in args.tables:
            for vec, host in ((0, table3), (1, table4), (2, absolute)):
                held = torch.from_numpy(np.ascontiguousarray(host))
                if memory == "pinned" and torch.cuda.is_available():
                    tables[memory, vec] = held.pin_memory()
                else:
                    tables[memory, vec] = held.to(args.device)
        where = torch.from_numpy(order).to(args.device)  # piece i lands at destination run order[i]
        for memory, shape, hint, vec, uniform in itertools.product(
            args.tables, args.shapes, args.hints, args.vec, args.uniform
        ):
            block, warps = (int(v) for v in shape.split("x"))
            if (length // 8) % block:
                continue
            table = tables[memory, vec]

            def launch(
                table: torch.Tensor = table,
                block: int = block,
                warps: int = warps,
                hint: int = hint,
                vec: int = vec,
                uniform: int = uniform,
                n: int = n,
                blocks: int = length // 8 // block,
            ) -> None:
                for _ in range(args.burst):
                    grid_variant[(blocks, n)](
                        base, table, n, BLOCK=block, HINT=hint, VEC=vec, UNIFORM=uniform, num_warps=warps
                    )

            dst8.zero_()
            launch()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            placed = dst8.view(n, length)[where]
            assert torch.equal(placed, src8.view(n, length)), (
                f"variant {shape} {hint} {vec} {uniform} misplaced"
            )
            seconds, copy, flat = measured(
                launch,
                case_kib=case,
                layout=layout,
                fragments=n,
                block_words=block,
                warps=warps,
                hint=hint,
                vec=vec,
                uniform=uniform,
                table=memory,
            )
            print(
                f"{case:>6} KiB {layout:<10} {memory:<6} {shape:>7} hint {hint} vec {vec} uniform {uniform}: "
                f"{seconds * 1e6:7.1f} us copy_ {copy * 1e6:6.1f} flat {flat * 1e6:6.1f} "
                f"ratio {copy / seconds:.3f} / {flat / seconds:.3f}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
            json.dump({"gpu": gpu, "bytes": total, "repeat": args.repeat, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
