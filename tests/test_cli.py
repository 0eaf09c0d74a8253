"""The CLI's shared behaviour: one-line typed errors and exit codes, quick help, and small command checks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvferry import cli
from kvferry.cli import main
from kvferry.errors import ConfigError, PeerDisconnected, TransferTimeout


def test_an_exception_group_of_typed_errors_prints_one_line_and_exits_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvferry.commands.layout as layout

    def fail(args: object) -> int:
        # what anyio task groups raise: the cause, nested, beside its echoes
        inner = ExceptionGroup(
            "tasks", [PeerDisconnected("the context process\nwent away"), TransferTimeout("t")]
        )
        raise ExceptionGroup("outer", [inner, PeerDisconnected("echo")])

    monkeypatch.setattr(layout, "run", fail)
    assert main(["layout"]) == 3
    err = capsys.readouterr().err
    assert err == "kvferry layout: error: the context process went away (PeerDisconnected)\n"


def test_exit_codes_by_kind_of_failure(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.exit_status("demo", ConfigError("--gen-tp 3: no")) == 2
    assert cli.exit_status("demo", ExceptionGroup("g", [TransferTimeout("slow")])) == 3
    assert cli.exit_status("demo", BaseExceptionGroup("g", [KeyboardInterrupt()])) == 130
    assert cli.exit_status("demo", KeyboardInterrupt()) == 130
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "kvferry demo: error: --gen-tp 3: no (ConfigError)"
    assert lines[2] == "kvferry demo: interrupted"
    # a bug (no typed error anywhere) keeps its traceback
    with pytest.raises(ExceptionGroup):
        cli.exit_status("demo", ExceptionGroup("g", [ValueError("bug")]))


def test_help_imports_no_torch() -> None:
    """`kvferry --help` took 3.8 s, all of it importing torch to list the layout presets."""
    code = (
        "import sys, contextlib, io\n"
        "from kvferry.cli import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "for name in ('demo', 'generate', 'layout', 'info', 'bench'):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        main([name, '--help'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'numpy', 'nixl_cu13', 'ucxx'}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"


def test_command_presets_match_the_specs() -> None:
    from kvferry.commands._common import PRESETS
    from kvferry.pools.spec import preset_names

    assert tuple(PRESETS) == tuple(preset_names())


def test_layout_says_when_no_request_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", "--memory", "1KB"]) == 0
    assert "no full-length request fits: one of 512 tokens needs" in capsys.readouterr().out
    assert main(["layout", "--memory", "1KB", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ranks"][0]["fit"]["requests"] == 0
    assert "no full-length request fits" in captured.err and "--memory" in captured.err
    with pytest.raises(SystemExit) as exit_info:
        main(["layout", "--memory", "0"])
    assert exit_info.value.code == 2
    assert "--memory: must be at least 1 byte" in capsys.readouterr().err


def test_demo_refuses_a_short_secret_before_it_runs(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvferry.commands.demo as demo

    path = tmp_path / "secret"  # type: ignore[operator]
    path.write_text("short\n")
    path.chmod(0o600)
    monkeypatch.setattr(demo, "_run", lambda *a: pytest.fail("ran with a bad secret"))
    assert main(["demo", "--secret-file", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvferry demo: error: the secret file "
        + str(path)
        + " holds 5 bytes; a secret needs at least 16 (ConfigError)"
    ]


@pytest.mark.parametrize(
    "command", ["demo", "layout", "generate", "info", "bench transfer", "bench decode", "serve"]
)
def test_the_readme_usage_of_each_command_lists_all_its_flags(command: str) -> None:
    import argparse
    import re
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    usage = re.search(rf"```\nkvferry {command} (.*?)```", readme, re.DOTALL)
    assert usage is not None, f"no usage block for kvferry {command}"
    parser = cli.build_parser()
    for word in command.split():
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[word]
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
    assert not {f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", usage.group(1))}


def test_demo_refuses_max_tokens_the_pools_cannot_hold_before_it_runs(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvferry.commands.demo as demo

    # it decoded for minutes, then failed with "request 0 cannot fit in the cache pools" (exit 3)
    monkeypatch.setattr(demo, "_run", lambda *a: pytest.fail("ran"))
    assert main(["demo", "--requests", "8", "--max-tokens", "1982"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvferry demo: error: --max-tokens 1982: the longest prompt (64 tokens) leaves room for at most 1981 "
        "generated tokens in the engines' 511 pages of 4 tokens (ConfigError)"
    ]


@pytest.mark.parametrize("value", ["-3", "0", "1"])
def test_demo_max_tokens_below_two_names_the_one_rule(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # one message for every value below the limit, not a lower bound that the next value then fails
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--max-tokens", value])
    assert exit_info.value.code == 2
    assert f"argument --max-tokens: must be at least 2 (the first token and one decoded), got {value}" in (
        capsys.readouterr().err
    )


def test_demo_runs_on_the_device_and_dtype_it_is_given(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    argv = ["demo", "--transport", "local", "--requests", "2", "--spec-k", "1", "--max-tokens", "3", "--json"]
    assert main([*argv, "--device", "cpu", "--dtype", "float32"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["identical"] is True and result["requests"] == 2


def test_demo_refuses_a_device_torch_cannot_use_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    assert main(["demo", "--device", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected cpu, cuda or cuda:N" in err[0]
    if not torch.cuda.is_available():
        assert main(["demo", "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "CUDA is not available here" in err[0]
