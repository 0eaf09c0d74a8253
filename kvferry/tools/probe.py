"""What ``kvferry info`` reports: versions, which transports load, and the UCX transports each actually uses.

The UCX protocols are read from a real transfer: a probe process runs with ``UCX_PROTO_INFO=y`` and writes a small
and a large buffer to a peer process, and UCX prints the protocol it selected for each operation. A silent fallback
to TCP (the usual cause of a 10-100x slowdown) shows up as ``tcp`` there.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from typing import Any

__all__ = ["PROBE_OPERATIONS", "SAME_HOST_PATHS", "parse_proto_info", "probe_transport", "versions"]

#: per transport: the UCX operations its data path uses -> what we call them
PROBE_OPERATIONS: dict[str, dict[str, str]] = {
    "nixl": {
        "remote memory write by ucp_put*": "write (one-sided)",
        "active message by ucp_am_send*": "notifications",
    },
    "ucx": {
        "tagged message by ucp_tag_send*": "data (tagged)",
    },
}

#: kvferry's own paths to a peer on this host, taken ahead of UCX's (per transport and memory)
SAME_HOST_PATHS: dict[tuple[str, str], str] = {
    ("nixl", "cpu"): "process_vm_writev by the writer, up to 1024 fragments per call (host_cma)",
    ("nixl", "cuda"): "CUDA IPC mapping, one batched device copy per write (cuda_ipc)",
    ("ucx", "cpu"): "process_vm_readv by the receiver, up to 1024 fragments per call (host_cma)",
}

# UCX 1.21 (ucxx): "| ucp_context_0 intra-node cfg#0 | tagged message by ... |"
# UCX 1.23 (nixl): "| <worker> intra-node cfg#0 |" and the operation on the next line
_HEADER = re.compile(
    r"\|\s*\S+\s+(?P<scope>self|intra-node|inter-node)\s+cfg#\d+\s*(?:\|\s*(?P<op>[^|]+?)\s*)?\|"
)
_OPERATION = re.compile(r"^\s*\|\s*(?P<op>[a-z][^|]*? by ucp_[^|]*?)\s*\|\s*$")
_VERSION = re.compile(r"UCX\s+INFO\s+Version (?P<version>\d+\.\d+\.\d+)")
_ROW = re.compile(
    r"\|\s*(?P<range>[0-9.KMGinf]+\.\.[0-9.KMGinf]+)\s*\|\s*(?P<proto>[^|]+?)\s*\|\s*(?P<tl>[^|]+?)\s*\|"
)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of kvferry and what it runs on (None: not installed). Imports neither nixl nor ucxx."""
    import kvferry

    return {
        "kvferry": kvferry.__version__,
        "python": sys.version.split()[0],
        "torch": _version("torch"),
        "numpy": _version("numpy"),
        "nixl": _version("nixl-cu13") or _version("nixl-cu12") or _version("nixl"),
        "ucxx": _version("ucxx-cu13") or _version("ucxx-cu12") or _version("ucxx"),
        "ucx (ucxx)": _version("libucx-cu13") or _version("libucx-cu12") or _version("libucx"),
        "ucx (bundled with nixl)": _nixl_ucx_version(),
    }


def _nixl_ucx_version() -> str | None:
    try:
        files = importlib.metadata.files("nixl-cu13") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if re.search(r"libucp-[0-9a-f]+\.so", str(f)):
            return "bundled (version: see the transport probe)"
    return None


def parse_proto_info(text: str) -> list[dict[str, str]]:
    """Rows of UCX_PROTO_INFO tables: operation, scope, size range, protocol, transport/device."""
    rows: list[dict[str, str]] = []
    operation = scope = ""
    for line in text.splitlines():
        body = line[line.rfind("]") + 1 :]
        header = _HEADER.search(body)
        if header:
            operation, scope = header["op"] or "", header["scope"]
            continue
        op = _OPERATION.search(body)
        if op and scope:
            operation = op["op"]
            continue
        row = _ROW.search(body)
        if row and operation:
            rows.append(
                {
                    "operation": operation,
                    "scope": scope,
                    "range": row["range"],
                    "protocol": row["proto"],
                    "transport": row["tl"],
                }
            )
    return rows


def probe_transport(name: str, device: str = "cpu", timeout: float = 120.0) -> dict[str, Any]:
    """Run a small and a large write with ``name`` to another process and report the UCX protocols chosen.

    UCX's choice is what the transport uses for peers on other hosts, and on this host where kvferry's own path
    (``same_host``, from :data:`SAME_HOST_PATHS`) is off or refused.

    :return: ``{"ok": bool, "error": str | None, "operations": {label: [{"range", "protocol", "transport"}...]},
        "tcp": bool, "ucx_version": str | None, "same_host": str | None}``
    """
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvferry.tools.probe", name, device],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {
            "ok": False,
            "error": f"probe timed out after {timeout} s",
            "operations": {},
            "tcp": False,
            "ucx_version": None,
            "same_host": SAME_HOST_PATHS.get((name, device)),
        }
    rows = parse_proto_info(done.stdout + "\n" + done.stderr)
    wanted = PROBE_OPERATIONS.get(name, {})
    memory = "host memory" if device == "cpu" else "cuda"
    operations: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        for prefix, label in wanted.items():
            op = row["operation"]
            if op.startswith(prefix) and memory in op and "(" not in op and row["scope"] != "self":
                entry = {
                    "range": row["range"],
                    "protocol": row["protocol"],
                    "transport": row["transport"],
                    "scope": row["scope"],
                }
                if entry not in operations.setdefault(label, []):
                    operations[label].append(entry)
    ok = done.returncode == 0
    error = None if ok else (done.stderr.strip().splitlines() or ["failed"])[-1]
    tcp = any("tcp" in e["transport"] for entries in operations.values() for e in entries)
    found = _VERSION.search(done.stdout + done.stderr)
    return {
        "ok": ok,
        "error": error,
        "operations": operations,
        "tcp": tcp,
        "ucx_version": found["version"] if found else None,
        "same_host": SAME_HOST_PATHS.get((name, device)),
    }


async def _probe_main(name: str, device: str) -> None:
    import torch

    from kvferry.tools.peer_process import PeerProcess
    from kvferry.transports.registry import get_transport

    clean = {"UCX_PROTO_INFO": "n", "UCX_LOG_LEVEL": "warn"}
    import anyio

    with await anyio.to_thread.run_sync(lambda: PeerProcess(name, device=device, env=clean)) as proc:
        # the UCX transports themselves: our same-host paths (CUDA IPC, process_vm_writev/readv) would bypass them
        options: dict[str, bool] = {
            "nixl": {"cuda_ipc": False, "host_cma": False},
            "ucx": {"host_cma": False},
        }.get(name, {})
        async with get_transport(name)(**options) as transport:
            peer = await transport.connect(proc.address)
            size = 4 << 20
            dst = (await proc.call(op="alloc", name="probe", size=size))["address"]
            await transport.receive_message(peer)
            src = torch.ones(size, dtype=torch.uint8, device=device)
            await transport.register(src)
            for n in (4096, size):
                await transport.write(peer, [[src.data_ptr(), n]], [[dst, n]], b"probe")
            await proc.call(op="notifications", count=2)


if __name__ == "__main__":
    import anyio

    anyio.run(_probe_main, sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "cpu")
