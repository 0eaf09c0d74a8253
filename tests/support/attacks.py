"""Running the hostile peer (``hostile.py``) against a target from the security suites, and reading what it saw."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio

from kvferry.transports.handshake import SECRET_ENV, new_secret
from tests.support import SUPPORT

#: the secret the honest side of a security test holds; an attack given ``secret=True`` holds it too
SECRET = new_secret()


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of process ``pid`` (this one by default)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def hostile_argv(attack: str, address: str, *args: str, secret: bool = False) -> list[str]:
    """The command line of one attack on ``address`` (``secret``: the attacker holds :data:`SECRET`)."""
    argv = [
        sys.executable,
        str(SUPPORT / "hostile.py"),
        attack,
        address,
        "--transport",
        address.split(":")[0],
    ]
    return [*argv, *args, *(["--secret-env"] if secret else [])]


def hostile_env() -> dict[str, str]:
    return {**os.environ, SECRET_ENV: SECRET.decode()}


def seen_by(returncode: int | None, stdout: bytes, stderr: bytes) -> dict[str, Any]:
    """What the attack reported (its last stdout line, JSON); it must have exited cleanly."""
    assert returncode == 0, stderr.decode()[-2000:]
    result: dict[str, Any] = json.loads(stdout.decode().strip().splitlines()[-1])
    return result


async def hostile(attack: str, address: str, *args: str, secret: bool = False) -> dict[str, Any]:
    """Run one attack from its own process; what it saw."""
    with anyio.fail_after(60):
        done = await anyio.run_process(
            hostile_argv(attack, address, *args, secret=secret), env=hostile_env(), check=False
        )
    return seen_by(done.returncode, done.stdout, done.stderr)
