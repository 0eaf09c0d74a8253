"""``kvferry info``: progress on stderr while it probes, one JSON object on stdout, bad devices refused."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvferry.cli import main


def test_probe_progress_goes_to_stderr_and_json_to_stdout(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvferry.tools.probe as probe
    import kvferry.transports.registry as registry

    probed: list[tuple[str, str]] = []

    def fake_probe(name: str, device: str = "cpu", timeout: float = 120.0) -> dict[str, Any]:
        probed.append((name, device))
        return {
            "ok": True,
            "error": None,
            "operations": {},
            "tcp": False,
            "ucx_version": None,
            "same_host": None,
        }

    monkeypatch.setattr(probe, "probe_transport", fake_probe)
    monkeypatch.setattr(registry, "available_transports", lambda: {"nixl": None, "ucx": None, "local": None})
    assert main(["info", "--json", "--device", "cpu"]) == 0
    captured = capsys.readouterr()
    assert set(json.loads(captured.out)["transports"]) == {"nixl", "ucx", "local"}
    assert probed == [("nixl", "cpu"), ("ucx", "cpu")]
    # the probe takes many seconds: each step is announced as it starts
    assert "probing nixl with cpu memory" in captured.err and "probing ucx with cpu memory" in captured.err


def test_device_cuda_without_cuda_is_an_error(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(["info", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err
        == "kvferry info: error: --device cuda: CUDA is not available here (torch sees no GPU) (ConfigError)\n"
    )
