"""A generation engine in a process of its own, driven by JSON lines on stdin, for the separate-hosts tests.

Run as ``python tests/support/generation_peer.py TRANSPORT`` with the secret in ``$KVFERRY_SECRET``. It builds a
tiny float64 generation engine (spec_k 2) and its transport, prints ``@@{"ready": true, "pid_namespace": N}``
and then takes one command per line; every command carries an ``id``, echoed in its answer (a line ``@@{...}``)
when it ends, so that several can run at once:

- ``{"op": "connect", "address": A}``: connect to a context engine (one more); answers ``same_host`` (the
  handshake proved it on this host, in this PID namespace) and the peer's ``pid_namespace``;
- ``{"op": "generate", "prompt": [...], "max_tokens": N}``: a request routed over the connected context engines;
  answers ``tokens``, or ``error`` (the exception's class name), ``kinds`` (the names of its classes, its
  bases too), ``typed`` (a KvferryError) and ``message``;
- ``{"op": "local", ...}``: the same on the generation engine alone (no context engine);
- ``{"op": "mid_transfer"}``: answers once some chunk of a transfer has landed and some has not;
- ``{"op": "idle"}``: answers once the engine is idle, with every link's and the receiver's state and the
  same-host copies its transport made (``cma_writes`` of NIXL, ``cma_reads`` of UCX);
- ``{"op": "exit"}`` (or stdin closed): stop.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import anyio
import anyio.abc

from kvferry._stdio import quiet_library_env, reserve_stdout
from kvferry.disagg.roles import GenerationWorker
from kvferry.disagg.router import Router
from kvferry.disagg.serve import _options
from kvferry.disagg.session import ReceiveState
from kvferry.engine.runner import BuiltEngine, build_engine
from kvferry.errors import KvferryError
from kvferry.transports import Transport, get_transport
from kvferry.transports.handshake import load_secret, pid_namespace

SPEC_K = 2
#: seconds a transfer may go without a report before it is in doubt
STALL_TIMEOUT = 20.0


class Driver:
    def __init__(self, built: BuiltEngine, worker: GenerationWorker, tg: anyio.abc.TaskGroup) -> None:
        self.built = built
        self.worker = worker
        self.router = Router(worker)
        self.tg = tg
        self.out = reserve_stdout()
        self.lock = anyio.Lock()

    async def answer(self, reply: dict[str, Any]) -> None:
        async with self.lock:
            self.out.write("@@" + json.dumps(reply) + "\n")
            self.out.flush()

    async def run(self, command: dict[str, Any]) -> None:
        reply: dict[str, Any] = {"id": command["id"]}
        try:
            reply.update(await self.handle(command))
        except Exception as exc:
            reply.update(
                error=type(exc).__name__,
                kinds=[kind.__name__ for kind in type(exc).__mro__],
                typed=isinstance(exc, KvferryError),
                message=str(exc),
            )
        await self.answer(reply)

    async def handle(self, command: dict[str, Any]) -> dict[str, Any]:
        op = command["op"]
        transport: Transport = self.worker.transport
        if op == "connect":
            peer = await transport.connect(command["address"])
            remote = await self.worker.connect(peer, self.tg)
            return {
                "same_host": bool(getattr(peer, "same_host", True)),
                "pid_namespace": getattr(getattr(peer, "hello", None), "pid_namespace", None),
                "context": remote.transport_address,
            }
        if op == "generate":
            routed = self.router.generate(command["prompt"], max_tokens=command["max_tokens"], spec_k=SPEC_K)
            return {"tokens": await routed.collect()}
        if op == "local":
            local = self.built.engine.generate(
                command["prompt"], max_tokens=command["max_tokens"], spec_k=SPEC_K
            )
            return {"tokens": await local.collect()}
        if op == "mid_transfer":
            while not self.mid_transfer():  # noqa: ASYNC110
                await anyio.sleep(0.005)
            return {}
        if op == "idle":
            await self.built.engine.wait_idle()
            return {
                "links": [{"gone": link.gone, "in_flight": link.in_flight} for link in self.worker.links],
                "sessions": [link.receiver.statistics()["sessions"] for link in self.worker.links],
                "cma_writes": getattr(transport, "cma_writes", 0),
                "cma_reads": getattr(transport, "cma_reads", 0),
            }
        raise ValueError(f"unknown op {op!r}")

    def mid_transfer(self) -> bool:
        for link in self.worker.links:
            for live in link.receiver._sessions.values():
                if live.session.state is ReceiveState.REQUESTED and live.session._reports:
                    return True
        return False


async def main(transport_name: str) -> None:
    secret = load_secret(None)
    built = build_engine("tiny", _options(1, SPEC_K, 0, "float64"))
    async with (
        get_transport(transport_name)(secret=secret) as transport,
        built.engine,
        anyio.create_task_group() as tg,
    ):
        worker = GenerationWorker(built, transport, stall_timeout=STALL_TIMEOUT)
        await worker.register()
        driver = Driver(built, worker, tg)
        await driver.answer({"ready": True, "pid": os.getpid(), "pid_namespace": pid_namespace()})
        while True:
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line or json.loads(line)["op"] == "exit":
                break
            tg.start_soon(driver.run, json.loads(line))
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    quiet_library_env()
    anyio.run(main, sys.argv[1])
