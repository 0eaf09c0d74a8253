"""``kvferry info [--json]``: versions, which transports load, and the UCX transports each one actually uses."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

from kvferry.commands._common import say
from kvferry.errors import ConfigError

__all__ = ["add_arguments", "collect", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--no-probe", action="store_true", help="skip the probe transfers (versions and loading only)"
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="memory to probe (auto: cpu, and cuda if present)",
    )


def collect(
    probe: bool = True, device: str = "auto", progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Everything ``kvferry info`` shows, as a dict (the ``--json`` output). ``progress`` hears of each step.

    :raises ~kvferry.errors.ConfigError: ``device="cuda"`` where torch sees no GPU
    """
    from kvferry.tools.probe import probe_transport, versions
    from kvferry.transports.registry import available_transports

    say = progress or (lambda message: None)
    for key, value in {"UCX_WARN_UNUSED_ENV_VARS": "n"}.items():
        os.environ.setdefault(key, value)
    if device == "cuda" and not _cuda():
        raise ConfigError("--device cuda: CUDA is not available here (torch sees no GPU)")
    devices = ["cpu"]
    if device == "cuda" or (device == "auto" and _cuda()):
        devices.append("cuda")
    if device == "cpu":
        devices = ["cpu"]
    say("loading the transports")
    loading = available_transports()
    transports: dict[str, Any] = {}
    for name, error in loading.items():
        entry: dict[str, Any] = {"loads": error is None, "error": error}
        if probe and error is None and name != "local":
            entry["memory"] = {}
            for d in devices:
                say(f"probing {name} with {d} memory: a transfer between two processes (--no-probe skips it)")
                entry["memory"][d] = probe_transport(name, d)
        transports[name] = entry
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith(("UCX_", "UCXPY_", "NIXL_"))}
    return {"versions": versions(), "transports": transports, "environment": env}


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def run(args: argparse.Namespace) -> int:
    from kvferry._stdio import quiet_library_env, stdout_to_stderr

    quiet_library_env()  # before nixl or ucxx loads
    # the libraries print to file descriptor 1 (from their import on): it points at stderr until the result
    with stdout_to_stderr():
        info = collect(probe=not args.no_probe, device=args.device, progress=say)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print("versions")
    for key, value in info["versions"].items():
        print(f"  {key:<24} {value or '-'}")
    print("transports")
    for name, entry in info["transports"].items():
        print(f"  {name:<6} {'loads' if entry['loads'] else 'missing: ' + str(entry['error'])}")
        for device, probe in entry.get("memory", {}).items():
            if not probe["ok"]:
                print(f"    {device}: probe failed: {probe['error']}")
                continue
            if probe.get("same_host"):
                print(f"    {device} memory, peers on this host: {probe['same_host']}")
            print(f"    {device} memory (UCX {probe.get('ucx_version') or '?'}):")
            for label, rows in probe["operations"].items():
                used = ", ".join(
                    dict.fromkeys(f"{r['transport']} ({r['protocol']}, {r['range']})" for r in rows)
                )
                print(f"      {label:<18} {used}")
            if probe["tcp"]:
                print(
                    "      WARNING: TCP is in use: expect a 10-100x slowdown (check UCX_TLS / UCX_NET_DEVICES)"
                )
            if not probe["operations"]:
                print("      (UCX reported no protocol: see UCX_PROTO_INFO=y UCX_LOG_LEVEL=info)")
    if info["environment"]:
        print("environment")
        for key, value in info["environment"].items():
            print(f"  {key}={value}")
    return 0
