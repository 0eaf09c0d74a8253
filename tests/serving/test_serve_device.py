"""``--device`` and ``--dtype`` of ``kvferry serve``: they reach every engine (the context engine's own process
too), and a device torch cannot use is refused in one line before anything starts."""

from __future__ import annotations

import subprocess
from typing import Any

import anyio
import pytest
import torch

from kvferry import cli
from kvferry.cli import main
from kvferry.commands import serve
from kvferry.disagg import serve as disagg_serve
from kvferry.disagg.serve import disaggregated, start_context_process


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["serve", *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvferry serve: error: ") and lines[0].endswith("(ConfigError)")
    return lines[0]


def test_a_device_torch_cannot_use_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("uvicorn")
    for argv in (["--device", "tpu"], ["--disagg", "--transport", "local", "--device", "tpu"]):
        assert "expected cpu, cuda or cuda:N" in _refused(capsys, *argv)
    assert "expected cpu, cuda or cuda:N" in _refused(capsys, "--role", "context", "--device", "tpu")
    if not torch.cuda.is_available():
        assert "CUDA is not available here" in _refused(capsys, "--device", "cuda")
    assert "no such preset or directory" in _refused(capsys, "--model", "nemotron-h-3b")


def test_the_flags_size_the_engine() -> None:
    args = cli.build_parser().parse_args(
        ["serve", "--model", "nemotron-h-1b", "--device", "cuda:1", "--dtype", "bfloat16"]
    )
    options = serve.engine_options(args, 2)
    assert (options.device, options.dtype, options.tp) == ("cuda:1", "bfloat16", 2)


def test_both_engines_of_an_in_process_disaggregation_get_the_dtype() -> None:
    async def main() -> tuple[Any, Any]:
        with anyio.fail_after(60):
            async with disaggregated(
                transport="local", separate_process=False, dtype="float32", device="cpu"
            ) as (_router, parts):
                return parts["gen"].runner.model.weights.dtype, parts["ctx"].runner.model.weights.dtype

    assert anyio.run(main) == (torch.float32, torch.float32)


def test_the_context_process_is_started_on_the_device_and_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def popen(argv: list[str], **_kwargs: Any) -> Any:
        seen.append(argv)
        raise OSError("not started in this test")

    monkeypatch.setattr(subprocess, "Popen", popen)
    with pytest.raises(OSError, match="not started"):
        start_context_process("ucx", 1, 0, 0, "bfloat16", model="nemotron-h-1b", device="cuda:1")
    argv = seen[0]
    assert argv[argv.index("--device") + 1] == "cuda:1"
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[argv.index("--model") + 1] == "nemotron-h-1b"
    # and the process builds its engine on them
    options = disagg_serve._options(1, 0, 0, "bfloat16", device="cuda:1")
    assert (options.device, options.dtype) == ("cuda:1", "bfloat16")
