"""``kvferry generate`` and the tokenizers it uses."""

from __future__ import annotations

import json

import pytest
import torch

from kvferry.cli import main
from kvferry.model.tokenizer import ByteTokenizer, load_tokenizer


def test_byte_tokenizer_round_trips_utf8() -> None:
    tokenizer = load_tokenizer("tiny")
    assert isinstance(tokenizer, ByteTokenizer)
    assert tokenizer.encode("hé") == [104, 195, 169]
    assert tokenizer.decode([104, 195, 169]) == "hé"
    assert tokenizer.decode([195]) == "\ufffd"


def test_a_directory_without_tokenizer_files_has_none(tmp_path: object) -> None:
    assert load_tokenizer(str(tmp_path)) is None


def test_generate_json_reports_tokens_acceptance_and_reuse(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt", "hello world", "--prompt", "hello world, again", "--max-tokens", "5"]
    assert main([*argv, "--dtype", "float64", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2
    first, second = lines
    assert first["prompt_tokens"] == list(b"hello world")
    assert len(first["tokens"]) == 5 and first["finish_reason"] == "length"
    assert first["text"] == ByteTokenizer().decode(first["tokens"])
    assert first["acceptance_rate"] == 0.0 and first["reused_tokens"] == 0
    assert second["reused_tokens"] == 8  # two full blocks of the shared prefix "hello wo"
    # token ids in, same tokens out
    assert (
        main(
            [
                "generate",
                "--ids",
                *map(str, b"hello world"),
                "--max-tokens",
                "5",
                "--dtype",
                "float64",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["tokens"] == first["tokens"]


def test_generate_refuses_bad_input_with_a_typed_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--ids", "300", "--max-tokens", "2"]) == 2
    assert "ConfigError" in capsys.readouterr().err
    assert main(["generate", "--model", "/nonexistent", "--ids", "1", "--max-tokens", "2"]) == 2


def test_generate_from_a_checkpoint_directory_equals_the_tiny_preset(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    from kvferry.model.weights import ModelWeights, tiny_args
    from kvferry.pools.spec import preset

    directory = Path(str(tmp_path)) / "ckpt"
    spec = preset("tiny").with_dtype("float64")
    ModelWeights.seeded(tiny_args(spec), 0, torch.float64).save_checkpoint(directory)
    ids = [*map(str, b"kv ferry!")]
    assert main(["generate", "--ids", *ids, "--max-tokens", "6", "--dtype", "float64", "--json"]) == 0
    tiny = json.loads(capsys.readouterr().out)
    argv = ["generate", "--model", str(directory), "--ids", *ids, "--max-tokens", "6", "--spec-k", "2"]
    assert main([*argv, "--dtype", "float64", "--json"]) == 0
    checkpoint = json.loads(capsys.readouterr().out)
    assert checkpoint["tokens"] == tiny["tokens"]  # other block size, speculative: the same tokens
    assert checkpoint["text"] is None and checkpoint["num_drafted"] > 0
    # no tokenizer files there: text prompts are refused, ids work
    assert main(["generate", "--model", str(directory), "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert "--ids" in capsys.readouterr().err
