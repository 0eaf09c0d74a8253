"""Does the CUDA runtime's batched copy (``cudaMemcpyBatchAsync``, CUDA 12.8+) move scattered device fragments
faster than the batched span copy? (On the H200: no. It moved 1 MiB fragments at 0.13 of ``copy_``, about
3.7 us per fragment, by the copy engines one after the other: ``benchmarks/results/batch_memcpy_h200.json``.)
One process, one GPU: ``--total-mib`` cut into fragments of each size,
copied to permuted slots, against one ``copy_`` of the same bytes, in the same run (device time by CUDA events,
wall time including the host's preparation). Bytes are verified.

    python benchmarks/batch_memcpy_probe.py --json $OUT/batch_memcpy_h200.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvferry.kernels import span_copy

sys.path.insert(0, str(Path(__file__).parent))
from span_copy import timed

MiB = 1 << 20


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location", _Location),
        ("dst_location", _Location),
        ("flags", ctypes.c_uint),
    ]


def _runtime() -> ctypes.CDLL:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise RuntimeError("libcudart is not loaded")
    return ctypes.CDLL(sorted(paths)[0])


def batch_copier(device: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], None]:
    lib = _runtime()
    version = ctypes.c_int()
    lib.cudaRuntimeGetVersion(ctypes.byref(version))
    attributes = _Attributes(1, _Location(1, device), _Location(1, device), 0)  # order: stream; device memory
    index = (ctypes.c_size_t * 1)(0)
    failed = ctypes.c_size_t()
    function = lib.cudaMemcpyBatchAsync

    def copy(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        args: list[Any] = [
            ctypes.c_void_p(dst.ctypes.data),
            ctypes.c_void_p(src.ctypes.data),
            ctypes.c_void_p(sizes.ctypes.data),
            ctypes.c_size_t(len(sizes)),
            ctypes.byref(attributes),
            index,
            ctypes.c_size_t(1),
        ]
        if version.value < 13000:
            args.append(ctypes.byref(failed))
        status = function(*args, stream)
        if status != 0:
            raise RuntimeError(f"cudaMemcpyBatchAsync failed with status {status} (runtime {version.value})")

    return copy


def _on(stream: Any, fn: Callable[[], Any]) -> None:
    current = torch.cuda.current_stream()
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        fn()
    current.wait_stream(stream)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--fragment-kib", type=int, nargs="*", default=[64, 256, 1024, 4096, 16384])
    parser.add_argument("--repeat", type=int, default=11)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    total = args.total_mib * MiB
    src = torch.randint(0, 256, (total,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(total, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    wall, device = timed(lambda: dst.copy_(src), args.repeat)
    out["rows"].append(
        {"kind": "copy_", "fragment_kib": args.total_mib * 1024, "wall_s": wall, "device_s": device}
    )
    print(f"copy_ {args.total_mib} MiB: {device * 1e3:.3f} ms device, {wall * 1e3:.3f} ms wall", flush=True)
    copier = batch_copier(torch.cuda.current_device())
    side = torch.cuda.Stream()  # the batched copy refuses the legacy default stream
    side.wait_stream(torch.cuda.current_stream())
    for kib in args.fragment_kib:
        n = total // (kib << 10)
        order = np.random.default_rng(kib).permutation(n)
        size = kib << 10
        src_addr = (src.data_ptr() + np.arange(n, dtype=np.uint64) * size).astype(np.uint64)
        dst_addr = (dst.data_ptr() + order.astype(np.uint64) * size).astype(np.uint64)
        sizes = np.full(n, size, dtype=np.uint64)
        expected = src.view(n, size)
        spans = (src_addr, dst_addr, sizes)
        for kind, fn in (
            ("batch", partial(_on, side, partial(copier, dst_addr, src_addr, sizes))),
            ("spans", partial(span_copy.copy_spans, src.device, *spans)),
        ):
            dst.zero_()
            try:
                wall, dev = timed(fn, args.repeat)
            except Exception as exc:
                print(f"{kind} {kib} KiB: {exc}", flush=True)
                out["rows"].append({"kind": kind, "fragment_kib": kib, "error": str(exc)})
                continue
            ok = bool(torch.equal(dst.view(n, size)[torch.from_numpy(order).cuda()], expected))
            row = {"kind": kind, "fragment_kib": kib, "wall_s": wall, "device_s": dev, "verified": ok}
            row["ratio_device"] = device / dev
            out["rows"].append(row)
            print(
                f"{kind} {kib} KiB x {n}: {dev * 1e3:.3f} ms device ({device / dev:.2f} of copy_), "
                f"{wall * 1e3:.3f} ms wall, verified {ok}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
