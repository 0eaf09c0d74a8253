"""``kvferry layout``: each rank's pool groups and layer groups, and with ``--memory`` how much cache fits.

Nothing is allocated: this only builds :class:`~kvferry.pools.layout.CacheLayout` descriptions.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from kvferry.commands._common import PRESETS, byte_count, positive_int

if TYPE_CHECKING:  # imported when the command runs: `kvferry --help` does not import torch
    from kvferry.pools.layout import Fit
    from kvferry.pools.spec import ModelSpec

#: Full request length per preset when --max-tokens is not given (the model's max position).
DEFAULT_MAX_TOKENS = {"tiny": 512, "nemotron-h-1b": 8192, "nemotron-h-8b": 8192}


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an int: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=PRESETS, default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default: 1)")
    parser.add_argument(
        "--memory", type=byte_count, default=None, help="cache memory per rank, e.g. 80GiB, 512MB, 1000000"
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="tokens of a full-length request (default: the preset's max position: "
        + ", ".join(f"{k} {v}" for k, v in DEFAULT_MAX_TOKENS.items())
        + ")",
    )
    parser.add_argument(
        "--replay-tokens",
        type=_non_negative_int,
        default=0,
        help="replay buffer tokens per state slot (k+1 for k draft tokens; default 0)",
    )
    parser.add_argument("--dtype", default=None, help="override every cache dtype (float32, bfloat16, ...)")
    parser.add_argument("--no-drafter", action="store_true", help="leave out the drafter's KV")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def _model(args: argparse.Namespace) -> ModelSpec:
    from kvferry.pools.spec import preset

    model = preset(args.model)
    if args.dtype is not None:
        model = model.with_dtype(args.dtype)
    if args.no_drafter:
        model = model.without_drafter()
    return model


def _rank_report(
    model: ModelSpec, tp: int, rank: int, args: argparse.Namespace, max_tokens: int
) -> dict[str, Any]:
    from kvferry.pools.layout import CacheLayout, GroupKind, fit

    spec = model.shard(tp, rank)
    sized: Fit | None = None
    if args.memory is not None:
        sized = fit(spec, args.memory, max_tokens, max_replay_tokens=args.replay_tokens)
    counts_known = sized is not None and sized.requests > 0
    layout = CacheLayout.build(
        spec,
        num_pages=sized.num_pages if sized is not None and counts_known else 1,
        num_slots=sized.num_slots if sized is not None and counts_known else 1,
        num_draft_pages=sized.num_draft_pages if sized is not None and counts_known else 1,
        max_replay_tokens=args.replay_tokens,
    )
    layer_groups = []
    for group in layout.layer_groups:
        entry: dict[str, Any] = {
            "name": group.name,
            "kind": group.kind.value,
            "layer_kind": group.layer_kind.value,
            "roles": [r.value for r in group.roles],
            "dtypes": list(group.dtypes),
            "layer_ids": list(group.layer_ids),
            "tokens_per_block": group.tokens_per_block,
            "heads": {
                "count": group.heads.count,
                "first": group.heads.first,
                "total": group.heads.total,
                "replicas": group.heads.replicas,
            },
            "head_dim": group.head_dim,
        }
        if group.kind == GroupKind.PAGED:
            entry["page_bytes"] = layout.page_bytes(group.name)
            entry["bytes_per_token"] = layout.bytes_per_token(group.name)
        else:
            entry["state_size"] = group.state_size
            entry["conv_kernel"] = group.conv_kernel
            entry["conv_section_bytes"] = list(group.conv_section_bytes)
            entry["ssm_bytes_per_head"] = group.ssm_bytes_per_head
            entry["bytes_per_slot"] = layout.pool_group(group.name).slot_bytes
        layer_groups.append(entry)
    pool_groups = [
        {
            "name": g.name,
            "kind": g.kind.value,
            "num_slots": g.num_slots if counts_known else None,
            "slot_bytes": g.slot_bytes,
            "pools": [
                {
                    "name": p.name,
                    "roles": [r.value for r in p.roles],
                    "entries": len(p.entries),
                    "slot_bytes": p.slot_bytes,
                    "slot_stride": p.slot_stride,
                    "layer_stride": p.layer_stride,
                    "nbytes": p.nbytes if counts_known else None,
                }
                for p in g.pools
            ],
        }
        for g in layout.pool_groups
    ]
    return {
        "rank": rank,
        "layer_groups": layer_groups,
        "pool_groups": pool_groups,
        "state_bytes_per_slot": layout.state_bytes_per_slot,
        "replay_bytes_per_slot": layout.replay.slot_stride,
        "bytes_per_slot": layout.bytes_per_slot,
        "fit": None
        if sized is None
        else {
            "requests": sized.requests,
            "num_pages": sized.num_pages,
            "num_slots": sized.num_slots,
            "num_draft_pages": sized.num_draft_pages,
            "pages_per_request": sized.pages_per_request,
            "draft_pages_per_request": sized.draft_pages_per_request,
            "bytes_per_request": sized.bytes_per_request,
            "bytes_used": sized.bytes_used,
        },
    }


def report(args: argparse.Namespace) -> dict[str, Any]:
    """The whole report as one JSON-able object (see ``--json``)."""
    model = _model(args)
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS.get(args.model, 4096)
    return {
        "model": model.name,
        "tp": args.tp,
        "max_tokens": max_tokens,
        "max_replay_tokens": args.replay_tokens,
        "memory_bytes": args.memory,
        "ranks": [_rank_report(model, args.tp, rank, args, max_tokens) for rank in range(args.tp)],
    }


def _table(rows: list[list[str]], indent: str = "    ") -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        indent + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    ]
    return "\n".join(lines)


def _bytes(value: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:g} B"


def _layer_ids(ids: list[int]) -> str:
    from kvferry.pools.spec import DRAFT_LAYER_SHIFT

    # draft layers print as D0, D1, ... (global id DRAFT_LAYER_SHIFT + i)
    text = ",".join(f"D{i - DRAFT_LAYER_SHIFT}" if i >= DRAFT_LAYER_SHIFT else str(i) for i in ids)
    return text if len(text) <= 24 else f"{len(ids)} layers {ids[0]}..{ids[-1]}"


def render(data: dict[str, Any]) -> str:
    """The report as readable tables."""
    out = [
        f"{data['model']}, TP {data['tp']}: full-length request {data['max_tokens']} tokens, "
        f"replay {data['max_replay_tokens']} tokens per slot"
    ]
    for rank in data["ranks"]:
        out.append(f"\nrank {rank['rank']}")
        rows = [
            [
                "layer group",
                "kind",
                "layers",
                "roles",
                "dtypes",
                "tokens/block",
                "heads",
                "bytes/token",
                "bytes/slot",
            ]
        ]
        for g in rank["layer_groups"]:
            heads = g["heads"]
            heads_text = f"{heads['count']} of {heads['total']} from {heads['first']}"
            if heads["replicas"] > 1:
                heads_text += f" (x{heads['replicas']})"
            paged = g["kind"] == "paged"
            rows.append(
                [
                    g["name"],
                    g["kind"],
                    _layer_ids(g["layer_ids"]),
                    "/".join(g["roles"]),
                    "/".join(dict.fromkeys(g["dtypes"])),
                    str(g["tokens_per_block"]) if paged else "-",
                    heads_text,
                    f"{g['bytes_per_token']:g}" if paged else "-",
                    "-" if paged else str(g["bytes_per_slot"]),
                ]
            )
        out.append(_table(rows))
        rows = [
            ["pool group", "pool", "entries", "slot bytes", "slot stride", "layer stride", "slots", "bytes"]
        ]
        for g in rank["pool_groups"]:
            for p in g["pools"]:
                rows.append(
                    [
                        g["name"],
                        p["name"],
                        str(p["entries"]),
                        str(p["slot_bytes"]),
                        str(p["slot_stride"]),
                        str(p["layer_stride"]),
                        "-" if g["num_slots"] is None else str(g["num_slots"]),
                        "-" if p["nbytes"] is None else _bytes(p["nbytes"]),
                    ]
                )
        out.append(_table(rows))
        out.append(
            f"    per state slot: {rank['state_bytes_per_slot']} B state + {rank['replay_bytes_per_slot']} B replay"
            f" + 8 B num_accepted = {rank['bytes_per_slot']} B"
        )
        sized = rank["fit"]
        if sized is not None and sized["requests"] == 0:
            out.append(f"    {_no_fit(data, sized)}")
        elif sized is not None:
            out.append(
                f"    in {_bytes(data['memory_bytes'])}: {sized['requests']} full-length requests "
                f"({_bytes(sized['bytes_per_request'])} each): {sized['num_pages']} pages, {sized['num_slots']} slots, "
                f"{sized['num_draft_pages']} draft pages, {_bytes(sized['bytes_used'])} used"
            )
    return "\n".join(out)


def _no_fit(data: dict[str, Any], sized: dict[str, Any]) -> str:
    return (
        f"in {_bytes(data['memory_bytes'])}: no full-length request fits: one of {data['max_tokens']} tokens needs "
        f"{_bytes(sized['bytes_per_request'])} ({sized['bytes_per_request']} B); raise --memory or lower --max-tokens"
    )


def run(args: argparse.Namespace) -> int:
    data = report(args)
    print(json.dumps(data) if args.json else render(data))
    if args.json:
        # the table says it in place; with --json say it on stderr, once per distinct rank figure
        notes = {
            _no_fit(data, r["fit"])
            for r in data["ranks"]
            if r["fit"] is not None and r["fit"]["requests"] == 0
        }
        for note in sorted(notes):
            print(f"kvferry layout: {note}", file=sys.stderr)
    return 0
