"""``kvferry bench offload``: it runs (small sizes), its JSON carries every ratio against the same-run ceiling,
and what cannot work is refused up front in one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry.cli import main

BENCH = ["bench", "offload", "--repeat", "3", "--loop-bytes", "0"]


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main([*BENCH, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvferry bench: error: ")
    return lines[0]


def test_it_runs_and_its_json_holds_every_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "offload.json"
    assert main([*BENCH, "--sizes", "64K", "1M", "--page-kib", "16", "--json", "--output", str(out)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert json.loads(out.read_text()) == result
    assert result["config"]["device"] == "cpu" and result["config"]["repeat"] == 3
    rows = result["rows"]
    assert [r["target_bytes"] for r in rows] == [64 << 10, 1 << 20]
    for row in rows:
        assert row["verified"] is True and row["runs"] == 3
        assert row["pages"] >= 1 and row["draft_pages"] >= 1 and row["bytes"] > 0
        for kind in ("offload", "restore"):
            for figure in (f"{kind}_ratio", f"{kind}_copy_ratio", f"{kind}_gbps", f"ceiling_{kind}_gbps"):
                low, high = row[f"{figure}_spread"]
                assert row[figure] > 0 and low <= row[figure] <= high, figure
    assert set(result["goal_from_1MiB_reach_0.8_of_ceiling"]) == {"offload", "restore"}
    assert result["loop"] is None


def test_the_loop_is_measured_through_the_async_path(capsys: pytest.CaptureFixture[str]) -> None:
    from kvferry.tools.offload_bench import GOAL_GAP_MS, measure_loop

    loop = measure_loop(128 << 20, torch.device("cpu"), repeat=1)
    assert loop["preset"] == "nemotron-h-8b" and loop["bytes"] >= 64 << 20 and loop["runs"] == 1
    for name in ("offload", "restore", "idle"):
        assert loop[f"{name}_max_gap_ms"] >= loop[f"{name}_p99_gap_ms"] > 0
    assert loop["offload_s"] > 0 and loop["restore_s"] > 0 and loop["cold"]["offload_s"] > 0
    assert loop[f"goal_gaps_under_{GOAL_GAP_MS:g}ms"] is (loop["worst_gap_ms"] <= GOAL_GAP_MS)


def test_the_table_and_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "offload.png"
    assert main([*BENCH, "--sizes", "256K", "--page-kib", "16", "--plot", str(plot)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["request", "pages", "offload"]
    assert table[-1].startswith("goal (from 1 MiB, 0.8 of the ceiling): offload: not judged")
    assert plot.read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sizes", "1T"], "needs about"),
        (["--loop-bytes", "1T"], "needs about"),
    ],
)
def test_sizes_that_cannot_be_allocated_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _refused(capsys, *argv)


def test_bad_numbers_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--sizes", "0"], "--sizes: must be at least 1 byte"),
        (["--repeat", "0"], "--repeat: must be at least 1"),
        (["--page-kib", "0"], "--page-kib: must be at least 1"),
        (["--loop-bytes", "x"], "--loop-bytes: not a byte count"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*BENCH, *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_outputs_and_the_device_are_checked_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert "does not exist" in _refused(capsys, "--output", str(tmp_path / "missing" / "out.json"))
    assert "does not exist" in _refused(capsys, "--plot", str(tmp_path / "missing" / "plot.png"))
    if not torch.cuda.is_available():
        assert "CUDA is not available" in _refused(capsys, "--device", "cuda")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert "pip install 'kvferry[bench]'" in _refused(capsys, "--plot", str(tmp_path / "plot.png"))


def test_a_request_that_differs_after_its_moves_fails_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvferry.tools.offload_bench as bench

    real = bench.measure_size

    def corrupted(*args: Any, **kwargs: Any) -> dict[str, Any]:
        row = real(*args, **kwargs)
        row["verified"] = False
        return row

    monkeypatch.setattr(bench, "measure_size", corrupted)
    assert main([*BENCH, "--sizes", "64K", "--page-kib", "16"]) == 1
    captured = capsys.readouterr()
    assert "NOT VERIFIED" in captured.out and "differs after its offload and restore" in captured.err


def test_the_command_and_the_tool_share_their_default_sizes() -> None:
    from kvferry.commands.bench_offload import SIZES
    from kvferry.tools import offload_bench

    assert SIZES == offload_bench.SIZES == tuple(64 << (10 + 2 * i) for i in range(8))
    assert SIZES[0] == 64 << 10 and SIZES[-1] == 1 << 30
