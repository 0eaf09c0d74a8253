"""Transport writes between two processes, per transport and fragment size, against one contiguous write of the
same bytes and a memcpy in the same run (the ceilings): ``kvferry bench transfer`` run ``--repeat`` times.

Each run is ``kvferry bench transfer`` with the other flags given (see ``kvferry bench transfer --help``): the
source passed as one fragment per page, pages in runs of ``--fragment-bytes`` contiguous on both sides and
landing at permuted destinations, every point verified by sha256 at the receiver; each row the median of the
run's ``--repeats`` timed writes. Per row: ``kind`` (``write``, or a baseline: ``contiguous``, ``memcpy``,
``nixl-per-page``, ``gloo``), ``gbps``, ``ratio_contiguous`` (the contiguous write's seconds over the row's)
and ``ratio_memcpy`` (``ratio_device_copy`` with ``--device cuda``: a copy of the same bytes in one process,
timed alternately with the row's writes): the median over the runs, ``_spread`` their ``[min, max]``.

    python benchmarks/transfer.py [--repeat 3] [--json benchmarks/results/<machine>/transfer.json]
        [--plot FILE.png] [--transport nixl|ucx|local|all] [--device cpu|cuda] [--total-bytes 64M]
        [--fragment-bytes 64K 1M 16M] [--page-bytes 64K] [--repeats 5] [--no-baselines]

``--repeat``: whole runs (median and spread over them); ``--repeats``: timed writes per point within a run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from _provenance import median_spread, write_result

#: the figures of a row summarised over the runs
FIGURES = (
    "seconds",
    "gbps",
    "ratio_contiguous",
    "ratio_memcpy",
    "ratio_device_copy",
    "contiguous_seconds",
    "memcpy_seconds",
)
#: what names a row across runs
KEY = ("kind", "transport", "fragment_bytes", "page_bytes")


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs' rows as one row per point: each figure's median over the runs and its ``[min, max]``."""
    points: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for run in runs:
        for row in run["rows"]:
            points.setdefault(tuple(row[k] for k in KEY), []).append(row)
    out = []
    for rows in points.values():
        row = {k: v for k, v in rows[0].items() if k not in FIGURES}
        row["runs"] = len(rows)
        for figure in (f for f in FIGURES if f in rows[0]):
            values = [r[figure] for r in rows if r.get(figure) is not None]
            if values:
                row[figure], row[f"{figure}_spread"] = median_spread(values)
            else:
                row[figure] = None
        if "verified" in rows[0]:
            row["verified"] = all(r.get("verified", True) for r in rows)
        out.append(row)
    return out


def goal(rows: list[dict[str, Any]], ceiling: str = "ratio_contiguous") -> dict[str, bool]:
    """Per transport, whether every write of 1 MiB fragments or more reaches 0.8 of ``ceiling`` (the medians over
    the runs): the contiguous write (``kvferry bench transfer``'s goal; the local transport left out) or the
    same-run copy (``ratio_memcpy`` / ``ratio_device_copy``, every transport)."""
    writes = [
        r
        for r in rows
        if r["kind"] == "write" and (r["transport"] != "local" or ceiling != "ratio_contiguous")
    ]
    return {
        name: all(
            (r.get(ceiling) or 0.0) >= 0.8
            for r in writes
            if r["transport"] == name and r["fragment_bytes"] >= 1 << 20
        )
        for name in dict.fromkeys(r["transport"] for r in writes)
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--repeat", type=int, default=3, help="whole runs (median and spread over them)")
    parser.add_argument("--json", default=None, help="write the stamped result here")
    parser.add_argument("--plot", default=None, help="draw the medians into this PNG (matplotlib)")
    args, rest = parser.parse_known_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    if {"--output", "--json"} & {a.split("=")[0] for a in rest}:
        parser.error("--output is this script's --json PATH")
    runs = []
    # each run in a process of its own, as the command runs: no transport state carries over between runs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.repeat):
            path = os.path.join(scratch, f"run{i}.json")
            command = [sys.executable, "-m", "kvferry", "bench", "transfer", *rest, "--output", path]
            code = subprocess.run(command, env=env, check=False).returncode
            if code:
                return code
            with open(path) as f:
                runs.append(json.load(f))
    rows = summarise(runs)
    config = {
        **runs[0]["config"],
        "runs": args.repeat,
        "statistic": "per run the median seconds of --repeats writes; the median and [min, max] over --repeat "
        "runs",
        "ceiling": "contiguous: one write of the same bytes by the same transport; memcpy: a torch copy of "
        "the same bytes in one process",
    }
    config.pop("host", None)  # the provenance says what ran it
    copy = "ratio_memcpy" if config.get("device", "cpu") == "cpu" else "ratio_device_copy"
    result = {
        "config": config,
        "results": rows,
        "goal_fragments_1MiB_reach_0.8_of_contiguous": goal(rows),
        f"goal_fragments_1MiB_reach_0.8_of_{copy[len('ratio_') :]}": goal(rows, copy),
    }
    nan = [float("nan")] * 2
    for row in rows:
        if row["kind"] in ("write", "contiguous"):
            spread = row.get("ratio_contiguous_spread") or nan
            copied = row.get(f"{copy}_spread") or nan
            print(
                f"{row['transport']:>5} {row['kind']:>10} {row['fragment_bytes'] >> 10:>8} KiB: "
                f"{row['gbps']:.2f} GB/s, {row['ratio_contiguous']:.2f} of contiguous ({spread[0]:.2f}-"
                f"{spread[1]:.2f}), {row[copy]:.2f} of {copy[len('ratio_') :]} ({copied[0]:.2f}-{copied[1]:.2f}) "
                f"over {row['runs']} runs"
            )
    if args.json:
        write_result(args.json, "transfer", result, config.get("device", "cpu"))
    if args.plot:
        from kvferry.tools.transfer_bench import plot

        plot({"config": config, "rows": rows}, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
