"""``kvferry bench transfer``: arguments are checked before anything runs, and ``--json`` is only JSON."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvferry.cli import main

BENCH = ["bench", "transfer", "--transport", "local", "--repeats", "1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--total-bytes", "0"], "--total-bytes: must be at least 1 byte"),
        (["--total-bytes=-1M"], "--total-bytes: not a byte count"),
        (["--total-bytes", "1x"], "--total-bytes: not a byte count"),
        (["--fragment-bytes", "0"], "--fragment-bytes: must be at least 1 byte"),
        (["--page-bytes", "0"], "--page-bytes: must be at least 1 byte"),
        (["--repeats", "0"], "--repeats: must be at least 1"),
    ],
)
def test_bad_numbers_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*BENCH, *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main([*BENCH, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvferry bench: error: ")
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # these hung forever in the gloo baseline, or printed NOT VERIFIED without a reason
        (
            ["--total-bytes", "1M", "--fragment-bytes", "3K"],
            "--fragment-bytes 3K does not divide --total-bytes 1M",
        ),
        (["--total-bytes", "1M", "--fragment-bytes", "3K", "--no-baselines"], "does not divide"),
        (["--total-bytes", "1M", "--fragment-bytes", "2M"], "--fragment-bytes 2M exceeds --total-bytes 1M"),
        # a million 1-byte fragments ran into the transfer deadline after minutes
        (["--total-bytes", "1M", "--fragment-bytes", "1"], "at most 65536 fit one write"),
        (
            ["--total-bytes", "1M", "--fragment-bytes", "256K", "--page-bytes", "48K"],
            "--page-bytes 48K does not",
        ),
        # 1T parses (it was "invalid _size value") and is refused for what it is
        (["--total-bytes", "1T", "--fragment-bytes", "1G"], "--total-bytes 1T needs about 3T of cpu memory"),
    ],
)
def test_sizes_that_do_not_tile_are_refused_up_front(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in _refused(capsys, *argv)


def test_outputs_are_checked_before_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing" / "out.json"
    assert "does not exist" in _refused(capsys, "--output", str(missing))
    assert "does not exist" in _refused(capsys, "--plot", str(tmp_path / "missing" / "plot.png"))
    assert "is a directory" in _refused(capsys, "--output", str(tmp_path))


def test_plot_without_matplotlib_names_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    line = _refused(capsys, "--plot", str(tmp_path / "plot.png"))
    assert "pip install 'kvferry[bench]'" in line


def test_device_cuda_without_cuda_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert "CUDA is not available" in _refused(capsys, "--device", "cuda")


def test_a_failed_verification_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvferry.tools.transfer_bench as bench

    row = {
        "kind": "write",
        "transport": "local",
        "fragment_bytes": 1 << 20,
        "page_bytes": 64 << 10,
        "bytes": 1 << 20,
        "fragments": 1,
        "seconds": 1.0,
        "gbps": 0.001,
        "ratio_contiguous": 1.0,
        "ratio_memcpy": 1.0,
        "verified": False,
    }

    async def fake(*args: Any, **kwargs: Any) -> dict[str, Any]:
        return {"config": {}, "rows": [row], "goal_fragments_1MiB_reach_0.8_of_contiguous": {}}

    monkeypatch.setattr(bench, "run_transfer_bench", fake)
    assert main([*BENCH, "--total-bytes", "1M", "--fragment-bytes", "1M", "--json"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rows"][0]["verified"] is False
    assert "sha256 differs" in captured.err


@pytest.mark.timeout(240)
@pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None, reason="needs the nixl extra")
def test_json_is_all_of_stdout_and_library_logs_go_to_stderr() -> None:
    """NIXL logs INFO lines to stdout (its own handler) and UCX prints warnings to fd 1 from C, in this process
    and in the peer process: with NIXL's INFO lines asked for, they all land on stderr."""
    env = {**os.environ, "NIXL_LOG_LEVEL": "INFO", "UCX_WARN_UNUSED_ENV_VARS": "y"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            *BENCH[:2],
            "--transport",
            "nixl",
            "--no-baselines",
            "--total-bytes",
            "256K",
            "--fragment-bytes",
            "256K",
            "--repeats",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=230,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)  # "Extra data" when a log line reaches stdout
    assert {r["kind"] for r in result["rows"]} >= {"write", "contiguous", "memcpy"}
    # this process's agent and the peer process's agent both logged, to stderr
    assert proc.stderr.count("Initialized NIXL agent") >= 2, proc.stderr[-3000:]


def test_a_plot_format_matplotlib_cannot_write_is_refused_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    # it ran the whole benchmark, then died in savefig with a traceback (ValueError: Format 'foo')
    line = _refused(
        capsys, "--total-bytes", "64K", "--fragment-bytes", "64K", "--plot", str(tmp_path / "p.foo")
    )
    assert "matplotlib cannot write .foo files" in line


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_output_that_cannot_be_written_keeps_the_result_and_says_why(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # a traceback (OSError: No space left on device) after the run, and the result was never printed
    argv = ["--total-bytes", "64K", "--fragment-bytes", "64K", "--no-baselines", "--json"]
    assert main([*BENCH, *argv, "--output", "/dev/full"]) == 2
    captured = capsys.readouterr()
    assert json.loads(captured.out)["rows"]
    assert captured.err.splitlines()[-1].startswith("kvferry bench: error: --output /dev/full: No space left")


def test_the_table_shows_sizes_below_a_kib() -> None:
    from kvferry.commands.bench import _table

    row = {
        "kind": "write",
        "transport": "local",
        "fragment_bytes": 512,
        "page_bytes": 1536,
        "bytes": 3072,
        "fragments": 6,
        "seconds": 1.0,
        "gbps": 0.001,
        "ratio_contiguous": 1.0,
        "ratio_memcpy": 1.0,
    }
    line = _table({"rows": [row], "goal_fragments_1MiB_reach_0.8_of_contiguous": {}}).splitlines()[1]
    assert line.split()[:5] == ["write", "local", "512", "1536", "6"]  # sizes below a KiB in bytes, not "0K"
    row.update(fragment_bytes=1 << 20, page_bytes=64 << 10)
    line = _table({"rows": [row], "goal_fragments_1MiB_reach_0.8_of_contiguous": {}}).splitlines()[1]
    assert line.split()[:4] == ["write", "local", "1M", "64K"]


def test_the_goal_line_says_when_nothing_was_judged() -> None:
    """With no fragment of 1 MiB or more the goal line said nothing at all after its colon."""
    from kvferry.commands.bench import _table

    table = _table({"rows": [], "goal_fragments_1MiB_reach_0.8_of_contiguous": {}})
    assert table.splitlines()[-1].endswith("not judged (no fragment size of 1 MiB or more was run)")
    table = _table({"rows": [], "goal_fragments_1MiB_reach_0.8_of_contiguous": {"local": True}})
    assert table.splitlines()[-1].endswith("local: met")
