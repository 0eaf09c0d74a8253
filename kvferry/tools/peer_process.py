"""Driving a :mod:`kvferry.tools.peer` process from this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

__all__ = ["PeerProcess"]


class PeerProcess:
    """The other end of a transfer, in its own process. Use as a context manager; ``close()`` ends it."""

    def __init__(
        self,
        name: str,
        *,
        device: str = "cpu",
        env: Mapping[str, str] | None = None,
        argv: Sequence[str] | None = None,
        cwd: str | None = None,
    ) -> None:
        """``argv``: another peer program speaking the same protocol (default :mod:`kvferry.tools.peer`)."""
        self.name = name
        self.proc = subprocess.Popen(
            list(argv or [sys.executable, "-m", "kvferry.tools.peer", name, "--device", device]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
            cwd=cwd,
        )
        self._lock = threading.Lock()
        #: the peer's first line (its address, and what else that program tells)
        self.info = self._read()
        self.address: str = self.info["address"]

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the peer process {self.name} exited ({self.proc.poll()})")
            if line.startswith("@@"):
                return self._result(json.loads(line[2:]))

    def _result(self, result: dict[str, Any]) -> dict[str, Any]:
        """A reply that reports an error raises it here."""
        if "error" in result:
            raise RuntimeError(f"peer: {result['error']}: {result['message']}")
        return result

    def call_sync(self, cmd: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
            return self._read()

    async def call(self, **cmd: Any) -> dict[str, Any]:
        return await anyio.to_thread.run_sync(self.call_sync, cmd)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(20)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
