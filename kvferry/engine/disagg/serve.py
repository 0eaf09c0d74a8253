"""Running the two roles: a context engine in its own OS process, or both in one process.

``python -m kvferry.engine.disagg.serve --transport ucx --tp 2 ...`` starts a context engine, prints one line
``kvferry-context {"address": ..., "pid": ...}`` on stdout, serves the first generation peer that connects and
exits when that peer goes away (or stdin closes). :func:`start_context_process` launches it; :func:`disaggregated` gives a
connected :class:`~.router.Router` either way.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import IO, Any

import anyio
from attrs import define

from kvferry._stdio import reserve_stdout
from kvferry.engine.disagg.mapping import BouncePolicy
from kvferry.engine.disagg.roles import DEFAULT_STAGING_BYTES, ContextWorker, GenerationWorker
from kvferry.engine.disagg.router import Router
from kvferry.engine.disagg.transfer import DEFAULT_CHUNK_BYTES, DEFAULT_DEVICE_CHUNK_BYTES
from kvferry.engine.runner import EngineOptions, build_engine
from kvferry.errors import PeerDisconnected
from kvferry.transports import get_transport

__all__ = ["ContextProcess", "disaggregated", "main", "start_context_process"]

_MARKER = "kvferry-context "


def _options(tp: int, spec_k: int, seed: int, dtype: str) -> EngineOptions:
    return EngineOptions(
        tp=tp, dtype=dtype, seed=seed, max_spec_k=spec_k, step_in_thread=False, num_pages=512
    )


async def _serve_context(
    transport_name: str,
    options: EngineOptions,
    out: IO[str],
    *,
    write_delay: float = 0.0,
    chunk_bytes: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    bounce: BouncePolicy | None = None,
) -> None:
    built = build_engine("tiny", options)
    async with get_transport(transport_name)() as transport, built.engine:
        worker = ContextWorker(
            built,
            transport,
            max_chunk_bytes=chunk_bytes,
            write_delay=write_delay,
            staging_bytes=staging_bytes,
            bounce=BouncePolicy() if bounce is None else bounce,
        )
        await worker.register()  # once, before anyone connects
        out.write(_MARKER + json.dumps({"address": transport.address, "pid": os.getpid()}) + "\n")
        out.flush()
        peer = await transport.accept()
        async with anyio.create_task_group() as tg:

            async def stdin_closed() -> None:
                await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
                tg.cancel_scope.cancel()

            tg.start_soon(stdin_closed)
            await worker.serve(peer)
            tg.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.engine.disagg.serve")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--spec-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float64")
    parser.add_argument(
        "--chunk-bytes",
        type=int,
        default=0,
        help="bytes per transfer chunk (0: one write per direct writer, "
        f"{DEFAULT_CHUNK_BYTES} bytes per bounced chunk of host memory, {DEFAULT_DEVICE_CHUNK_BYTES} of device memory)",
    )
    parser.add_argument("--write-delay", type=float, default=0.0, help="seconds before each chunk (tests)")
    parser.add_argument(
        "--staging-bytes", type=int, default=DEFAULT_STAGING_BYTES, help="staging pool bytes (0: no bounce)"
    )
    default = BouncePolicy()
    parser.add_argument(
        "--bounce-min-fragments",
        type=int,
        default=default.min_fragments,
        help="bounce policy (see BouncePolicy)",
    )
    parser.add_argument("--bounce-max-mean-bytes", type=int, default=default.max_mean_bytes)
    args = parser.parse_args(argv)
    # the parent ends us by closing stdin: a Ctrl-C meant for it must not kill us with a traceback; our
    # address line goes to the original stdout, everything the libraries print to stderr
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = reserve_stdout()
    options = _options(args.tp, args.spec_k, args.seed, args.dtype)
    try:
        anyio.run(
            partial(
                _serve_context,
                args.transport,
                options,
                out,
                write_delay=args.write_delay,
                chunk_bytes=args.chunk_bytes or None,
                staging_bytes=args.staging_bytes,
                bounce=BouncePolicy(args.bounce_min_fragments, args.bounce_max_mean_bytes),
            )
        )
    except BaseException as exc:
        from kvferry.cli import exit_status

        # one line on stderr for a typed failure (the usual one: the generation side went away)
        return exit_status("context engine", exc)
    return 0


@define(eq=False)
class ContextProcess:
    """A context engine in another OS process (``proc``), listening at ``address``."""

    proc: subprocess.Popen[str]
    address: str
    pid: int

    def kill(self) -> None:
        self.proc.kill()

    def close(self) -> None:
        """Close its stdin (it exits), wait a little, kill it if it does not."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_context_process(
    transport: str,
    tp: int,
    spec_k: int,
    seed: int,
    dtype: str = "float64",
    *,
    write_delay: float = 0.0,
    chunk_bytes: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    bounce: BouncePolicy | None = None,
) -> ContextProcess:
    """Launch ``python -m kvferry.engine.disagg.serve`` and wait for its address.

    :raises ~kvferry.errors.PeerDisconnected: it exited before telling its address.
    """
    policy = BouncePolicy() if bounce is None else bounce
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvferry.engine.disagg.serve",
            "--transport",
            transport,
            "--tp",
            str(tp),
            "--spec-k",
            str(spec_k),
            "--seed",
            str(seed),
            "--dtype",
            dtype,
            "--write-delay",
            str(write_delay),
            "--chunk-bytes",
            str(chunk_bytes or 0),
            "--staging-bytes",
            str(staging_bytes),
            "--bounce-min-fragments",
            str(policy.min_fragments),
            "--bounce-max-mean-bytes",
            str(policy.max_mean_bytes),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    while True:  # libraries may print to stdout before us: our line carries a marker
        line = proc.stdout.readline()
        if not line:
            proc.wait()
            raise PeerDisconnected(f"the context process exited with {proc.returncode} before listening")
        if line.startswith(_MARKER):
            break
    info = json.loads(line[len(_MARKER) :])
    return ContextProcess(proc, info["address"], info["pid"])


@asynccontextmanager
async def disaggregated(
    *,
    transport: str = "auto",
    ctx_tp: int = 1,
    gen_tp: int = 1,
    spec_k: int = 0,
    seed: int = 0,
    dtype: str = "float64",
    separate_process: bool = True,
    stall_timeout: float = 30.0,
    write_delay: float = 0.0,
    chunk_bytes: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    bounce: BouncePolicy | None = None,
) -> AsyncIterator[tuple[Router, dict[str, Any]]]:
    """A :class:`~.router.Router` over a context engine (another process, or this one with
    ``separate_process=False``) and a generation engine in this process. Yields (router, parts) where parts
    holds ``worker`` (the GenerationWorker), ``context`` (ContextWorker or ContextProcess), ``gen`` (its
    BuiltEngine) and ``transport`` (the generation side's).

    ``staging_bytes``: each side's staging pool; ``bounce`` (default :class:`~.mapping.BouncePolicy`): the
    policy of both sides (``BouncePolicy.always()`` bounces every writer with bytes while the pools have
    room). Each worker registers its memory once, before its handshake, for the life of its transport."""
    policy = BouncePolicy() if bounce is None else bounce
    gen = build_engine("tiny", _options(gen_tp, spec_k, seed, dtype))
    factory = get_transport(transport)
    context_process: ContextProcess | None = None
    try:
        async with factory() as gen_transport, gen.engine, anyio.create_task_group() as tg:
            worker = GenerationWorker(
                gen, gen_transport, stall_timeout=stall_timeout, staging_bytes=staging_bytes, bounce=policy
            )
            await worker.register()
            parts: dict[str, Any] = {"worker": worker, "gen": gen, "transport": gen_transport}
            if separate_process:
                context_process = await anyio.to_thread.run_sync(
                    partial(
                        start_context_process,
                        transport,
                        ctx_tp,
                        spec_k,
                        seed,
                        dtype,
                        write_delay=write_delay,
                        chunk_bytes=chunk_bytes,
                        staging_bytes=staging_bytes,
                        bounce=policy,
                    )
                )
                parts["context"] = context_process
                peer = await gen_transport.connect(context_process.address)
                await worker.connect(peer, tg)
                yield Router(worker), parts
                await peer.aclose()
            else:
                ctx = build_engine("tiny", _options(ctx_tp, spec_k, seed, dtype))
                async with factory() as ctx_transport, ctx.engine:
                    context = ContextWorker(
                        ctx,
                        ctx_transport,
                        max_chunk_bytes=chunk_bytes,
                        write_delay=write_delay,
                        staging_bytes=staging_bytes,
                        bounce=policy,
                    )
                    await context.register()
                    parts["context"] = context
                    parts["ctx"] = ctx
                    peer = await gen_transport.connect(ctx_transport.address)
                    ctx_peer = await ctx_transport.accept()
                    tg.start_soon(context.serve, ctx_peer)
                    await worker.connect(peer, tg)
                    yield Router(worker), parts
                    await peer.aclose()
            tg.cancel_scope.cancel()
    finally:
        if context_process is not None:
            await anyio.to_thread.run_sync(context_process.close)


if __name__ == "__main__":
    sys.exit(main())
