from __future__ import annotations

import argparse
import json
from typing import Any

import pytest

from kvferry.cli import main
from kvferry.commands._common import parse_bytes
from kvferry.pools.spec import DRAFT_LAYER_SHIFT


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    assert main(["layout", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_tiny_tp2_with_memory(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--model", "tiny", "--tp", "2", "--memory", "1MiB", "--replay-tokens", "4")
    assert (data["model"], data["tp"], data["max_tokens"], data["memory_bytes"]) == ("tiny", 2, 512, 1 << 20)
    assert [r["rank"] for r in data["ranks"]] == [0, 1]
    rank1 = data["ranks"][1]
    groups = {g["name"]: g for g in rank1["layer_groups"]}
    assert list(groups) == ["attention", "draft", "mamba2"]
    att = groups["attention"]
    assert att["kind"] == "paged" and att["roles"] == ["key", "value"] and att["tokens_per_block"] == 4
    assert att["layer_ids"] == [1, 5] and att["heads"] == {"count": 2, "first": 2, "total": 4, "replicas": 1}
    assert (att["page_bytes"], att["bytes_per_token"]) == (2048, 512.0)
    assert groups["draft"]["layer_ids"] == [DRAFT_LAYER_SHIFT] and groups["draft"]["bytes_per_token"] == 256.0
    mamba = groups["mamba2"]
    assert mamba["roles"] == ["conv", "ssm"] and mamba["heads"]["first"] == 4
    assert mamba["conv_section_bytes"] == [64 * 12, 16 * 12, 16 * 12]
    assert mamba["bytes_per_slot"] == 3456 + 12288
    pools = {p["name"]: p for g in rank1["pool_groups"] for p in g["pools"]}
    assert (pools["mamba2.conv"]["slot_stride"], pools["mamba2.ssm"]["slot_stride"]) == (3456, 12288)
    assert all(p["layer_stride"] == 0 for p in pools.values())
    assert rank1["replay_bytes_per_slot"] == 4800  # 3 layers x 4 tokens x (96 + 4 heads) x 4 bytes
    assert rank1["bytes_per_slot"] == 3456 + 12288 + 4800 + 8
    per_request = 128 * 2048 + 64 * 2048 + 3456 + 12288 + 4800 + 8
    assert rank1["fit"] == {
        "requests": 2,
        "num_pages": 256,
        "num_slots": 2,
        "num_draft_pages": 128,
        "pages_per_request": 128,
        "draft_pages_per_request": 64,
        "bytes_per_request": per_request,
        "bytes_used": 2 * per_request,
    }
    assert pools["attention"]["nbytes"] == 256 * 2048
    assert {g["name"]: g["num_slots"] for g in rank1["pool_groups"]} == {
        "attention": 256,
        "draft": 128,
        "mamba2": 2,
    }


def test_json_without_memory_has_no_counts(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--tp", "4", "--no-drafter", "--dtype", "bfloat16")
    assert data["memory_bytes"] is None and len(data["ranks"]) == 4
    rank = data["ranks"][3]
    assert rank["fit"] is None
    assert [g["name"] for g in rank["layer_groups"]] == ["attention", "mamba2"]
    assert all(g["num_slots"] is None for g in rank["pool_groups"])
    assert rank["layer_groups"][0]["dtypes"] == ["bfloat16", "bfloat16"]
    assert rank["layer_groups"][0]["bytes_per_token"] == 2 * 2 * 1 * 16 * 2  # 2 layers, K+V, 1 head, bf16


def test_nemotron_80gib(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--model", "nemotron-h-8b", "--tp", "8", "--memory", "80GiB", "--max-tokens", "8192")
    rank = data["ranks"][0]
    per_request = 256 * 65536 + 128 * 32768 + 184320 + 12582912 + 8
    assert rank["fit"]["bytes_per_request"] == per_request
    assert rank["fit"]["requests"] == (80 << 30) // per_request
    dtypes = {g["name"]: g["dtypes"] for g in rank["layer_groups"]}
    assert dtypes["mamba2"] == ["bfloat16", "float32"]


def test_nemotron_1b_tp4(capsys: pytest.CaptureFixture[str]) -> None:
    data = _json(capsys, "--model", "nemotron-h-1b", "--tp", "4", "--memory", "8GiB", "--max-tokens", "8192")
    rank = data["ranks"][0]
    # per rank: 1 kv head of 128 over 4 attention layers (32-token pages), the drafter's 1 kv head (64-token
    # pages), 8 Mamba2 heads and 2 groups over 20 layers (bfloat16 conv window of 3, float32 SSM state)
    conv = 20 * 3 * (8 * 64 + 2 * 2 * 128) * 2
    ssm = 20 * 8 * 64 * 128 * 4
    per_request = 256 * (4 * 2 * 128 * 2 * 32) + 128 * (2 * 128 * 2 * 64) + conv + ssm + 8
    assert rank["fit"]["bytes_per_request"] == per_request
    assert rank["fit"]["requests"] == (8 << 30) // per_request


def test_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", "--model", "tiny", "--tp", "2", "--memory", "1000000"]) == 0
    out = capsys.readouterr().out
    assert "rank 1" in out and "mamba2.conv" in out and "D0" in out
    assert "2 full-length requests" in out


def test_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["layout", "--tp", "3"]) == 2
    assert "ConfigError" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["layout", "--memory", "80XB"])
    with pytest.raises(SystemExit):
        main(["layout", "--tp", "0"])


def test_parse_bytes() -> None:
    assert parse_bytes("1000") == 1000
    assert parse_bytes("80GiB") == 80 << 30
    assert parse_bytes("80 gib") == 80 << 30
    assert parse_bytes("1.5KiB") == 1536
    assert parse_bytes("2MB") == 2_000_000
    assert parse_bytes("64K") == parse_bytes("64KiB") == 64 << 10  # the bare letter is the binary shorthand
    assert parse_bytes("64KB") == 64_000
    for bad in ("", "-1", "1e3", "GiB", "5 parsecs"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_every_command_reads_sizes_by_one_rule() -> None:
    """``layout --memory`` and ``bench transfer``'s sizes agree on what KB and KiB mean."""
    from kvferry.cli import build_parser

    parser = build_parser()
    bench = parser.parse_args(["bench", "transfer", "--total-bytes", "64KB", "--page-bytes", "4KiB"])
    layout = parser.parse_args(["layout", "--memory", "64KB"])
    assert bench.total_bytes == layout.memory == 64_000 and bench.page_bytes == 4096
