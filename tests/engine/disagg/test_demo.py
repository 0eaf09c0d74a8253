"""``kvferry demo --json`` end to end (in one process over the local transport; two processes in the slow suite)."""

from __future__ import annotations

import json
import subprocess
import sys

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
    assert "aggregated reference" in proc.stderr  # progress goes to stderr
    return result


@pytest.mark.timeout(180)
@pytest.mark.parametrize(("transport", "ctx_tp", "gen_tp"), [("local", 1, 2), ("nixl", 2, 1)])
def test_demo_json(transport: str, ctx_tp: int, gen_tp: int) -> None:
    result = run_demo("--transport", transport, "--ctx-tp", str(ctx_tp), "--gen-tp", str(gen_tp))
    assert result["identical"] is True and result["mismatched_requests"] == []
    assert (result["transport"], result["ctx_tp"], result["gen_tp"]) == (transport, ctx_tp, gen_tp)
    assert isinstance(result["bytes_transferred"], int) and result["bytes_transferred"] > 0
    assert result["tokens_identical_without_draft_transfer"] is True


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
