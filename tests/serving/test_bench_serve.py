"""``kvferry bench serve``: small real runs in-process (aggregated, and disaggregated over the local transport)
and against a real HTTP server; the JSON's keys and figures add up, ``--check`` passes on a correct run and
fails (exit 1) when the offline model differs, ``--plot`` writes a PNG, and bad flags are one-line usage errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from kvferry.cli import main
from kvferry.tools.serve_bench import (
    JSON_KEYS,
    PASS_KEYS,
    LengthRange,
    make_requests,
    percentiles,
)
from tests.support.http_server import DTYPE, serving

REPO = Path(__file__).resolve().parents[2]
#: a small run: short prompts and outputs, float64 (the tiny model's fastest dtype on a CPU)
SMALL = ["--requests", "20", "--prompt-len", "4:24", "--output-len", "2:10", "--dtype", DTYPE, "--seed", "3"]
#: seconds a bench subprocess has (imports, engines, two passes, the offline reference)
PROCESS_DEADLINE = 240.0

pytestmark = pytest.mark.timeout(300)


def _run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    status = main(["bench", "serve", *argv])
    out = capsys.readouterr().out
    return status, json.loads(out)


async def _run_process(*argv: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with anyio.fail_after(PROCESS_DEADLINE):
        return await anyio.run_process(
            [sys.executable, "-m", "kvferry", "bench", "serve", *argv], check=False, env=env
        )


def _assert_pass_sane(figures: dict[str, Any], requests: int) -> None:
    assert tuple(figures) == PASS_KEYS
    assert figures["requests"] == requests
    assert figures["completed"] + figures["failed"] == requests
    assert sum(figures["errors"].values()) == figures["failed"]
    for key in ("ttft_ms", "itl_ms", "e2e_ms", "queue_ms", "transfer_ms"):
        p = figures[key]
        if p["samples"]:
            assert 0 <= p["p50"] <= p["p99"], (key, p)
    if figures["completed"]:
        assert figures["ttft_ms"]["samples"] == figures["completed"]
        assert figures["ttft_ms"]["p99"] <= figures["e2e_ms"]["p99"]
        assert figures["requests_per_second"] > 0 and figures["output_tokens_per_second"] > 0


def _expected_output_tokens(seed: int, count: int = 20) -> int:
    requests = make_requests(
        count, prompt_len=LengthRange(4, 24), output_len=LengthRange(2, 10), vocab_size=256, seed=seed
    )
    return sum(r.max_tokens for r in requests)


def test_aggregated_run_completes_with_offline_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    status, result = _run_cli(capsys, *SMALL, "--concurrency", "8", "--check", "--json")
    assert status == 0
    assert tuple(result) == JSON_KEYS
    assert list(result["passes"]) == ["aggregated"]
    figures = result["passes"]["aggregated"]
    _assert_pass_sane(figures, 20)
    assert figures["completed"] == 20 and figures["errors"] == {}
    # no stop tokens: every request ends after exactly its max_tokens
    assert figures["output_tokens"] == _expected_output_tokens(3)
    assert figures["queue_ms"]["samples"] == 20 and figures["transfer_ms"]["samples"] == 0
    assert figures["engine_steps"] > 0 and figures["model_step_ms_median"] > 0
    assert result["handoff"] is None
    assert result["check"] == {
        "passed": True,
        "requests": 20,
        "mismatched": {"aggregated": []},
        "unchecked": {"aggregated": []},
    }
    assert result["config"]["concurrency"] == 8 and result["config"]["rate"] is None


def test_open_loop_rate_and_a_missed_deadline_are_counted(capsys: pytest.CaptureFixture[str]) -> None:
    # a deadline no request can meet: each one is cancelled and counted, none hangs the run
    status, result = _run_cli(capsys, *SMALL, "--rate", "200", "--timeout", "0.0001", "--json")
    assert status == 0
    figures = result["passes"]["aggregated"]
    _assert_pass_sane(figures, 20)
    assert figures["errors"] == {"timeout": 20} and figures["completed"] == 0
    assert result["config"]["rate"] == 200 and result["config"]["concurrency"] is None


@pytest.mark.anyio
async def test_disaggregated_local_subprocess_judges_the_handoff_and_plots(tmp_path: Path) -> None:
    picture = tmp_path / "serve.png"
    argv = [*SMALL, "--concurrency", "4", "--disagg", "--transport", "local", "--check", "--json"]
    try:
        import matplotlib  # noqa: F401

        argv += ["--plot", str(picture)]
    except ImportError:
        picture = Path()
    done = await _run_process(*argv)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    result = json.loads(done.stdout)
    assert tuple(result) == JSON_KEYS
    assert list(result["passes"]) == ["aggregated", "disaggregated"]
    for figures in result["passes"].values():
        _assert_pass_sane(figures, 20)
        assert figures["completed"] == 20
        assert figures["output_tokens"] == _expected_output_tokens(3)
    # the service measures each disaggregated request's transfer; the aggregated pass has none
    assert result["passes"]["disaggregated"]["transfer_ms"]["samples"] == 20
    handoff = result["handoff"]
    assert handoff["requests"] == 20
    assert handoff["median_ms"] <= handoff["p99_ms"]
    assert handoff["model_step_ms_median"] > 0
    assert handoff["goal_ms"] == pytest.approx(handoff["model_step_ms_median"] + 2.0)
    assert handoff["goal_met"] == (handoff["median_ms"] <= handoff["goal_ms"])
    assert handoff["verdict"].startswith("met" if handoff["goal_met"] else "not met")
    assert result["check"]["passed"] and result["check"]["mismatched"] == {
        "aggregated": [],
        "disaggregated": [],
    }
    assert "local" in result["target"] and result["config"]["transport"] == "local"
    if picture != Path():
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.anyio
async def test_against_a_real_http_server(tmp_path: Path) -> None:
    async with serving(max_running=8) as served:
        done = await _run_process(*SMALL, "--url", served.url, "--concurrency", "6", "--check", "--json")
        assert done.returncode == 0, done.stderr.decode()[-3000:]
        result = json.loads(done.stdout)
        assert result["target"] == served.url and list(result["passes"]) == ["server"]
        figures = result["passes"]["server"]
        _assert_pass_sane(figures, 20)
        assert figures["completed"] == 20 and figures["output_tokens"] == _expected_output_tokens(3)
        # the client cannot see admission or the engine's steps
        assert figures["queue_ms"]["samples"] == 0 and figures["model_step_ms_median"] is None
        assert result["check"]["passed"]
        # the server saw the measured requests and the warm-up ones
        assert served.service.statistics().finished["length"] == 20 + result["config"]["warmup"]

        # an offline model with other weights than the server's: every request differs, exit 1; the table
        # names the failure and --output holds the JSON
        written = tmp_path / "result.json"
        few = ["--requests", "6", "--prompt-len", "4:24", "--output-len", "4:10", "--dtype", DTYPE]
        done = await _run_process(
            *few,
            "--url",
            served.url,
            "--weights-seed",
            "1",
            "--warmup",
            "0",
            "--check",
            "--output",
            str(written),
        )
        assert done.returncode == 1, done.stderr.decode()[-3000:]
        assert b"check FAILED: server: " in done.stdout
        check = json.loads(written.read_text())["check"]
        assert not check["passed"] and len(check["mismatched"]["server"]) >= 5


def test_an_unreachable_url_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        assert main(["bench", "serve", "--url", f"http://127.0.0.1:{port}", "--requests", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("kvferry bench: error: --url http://127.0.0.1:") and "cannot reach" in err[-1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--url", "http://127.0.0.1:1", "--tp", "2"], "--tp apply in-process only"),
        (["--url", "localhost:8000"], "give http://HOST:PORT"),
        (["--transport", "local"], "--transport only apply with --disagg"),
        (["--disagg", "--tp", "2"], "instead of --tp"),
        (["--disagg", "--transport", "local", "--ctx-tp", "3"], "--ctx-tp 3: 8 heads do not split"),
        (["--num-pages", "4", "--prompt-len", "64"], "RequestTooLarge"),
        (["--plot", "/nonexistent-dir/x.png"], "does not exist"),
    ],
)
def test_bad_flags_are_one_line_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "serve", "--requests", "2", "--dtype", DTYPE, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith("kvferry bench: error: ") and message in last, captured.err
    assert "Traceback" not in captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt-len", "0:5"], "lengths must be at least 1"),
        (["--prompt-len", "9:3"], "is empty"),
        (["--output-len", "a"], "not a length or a range"),
        (["--concurrency", "2", "--rate", "3"], "not allowed with argument"),
        (["--rate", "0"], "must be a positive finite number"),
        (["--timeout", "inf"], "must be a positive finite number"),
    ],
)
def test_bad_numbers_are_argparse_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "serve", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_requests_follow_the_seed_alone() -> None:
    def build(seed: int, rate: float | None) -> list[Any]:
        return make_requests(
            50, prompt_len=LengthRange(3, 9), output_len=LengthRange(5, 5), vocab_size=7, seed=seed, rate=rate
        )

    closed, open_loop = build(1, None), build(1, 4.0)
    # prompts and lengths do not depend on the load; arrivals only exist for a rate, in order, from 0
    assert [(r.prompt_ids, r.max_tokens) for r in closed] == [(r.prompt_ids, r.max_tokens) for r in open_loop]
    assert all(r.arrival is None for r in closed)
    arrivals = [r.arrival for r in open_loop]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert build(1, 4.0) == open_loop and build(2, 4.0) != open_loop
    assert all(3 <= len(r.prompt_ids) <= 9 and r.max_tokens == 5 for r in closed)
    assert all(0 <= t < 7 for r in closed for t in r.prompt_ids)
    assert [r.index for r in closed] == list(range(50))


def test_percentiles_are_nearest_rank_and_ordered() -> None:
    values = [float(v) for v in range(1, 101)]
    p = percentiles(values, scale=1.0)
    assert (p["p50"], p["p99"], p["samples"]) == (50.0, 99.0, 100)
    assert percentiles([0.002], scale=1e3)["p99"] == pytest.approx(2.0)
    assert percentiles([]) == {"p50": None, "p99": None, "mean": None, "samples": 0}
