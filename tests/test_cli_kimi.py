"""``kvferry generate`` and ``kvferry demo`` on KimiLinear models: the ``tiny-kimi`` preset and a checkpoint
directory written by transformers; the generated tokens are the engine's (and so transformers') greedy ones."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import torch

from kvferry.cli import main
from kvferry.engine.runner import build_engine
from kvferry.model.weights import ModelWeights
from tests.engine.test_engine_kimi import MLA_ARGS
from tests.engine.test_engine_kimi import model_greedy as greedy

FAST = ["--dtype", "float64"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    from kvferry.model.weights import hf_model

    path = tmp_path_factory.mktemp("kimi-ckpt")
    hf_model(ModelWeights.seeded(MLA_ARGS, 4, torch.float64)).save_pretrained(path)
    return path


def _generated(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[int]:
    assert main(["generate", *argv, "--json", *FAST]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
    return [int(t) for t in lines[-1]["tokens"]]


@pytest.mark.parametrize("spec_k", ["0", "2"])
def test_generate_on_a_kimi_checkpoint_gives_its_greedy_tokens(
    checkpoint: Path, spec_k: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = ["5", "17", "200", "3", "99"]
    tokens = _generated(
        capsys, ["--model", str(checkpoint), "--ids", *ids, "--max-tokens", "7", "--spec-k", spec_k]
    )
    weights = ModelWeights.from_checkpoint(checkpoint)
    spec = build_engine(checkpoint).runner.model.spec
    assert tokens == greedy(weights, spec.with_dtype("float64"), [int(i) for i in ids], 7)


@pytest.mark.parametrize("spec_k", ["0", "3"])
def test_generate_on_tiny_kimi_gives_the_engines_tokens(
    spec_k: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.engine.test_engine import options, run_all

    tokens = _generated(
        capsys, ["--model", "tiny-kimi", "--prompt", "hello kimi", "--max-tokens", "9", "--spec-k", spec_k]
    )
    built = build_engine("tiny-kimi", options(enable_reuse=False))
    assert tokens == anyio.run(run_all, built, [tuple(b"hello kimi")], [9])[0]


@pytest.mark.parametrize("model", ["tiny-kimi", "checkpoint"])
def test_demo_serves_a_kimi_model_identically_aggregated_and_disaggregated(
    model: str, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name = str(checkpoint) if model == "checkpoint" else model
    argv = ["demo", "--model", name, "--transport", "local", "--requests", "3", "--spec-k", "2"]
    assert main([*argv, "--max-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical"] is True and result["requests"] == 3 and result["bytes_transferred"] > 0


def test_demo_refuses_a_model_that_is_not_there(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--model", str(tmp_path / "nothing"), "--transport", "local"]) == 2
    assert "no such preset or directory" in capsys.readouterr().err
