"""``kvferry bench decode``: a small run on the CPU with ``tiny`` (every field, positive ratios), and what
cannot work refused up front in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvferry.cli import main

SMALL = [
    "bench",
    "decode",
    "--device",
    "cpu",
    "--model",
    "tiny",
    "--batch",
    "1",
    "2",
    "--prompt-tokens",
    "16",
    "--new-tokens",
    "4",
    "--repeat",
    "1",
    "--prefill-tokens",
    "64",
    "--max-prefill-chunk",
    "16",
]


def test_a_small_run_writes_every_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "decode.json"
    assert main([*SMALL, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "roofline" in table and "prefill of 64 tokens" in table
    result = json.loads(out.read_text())
    config = result["config"]
    assert config["device"] == "cpu" and config["model"] == "tiny" and config["batches"] == [1, 2]
    assert config["parameters"] > 0 and "pure decode steps" in config["timing"]
    assert result["torch"] == torch.__version__ and result["commit"]
    assert result["hardware"]["cpu"]
    assert result["ceilings"]["copy_gbps"] > 0 and result["ceilings"]["matmul_tflops"] > 0
    rows = result["rows"]
    assert [r["batch"] for r in rows] == [1, 2]
    for row in rows:
        assert row["runs"] == 1 and row["decode_steps"] >= 1
        for name in ("tokens_per_s", "ms_per_step", "roofline_ratio", "e2e_tokens_per_s", "hf_tokens_per_s"):
            assert row[name] > 0, name
        for name in ("tokens_per_s", "ms_per_step", "roofline_ratio"):
            low, high = row[f"{name}_spread"]
            assert low <= row[name] <= high
        assert row["vs_transformers"] == pytest.approx(row["e2e_tokens_per_s"] / row["hf_tokens_per_s"])
        assert row["roofline_ms"] > 0 and set(row["roofline_bytes"]) == {"weights", "kv", "state", "logits"}
        assert row["tokens_per_s"] == pytest.approx(row["batch"] / (row["ms_per_step"] / 1e3), rel=0.5)
    # a bigger batch reads more KV, state and logits; the weights are read once whatever the batch
    small, big = (r["roofline_bytes"] for r in rows)
    assert big["kv"] > small["kv"] and big["state"] > small["state"] and big["logits"] > small["logits"]
    prefill = result["prefill"]
    assert prefill["tokens"] == 64 and prefill["chunk"] == 16
    assert prefill["prefill_tokens_per_s"] > 0 and prefill["prefill_ratio"] > 0
    assert prefill["flops_per_token"] > 0


def test_transformers_can_be_left_out(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    argv = [*SMALL, "--batch", "1", "--prefill-tokens", "0", "--no-transformers", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert "hf_tokens_per_s" not in result["rows"][0] and result["prefill"] is None


def test_the_decode_path_and_the_launch_can_be_chosen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "decode.json"
    argv = [*SMALL, "--prefill-tokens", "0", "--no-transformers", "--json", str(out)]
    assert main([*argv, "--decode-graphs", "on", "--launch-on-loop", "on"]) == 0
    assert "decode path on, steps launched from the loop" in capsys.readouterr().out
    config = json.loads(out.read_text())["config"]
    assert config["decode_graphs"] is True and config["launch_on_loop"] is True
    assert main(argv) == 0  # the CPU's defaults: the general step, in a worker thread
    config = json.loads(out.read_text())["config"]
    assert config["decode_graphs"] is False and config["launch_on_loop"] is False


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main([*SMALL, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvferry bench: error: ")
    return lines[0]


def test_what_cannot_work_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert "no such preset or directory" in _refused(capsys, "--model", "nemotron-h-2b")
    assert "expected cpu, cuda or cuda:N" in _refused(capsys, "--device", "tpu")
    assert "does not exist" in _refused(capsys, "--json", str(tmp_path / "missing" / "out.json"))
    assert "--new-tokens must be at least 2" in _refused(capsys, "--new-tokens", "1")
    if not torch.cuda.is_available():
        assert "CUDA is not available" in _refused(capsys, "--device", "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_small_run_on_cuda(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    argv = [*SMALL, "--device", "cuda", "--dtype", "bfloat16", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["config"]["device"].startswith("cuda") and result["hardware"]["gpu"]
    assert all(r["roofline_ratio"] > 0 for r in result["rows"])
