"""``kvferry generate``: streamed, escaped text; bytes that are not UTF-8; errors that say what to change."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest

from kvferry.cli import main
from kvferry.commands.generate import _TextStream, escape
from kvferry.model.tokenizer import ByteTokenizer

FAST = ["--dtype", "float64"]


class Recorder(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_escape_keeps_text_and_escapes_control_characters() -> None:
    assert escape("héllo\n\tworld") == "héllo\n\tworld"
    assert escape("a\x1b[2Jb\x00\x7f\u202e") == "a\\x1b[2Jb\\x00\\x7f\\u202e"


def test_text_streams_as_tokens_arrive_and_waits_for_whole_characters() -> None:
    out = Recorder()
    stream = _TextStream(ByteTokenizer(), out)
    for token in [0x41, 0x1B, 0xC3]:
        stream.add(token)
    assert "".join(out.writes) == "A\\x1b"  # shown at once; the first byte of é waits
    stream.add(0xA9)
    stream.add(0xFF)  # not UTF-8 anywhere: shown as U+FFFD at the end
    stream.end()
    assert out.getvalue() == "A\\x1bé\ufffd\n"


def test_generate_streams_text_without_raw_control_bytes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = Recorder()
    monkeypatch.setattr("sys.stdout", out)
    assert main(["generate", "--prompt", "hello", "--max-tokens", "24", *FAST]) == 0
    text = out.getvalue()
    # printed piece by piece as tokens came (it was printed once, at the end), then one newline
    assert len([w for w in out.writes if w]) > 2 and text.endswith("\n")
    assert all(c.isprintable() or c in "\n\t" for c in text), repr(text)
    assert "[24 tokens, length" in capsys.readouterr().err


def test_a_prompt_that_is_not_utf8_is_taken_as_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    prompt = os.fsdecode(b"a\xff\x1bb")  # how Python hands over such an argument (lone surrogates)
    assert main(["generate", "--prompt", prompt, "--max-tokens", "3", "--json", *FAST]) == 0
    assert json.loads(capsys.readouterr().out)["prompt_tokens"] == [0x61, 0xFF, 0x1B, 0x62]


def test_a_missing_model_directory_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert main(["generate", "--model", str(missing), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvferry generate: error: --model {missing}: no such preset or directory (presets: tiny, "
        "tiny-kimi, nemotron-h-1b, nemotron-h-8b) (ConfigError)\n"
    )


def test_a_request_that_cannot_fit_names_the_sizes_and_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--ids", "1", "2", "3", "--max-tokens", "100", "--num-pages", "4", *FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "prompt 0 (3 tokens) with --max-tokens 100 needs about 26 pages of 4 tokens" in err
    assert "--num-pages 4 holds 3" in err and "raise --num-pages to at least 27" in err


def test_a_request_that_cannot_fit_fails_before_generating(capsys: pytest.CaptureFixture[str]) -> None:
    # it generated (and printed) all that fitted first: a minute of text before the error for 5000 tokens
    argv = ["generate", "--prompt", "hi", "--num-pages", "10", *FAST]
    assert main([*argv, "--max-tokens", "36"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "needs about 10 pages of 4 tokens; --num-pages 10 holds 9" in err
    # 2 + 35 tokens, the last one's KV never written: 36 tokens, 9 pages exactly
    assert main([*argv, "--max-tokens", "35", "--spec-k", "2"]) == 0
    assert "[35 tokens, length" in capsys.readouterr().err


def test_temperature_needs_a_seed_and_then_samples(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--prompt", "kv", "--max-tokens", "8", "--json", *FAST]
    assert main([*argv, "--temperature", "0.5"]) == 2
    assert "--temperature needs --seed" in capsys.readouterr().err
    runs = []
    for temperature in ("0.05", "50"):
        assert main([*argv, "--seed", "7", "--temperature", temperature]) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] != runs[1]  # the temperature is used (seeded: the same on every run)


@pytest.mark.parametrize("command", [["generate", "--ids", "1", "--max-tokens", "2"], ["demo"]])
def test_one_rule_for_seeds(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*command, "--seed", "-1"])
    assert exit_info.value.code == 2
    assert "argument --seed: a seed is an int in [0, 2**62), got -1" in capsys.readouterr().err


def test_an_empty_model_is_refused_not_read_as_the_current_directory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["generate", "--model", "", "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert capsys.readouterr().err == (
        "kvferry generate: error: --model is empty (give a preset: tiny, tiny-kimi, nemotron-h-1b, nemotron-h-8b; "
        "or a checkpoint directory) (ConfigError)\n"
    )


def test_a_negative_stop_id_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--ids", "1", "--max-tokens", "2", "--stop-ids", "-5"])
    assert exit_.value.code == 2
    assert "--stop-ids: must not be negative, got -5" in capsys.readouterr().err


CHAT = ["generate", "--chat", "--prompt", "hello there", "--prompt", "and then?", "--prompt", "ok", "--json"]


@pytest.mark.parametrize("spec_k", ["0", "2"])
def test_chat_gives_the_same_tokens_kept_offloaded_or_recomputed(
    spec_k: str, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {}
    for mode in ("", "--offload-between-turns", "--drop-between-turns", "--rebalance-between-turns"):
        argv = [*CHAT, "--max-tokens", "7", "--spec-k", spec_k, *FAST, *([mode] if mode else [])]
        assert main(argv) == 0
        runs[mode] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    tokens = {mode: [turn["tokens"] for turn in turns] for mode, turns in runs.items()}
    assert tokens[""] == tokens["--offload-between-turns"] == tokens["--drop-between-turns"]
    assert tokens[""] == tokens["--rebalance-between-turns"]
    # turn i sees the earlier turns: a fresh run of the whole history gives its tokens
    history = list(b"hello there") + tokens[""][0] + list(b"and then?")
    assert main(["generate", "--ids", *map(str, history), "--max-tokens", "7", "--json", *FAST]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == tokens[""][1]
    kept, offloaded, dropped = runs[""], runs["--offload-between-turns"], runs["--drop-between-turns"]
    for turn in (1, 2):
        earlier = sum(len(t["prompt_tokens"]) + len(t["tokens"]) for t in kept[:turn])
        assert kept[turn]["reused_tokens"] == earlier - 1  # all but the last answer token was computed
        assert kept[turn]["restored_bytes"] == kept[turn]["recomputed_tokens"] == 0
        assert offloaded[turn]["restored_bytes"] > 0 and offloaded[turn]["recomputed_tokens"] == 0
        assert dropped[turn]["recomputed_tokens"] > 0 and dropped[turn]["restored_bytes"] == 0
        # a rebalance moves every cache to the host: the turn restores it, computing nothing again
        rebalanced = runs["--rebalance-between-turns"][turn]
        assert rebalanced["restored_bytes"] > 0 and rebalanced["recomputed_tokens"] == 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prompt", "a", "--offload-between-turns"], "--offload-between-turns needs --chat"),
        (["--prompt", "a", "--rebalance-between-turns"], "--rebalance-between-turns needs --chat"),
        (["--chat", "--ids", "1", "2"], "--chat takes its turns as --prompt"),
        (
            ["--chat", "--prompt", "a", "--offload-between-turns", "--drop-between-turns"],
            "exclude each other",
        ),
    ],
)
def test_chat_misuse_says_what_to_change(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--max-tokens", "2", *argv]) == 2
    assert says in capsys.readouterr().err


# --- --device and --dtype ----------------------------------------------------------------------------------


def test_device_cpu_and_each_dtype_generate(capsys: pytest.CaptureFixture[str]) -> None:
    ids = ["--ids", "1", "2", "3", "--max-tokens", "3", "--json", "--device", "cpu"]
    for dtype in ("float64", "float32", "bfloat16"):
        assert main(["generate", *ids, "--dtype", dtype]) == 0
        tokens = json.loads(capsys.readouterr().out)["tokens"]
        assert len(tokens) == 3 and all(0 <= t < 256 for t in tokens)


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("tpu", "--device 'tpu': expected cpu, cuda or cuda:N"),
        ("cpu:1", "--device 'cpu:1': expected cpu, cuda or cuda:N"),
        ("cuda:64", "--device cuda:64: "),
    ],
)
def test_a_device_torch_cannot_use_is_refused_in_one_line(
    device: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["generate", "--ids", "1", "--max-tokens", "2", "--device", device]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvferry generate: error: {message}"), lines
    assert lines[0].endswith("(ConfigError)")


def test_cuda_without_a_gpu_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    assert main(["generate", "--ids", "1", "--max-tokens", "2", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        "kvferry generate: error: --device cuda: CUDA is not available here (torch sees no GPU) (ConfigError)\n"
    )


def test_a_preset_has_no_tokenizer_but_takes_ids_and_an_unknown_one_is_listed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["generate", "--model", "nemotron-h-1b", "--prompt", "hi", "--max-tokens", "2"]) == 2
    assert "nemotron-h-1b has no tokenizer: give token ids with --ids" in capsys.readouterr().err
    assert main(["generate", "--model", "nemotron-h-9b", "--ids", "1", "--max-tokens", "2"]) == 2
    assert (
        "no such preset or directory (presets: tiny, tiny-kimi, nemotron-h-1b, nemotron-h-8b)"
        in capsys.readouterr().err
    )


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_generate_on_cuda_gives_the_cpu_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    ids = ["--ids", "5", "6", "7", "8", "--max-tokens", "6", "--json", "--dtype", "float64"]
    assert main(["generate", *ids, "--device", "cpu"]) == 0
    on_cpu = json.loads(capsys.readouterr().out)["tokens"]
    assert main(["generate", *ids, "--device", "cuda"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == on_cpu
    assert (
        main(
            [
                "generate",
                "--model",
                "nemotron-h-1b",
                "--ids",
                "5",
                "6",
                "--max-tokens",
                "4",
                "--json",
                "--device",
                "cuda",
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    assert len(json.loads(capsys.readouterr().out)["tokens"]) == 4
