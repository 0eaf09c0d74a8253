"""The handshake's pieces that need no peer (``kvferry.transports.handshake``): the pid proof."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys

import numpy as np
import pytest

from kvferry.transports import _cma, messages
from kvferry.transports.handshake import Handshake, pid_namespace


def _hello(**fields: object) -> messages.Hello:
    base: dict[str, object] = dict(
        transport="ucx",
        instance_id="x",
        address="ucx://127.0.0.1:1",
        hostname=socket.gethostname(),
        pid=0,
        pid_namespace=pid_namespace(),
        max_message_bytes=0,
        tag_prefix=0,
        regions=(),
        backend=b"",
    )
    return messages.Hello(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.skipif(not _cma.available(), reason="needs process_vm_readv/writev")
def test_a_peer_proves_its_pid_by_the_bytes_in_its_memory() -> None:
    proves = Handshake._proves_pid
    expected = secrets.token_bytes(32)
    proof = np.frombuffer(expected, dtype=np.uint8).copy()
    address = int(proof.ctypes.data)
    assert proves(_hello(pid=os.getpid(), pid_proof_address=address), expected)
    # other bytes, no address, another host or pid namespace, another process, unmapped memory: not believed
    assert not proves(_hello(pid=os.getpid(), pid_proof_address=address), secrets.token_bytes(32))
    assert not proves(_hello(pid=os.getpid()), expected)
    assert not proves(_hello(pid=os.getpid(), pid_proof_address=address, hostname="elsewhere"), expected)
    assert not proves(_hello(pid=os.getpid(), pid_proof_address=address, pid_namespace=1), expected)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not proves(_hello(pid=other.pid, pid_proof_address=address), expected)
    finally:
        other.kill()
        other.wait()
    assert not proves(_hello(pid=os.getpid(), pid_proof_address=8), expected)
