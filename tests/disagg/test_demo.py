"""``kvferry demo --json`` end to end (in one process over the local transport; two processes in the slow suite)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvferry.commands.demo import JSON_KEYS


def run_demo(*args: str) -> dict[str, object]:
    proc = subprocess.run(
        [sys.executable, "-m", "kvferry", "demo", "--json", "--requests", "2", "--max-tokens", "4", *args],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout)  # stdout is exactly one JSON object, no log lines
    assert tuple(result) == JSON_KEYS
    # progress goes to stderr, to the end of every pass
    n = result["requests"]
    assert f"aggregated reference: {n}/{n}" in proc.stderr
    assert (
        f"disaggregated, with{'out' if not result['draft_transfer'] else ''} draft KV transfer: {n}/{n}"
        in proc.stderr
    )
    return result


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("transport", "ctx_tp", "gen_tp"), [("local", 1, 2), ("nixl", 2, 1)])
def test_demo_json(transport: str, ctx_tp: int, gen_tp: int) -> None:
    result = run_demo("--transport", transport, "--ctx-tp", str(ctx_tp), "--gen-tp", str(gen_tp))
    assert result["identical"] is True and result["mismatched_requests"] == []
    assert (result["transport"], result["ctx_tp"], result["gen_tp"]) == (transport, ctx_tp, gen_tp)
    assert isinstance(result["bytes_transferred"], int) and result["bytes_transferred"] > 0
    assert result["tokens_identical_without_draft_transfer"] is True
    # per request: what moved and how long the hand-off took (not bytes over idle wall time)
    assert isinstance(result["bytes_per_request"], float) and result["bytes_per_request"] > 0
    median, p99 = result["handoff_ms_median"], result["handoff_ms_p99"]
    assert isinstance(median, float) and isinstance(p99, float) and 0 < median <= p99
    assert "transfer_gbps" not in result


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "transport",
    ["local", pytest.param("nixl", marks=pytest.mark.slow)],  # nixl: two OS processes
)
def test_demo_defaults_show_the_acceptance_lost_without_draft_kv(transport: str) -> None:
    """The oracle of the draft KV transfer: on the default prompts, leaving the prompt's draft KV behind
    lowers the acceptance rate clearly, and the tokens stay identical."""
    result = run_demo("--transport", transport, "--requests", "8", "--max-tokens", "12")  # the defaults
    assert result["identical"] is True and result["tokens_identical_without_draft_transfer"] is True
    rate, without = result["acceptance_rate"], result["acceptance_rate_without_draft_transfer"]
    assert isinstance(rate, float) and isinstance(without, float)
    assert 0.2 <= rate <= 0.9, rate  # accepted and rejected drafts both happen
    assert 0 < without <= rate - 0.05, (rate, without)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["nixl", "ucx"])
@pytest.mark.parametrize(("ctx_tp", "gen_tp"), [(1, 1), (1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)])
def test_demo_two_processes(transport: str, ctx_tp: int, gen_tp: int) -> None:
    result = run_demo("--transport", transport, "--ctx-tp", str(ctx_tp), "--gen-tp", str(gen_tp))
    assert result["identical"] is True
    assert result["transport"] == transport


@pytest.mark.timeout(400)
@pytest.mark.parametrize(
    ("transport", "ctx_tp", "gen_tp"),
    [
        ("local", 2, 1),
        # the whole matrix: two OS processes each
        pytest.param("nixl", 1, 2, marks=pytest.mark.slow),
        pytest.param("ucx", 2, 1, marks=pytest.mark.slow),
    ],
)
def test_demo_serves_200_requests_at_once(transport: str, ctx_tp: int, gen_tp: int) -> None:
    """Every request in flight at once, far above the generation engine's 16 batch rows: the engines queue what
    they cannot run yet (admission on both sides), nothing fails, and every request is identical."""
    if (
        transport != "local"
        and importlib.util.find_spec("nixl_cu13" if transport == "nixl" else "ucxx") is None
    ):
        pytest.skip(f"the {transport} extra is not installed")
    tp = ["--ctx-tp", str(ctx_tp), "--gen-tp", str(gen_tp)]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvferry",
            "demo",
            "--json",
            "--requests",
            "200",
            "--transport",
            transport,
            *tp,
        ],
        capture_output=True,
        text=True,
        timeout=390,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["requests"] == 200 and result["identical"] is True and result["mismatched_requests"] == []
    assert result["tokens_identical_without_draft_transfer"] is True


# --- what the demo judges and reports ----------------------------------------------------------------------


def demo_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    from kvferry.cli import main

    code = main(["demo", "--json", "--transport", "local", "--requests", "2", "--max-tokens", "4", *args])
    captured = capsys.readouterr()
    return code, json.loads(captured.out), captured.err


@pytest.mark.timeout(180)
def test_no_draft_transfer_judges_the_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """Without the draft KV the drafter starts from zeros: its proposals differ by design, the tokens must not.
    This exited 1 ("identical to aggregated NO") although the tokens were identical."""
    code, result, _ = demo_in_process(capsys, "--no-draft-transfer")
    assert result["draft_transfer"] is False and result["tokens_identical_without_draft_transfer"] is True
    assert result["identical"] is True and result["mismatched_requests"] == []
    assert code == 0


@pytest.mark.timeout(180)
def test_the_context_engine_on_a_device_of_its_own_gives_the_same_tokens(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--ctx-device`` places the context engine; on this host both are the CPU (two GPUs: tests/e2e)."""
    code, result, _ = demo_in_process(capsys, "--ctx-device", "cpu", "--spec-k", "0")
    assert code == 0 and result["identical"] is True and result["mismatched_requests"] == []


@pytest.mark.timeout(180)
def test_no_speculation_has_no_acceptance_rate(capsys: pytest.CaptureFixture[str]) -> None:
    code, result, _ = demo_in_process(capsys, "--spec-k", "0")
    assert code == 0 and result["identical"] is True and result["spec_k"] == 0
    assert result["acceptance_rate"] is None and result["acceptance_rate_without_draft_transfer"] is None
    assert result["draft_transfer"] is False  # no drafter runs, so no draft KV travels


def test_a_typed_failure_is_one_line_and_exit_3(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvferry.commands.demo as demo
    from kvferry.cli import main
    from kvferry.errors import PeerDisconnected

    async def fail(*args: object) -> dict[str, Any]:
        raise ExceptionGroup(
            "tasks", [PeerDisconnected("the context process exited"), PeerDisconnected("echo")]
        )

    monkeypatch.setattr(demo, "_disaggregated", fail)
    assert main(["demo", "--transport", "local", "--requests", "1", "--max-tokens", "2"]) == 3
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err.splitlines()[-1] == "kvferry demo: error: the context process exited (PeerDisconnected)"
    )
    assert "Traceback" not in captured.err and "ExceptionGroup" not in captured.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gen-tp", "3"], "error: --gen-tp 3: 8 heads do not split evenly over tp_size 3"),
        (["--ctx-tp", "16"], "error: --ctx-tp 16: Mamba2 num_heads 8 < tp_size 16"),
        (["--requests", "0"], "argument --requests: must be at least 1, got 0"),
        (["--ctx-tp", "0"], "argument --ctx-tp: must be at least 1, got 0"),
        (["--max-tokens", "1"], "argument --max-tokens: must be at least 2"),
        (["--seed", "-1"], "argument --seed: a seed is an int in [0, 2**62), got -1"),
        (["--spec-k", "-1"], "argument --spec-k: must not be negative"),
        (["--ctx-device", "gpu"], "error: --ctx-device 'gpu': expected cpu, cuda or cuda:N"),
        (["--ctx-device", "cuda:64"], "error: --ctx-device cuda:64: "),  # no GPU, or fewer than 65
    ],
)
def test_bad_arguments_name_their_flag_before_anything_runs(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvferry.cli import main

    try:
        code = main(["demo", "--transport", "local", *args])
    except SystemExit as exc:  # argparse
        code = int(str(exc.code))
    err = capsys.readouterr().err
    assert code == 2
    assert message in err.splitlines()[-1]
    assert "aggregated reference" not in err  # nothing ran (--gen-tp 3 failed after 18 s)


@pytest.mark.timeout(240)
def test_without_a_cross_process_transport_auto_runs_the_context_engine_here(tmp_path: Path) -> None:
    """A base install (no nixl, no ucx extra): auto picked local across two processes and failed with a
    traceback; it runs the context engine in this process instead, and says so. Asking for nixl names the
    extra in one line."""
    for name in ("nixl_cu13", "ucxx"):
        (tmp_path / f"{name}.py").write_text("raise ImportError('not installed (test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    argv = [sys.executable, "-m", "kvferry", "demo", "--json", "--requests", "1", "--max-tokens", "3"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=230, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["transport"] == "local" and result["identical"] is True
    assert "pip install 'kvferry[nixl]' or 'kvferry[ucx]'" in proc.stderr
    assert "context engine (TP 1, this process)" in proc.stderr
    proc = subprocess.run(
        [*argv, "--transport", "nixl"], capture_output=True, text=True, timeout=230, env=env, check=False
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "kvferry demo: error: nixl_cu13 is not installed: pip install 'kvferry[nixl]' (MissingExtraError)"
    ]


@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("nixl_cu13") is None, reason="needs the nixl extra")
def test_ctrl_c_ends_the_demo_and_its_context_process() -> None:
    """Ctrl-C during a run with many requests ends it at once with 130, and the context engine's process is
    gone."""
    argv = [
        sys.executable,
        "-m",
        "kvferry",
        "demo",
        "--transport",
        "nixl",
        "--requests",
        "24",
        "--spec-k",
        "0",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    pid = None
    seen = []
    for line in proc.stderr:
        seen.append(line)
        match = re.search(r"context engine pid (\d+)", line)
        if match:
            pid = int(match.group(1))
            break
    assert pid is not None, "".join(seen)
    proc.send_signal(signal.SIGINT)  # mid-pass: 24 requests are being served
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        os.kill(pid, signal.SIGKILL)
        raise
    assert proc.returncode == 130, err[-3000:]
    assert out == "" and err.strip().splitlines()[-1] == "kvferry demo: interrupted"
    assert "Traceback" not in err
    # the context engine's process ended too (waited for by the demo: no zombie, no orphan)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# --- KimiLinear (tiny-kimi: KDA state and MLA latent pages move between TP sizes) ---------------------------

KIMI_PAIRS = [(c, g) for c in (1, 2, 4) for g in (1, 2, 4)]


def run_kimi_demo(transport: str, ctx_tp: int, gen_tp: int, *args: str) -> dict[str, object]:
    argv = ["demo", "--json", "--requests", "2", "--max-tokens", "4", "--model", "tiny-kimi"]
    argv += ["--transport", transport, "--ctx-tp", str(ctx_tp), "--gen-tp", str(gen_tp), *args]
    proc = subprocess.run(
        [sys.executable, "-m", "kvferry", *argv],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, object] = json.loads(proc.stdout)
    assert tuple(result) == JSON_KEYS
    assert result["identical"] is True and result["mismatched_requests"] == []
    assert (result["transport"], result["ctx_tp"], result["gen_tp"]) == (transport, ctx_tp, gen_tp)
    assert isinstance(result["bytes_transferred"], int) and result["bytes_transferred"] > 0
    return result


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("transport", "ctx_tp", "gen_tp"),
    [
        ("local", 1, 2),
        ("local", 4, 2),
        ("nixl", 2, 1),  # two OS processes
        pytest.param("ucx", 1, 4, marks=pytest.mark.slow),
    ],
)
def test_kimi_demo_with_and_without_draft_kv(transport: str, ctx_tp: int, gen_tp: int) -> None:
    """tiny-kimi disaggregated across a TP mismatch: tokens and draft proposals equal aggregated serving's when
    the draft KV travels, and the tokens still do in the pass that leaves it behind."""
    result = run_kimi_demo(transport, ctx_tp, gen_tp)
    assert result["draft_transfer"] is True and result["tokens_identical_without_draft_transfer"] is True


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    ("transport", "ctx_tp", "gen_tp", "flag"),
    [
        ("local", 2, 4, "--no-draft-transfer"),
        ("local", 4, 1, "--spec-k=0"),
        pytest.param("nixl", 4, 1, "--spec-k=0", marks=pytest.mark.slow),
        pytest.param("ucx", 2, 4, "--no-draft-transfer", marks=pytest.mark.slow),
    ],
)
def test_kimi_demo_without_draft_kv(transport: str, ctx_tp: int, gen_tp: int, flag: str) -> None:
    """The draft KV left behind (its pass's tokens judged) or no speculation at all (no draft KV exists): the
    latent pages and the KDA state are the whole transfer, and the tokens are aggregated serving's."""
    result = run_kimi_demo(transport, ctx_tp, gen_tp, flag)
    assert result["draft_transfer"] is False
    assert result["spec_k"] == (0 if flag == "--spec-k=0" else 2)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("transport", ["nixl", "ucx"])
@pytest.mark.parametrize(("ctx_tp", "gen_tp"), KIMI_PAIRS)
def test_kimi_demo_two_processes(transport: str, ctx_tp: int, gen_tp: int) -> None:
    result = run_kimi_demo(transport, ctx_tp, gen_tp)
    assert result["tokens_identical_without_draft_transfer"] is True
