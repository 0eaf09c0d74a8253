"""Both ends of test_ucx_peer_death.py, each run as a script in its own process (UCX state stays per process).

``PATH`` says how the bytes travel: ``pull`` (the default transport: the receiver reads the writer's memory with
its own ``process_vm_readv``), ``messages`` (``host_cma=False, cma=False``: UCX messages, without UCX's CMA),
``messages-cma`` (``host_cma=False``: UCX messages; UCX may read the writer's memory by CMA, and UCX 1.21 aborts
the reading process if that read finds the writer dead: exit status 134) or ``cuda`` (the default transport with
CUDA memory at both ends, one GPU: UCX messages by CUDA IPC).

- ``python ucx_peer_death.py receive MOMENT PATH``: a ucx transport that starts a writer process, takes one
  whole write of ``NBYTES`` from it, kills it ``MOMENT`` seconds into the next one, then checks that the peer is
  lost with a typed error and the write it was receiving has ended; prints ``survived``, then the CPU seconds
  this process spent over one idle second after that (``idle-cpu S``), and exits 0;
- ``python ucx_peer_death.py write ADDRESS PATH``: the writer, writing ``NBYTES`` as one fragment until killed;
- ``python ucx_peer_death.py config [cma]``: starts a ucx transport (``cma=True`` if asked) and prints the UCX
  transports (``TLS``) of the UCXX context it started.

With ucxx alone, a receive posted while the writer sends continuously and a kill right after it aborted the
receiver in 3 runs of 3 with CMA, and in none of 6 without.
"""

from __future__ import annotations

import resource
import sys
import time

import anyio
import torch

from kvferry.errors import PeerDisconnected
from kvferry.transports import PeerState, get_transport

NBYTES = 128 << 20
OPTIONS = {
    "pull": {},
    "messages": {"host_cma": False, "cma": False},
    "messages-cma": {"host_cma": False},
    "cuda": {},
}


def device(path: str) -> str:
    return "cuda" if path == "cuda" else "cpu"


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def write(address: str, path: str) -> None:
    async with get_transport("ucx")(**OPTIONS[path]) as transport:
        peer = await transport.connect(address)
        src = torch.ones(NBYTES, dtype=torch.uint8, device=device(path))
        await transport.register(src)
        dst = int(await transport.receive_message(peer))
        while True:
            await transport.write(peer, [[src.data_ptr(), NBYTES]], [[dst, NBYTES]], b"written")


async def receive(moment: float, path: str) -> None:
    async with get_transport("ucx")(**OPTIONS[path]) as transport:
        writer = await anyio.open_process([sys.executable, __file__, "write", transport.address, path])
        try:
            with anyio.fail_after(60):
                peer = await transport.accept()
                dst = torch.zeros(NBYTES, dtype=torch.uint8, device=device(path))
                await transport.grant(peer, await transport.register(dst))
                await transport.send_message(peer, str(dst.data_ptr()).encode())
                assert await transport.receive_notification(peer) == b"written"
                assert bool((dst == 1).all())
                # the next write follows at once: kill the writer while its message is on the way
                await anyio.sleep(moment)
                writer.kill()
                try:
                    while True:
                        await transport.receive_notification(peer)
                except PeerDisconnected:
                    pass
                assert peer.state is PeerState.LOST
                while transport.statistics().incoming_writes:  # noqa: ASYNC110 (the write it was receiving ends)
                    await anyio.sleep(0.01)
                print("survived", flush=True)
                before, start = cpu_seconds(), time.monotonic()
                await anyio.sleep(1.0)
                print(f"idle-cpu {(cpu_seconds() - before) / (time.monotonic() - start):.3f}", flush=True)
        finally:
            with anyio.CancelScope(shield=True):
                if writer.returncode is None:
                    writer.kill()
                await writer.wait()


async def config(cma: bool) -> None:
    import ucxx

    async with get_transport("ucx")(cma=cma):
        print(ucxx.get_config().get("TLS", ""), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "config":
        anyio.run(config, sys.argv[-1] == "cma")
    elif sys.argv[1] == "write":
        anyio.run(write, sys.argv[2], sys.argv[3])
    else:
        anyio.run(receive, float(sys.argv[2]), sys.argv[3])
