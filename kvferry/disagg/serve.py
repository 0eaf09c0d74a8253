"""Running the two roles: a context engine in its own OS process, or both in one process.

``python -m kvferry.disagg.serve --transport ucx --tp 2 ...`` starts a context engine, prints one line
``kvferry-context {"address": ..., "pid": ...}`` on stdout, serves the first generation peer that connects and
exits when that peer goes away (or stdin closes, also before a peer connected). :func:`start_context_process`
launches it; :func:`disaggregated` gives a connected :class:`~.router.Router` either way.

Deadlines: every wait on the other side is bounded (see :class:`~.roles.GenerationWorker`); here, the context
process has ``start_timeout`` seconds to say where it listens, and :func:`disaggregated` passes its
``prefill_timeout``, ``handshake_timeout`` and ``control_timeout`` to the workers it builds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import IO, Any

import anyio
import attrs
from attrs import define

from kvferry._stdio import reserve_stdout
from kvferry.disagg.mapping import BouncePolicy
from kvferry.disagg.roles import (
    DEFAULT_CONTROL_TIMEOUT,
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_PREFILL_TIMEOUT,
    DEFAULT_STAGING_BYTES,
    ContextWorker,
    GenerationWorker,
)
from kvferry.disagg.router import DEFAULT_CONTEXT_WINDOW, Router
from kvferry.disagg.transfer import DEFAULT_CHUNK_BYTES, DEFAULT_DEVICE_CHUNK_BYTES
from kvferry.engine.runner import EngineOptions, build_engine
from kvferry.errors import ConfigError, KvferryError, PeerDisconnected, PeerTimeout
from kvferry.transports import get_transport
from kvferry.transports.handshake import SECRET_ENV, SECRET_FILE_ENV, load_secret, new_secret

__all__ = [
    "DEFAULT_START_TIMEOUT",
    "ContextProcess",
    "disaggregated",
    "main",
    "serve_context",
    "start_context_process",
]

log = logging.getLogger("kvferry.disagg")

_MARKER = "kvferry-context "

#: Seconds a context process has to print its address (imports, engine build, transport start).
DEFAULT_START_TIMEOUT = 120.0


def _options(
    tp: int,
    spec_k: int,
    seed: int,
    dtype: str,
    *,
    num_pages: int = 512,
    max_running: int = 16,
    device: str = "cpu",
) -> EngineOptions:
    return EngineOptions(
        tp=tp,
        dtype=dtype,
        seed=seed,
        device=device,
        max_spec_k=spec_k,
        num_pages=num_pages,
        max_running=max_running,
    )


async def serve_context(
    model: str,
    options: EngineOptions,
    *,
    transport: str = "auto",
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    secret: bytes | None = None,
    on_listening: Callable[[str], None] | None = None,
    on_worker: Callable[[ContextWorker], None] | None = None,
    once: bool = False,
    write_delay: float = 0.0,
    chunk_bytes: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    bounce: BouncePolicy | None = None,
) -> None:
    """Run a context engine for ``model``: listen on ``host:port`` over ``transport`` and serve every generation
        engine that connects, each in its own task, until cancelled (``once``: serve the first one, return when it
        goes away). ``on_listening(address)`` is called once the memory is registered and the transport listens;
    ``on_worker(worker)`` just before it, with the :class:`~.roles.ContextWorker` (its engine, transport and counts).

        A peer that fails its handshake (another model, a wrong secret) or goes away costs the others nothing: its
        prefills and pushes are cancelled and what it held is freed; the failure is logged in one line. A cancel
        stops every peer's work, the engine and the transport.

        :raises ~kvferry.errors.ConfigError: a bad model, option or listening address (nothing was started).
    """
    built = build_engine(model, options)
    factory = get_transport(transport)
    listen = {"host": host, "port": port, "advertise_host": advertise_host} if transport != "local" else {}
    async with factory(secret=secret, **listen) as tx, built.engine:
        worker = ContextWorker(
            built,
            tx,
            max_chunk_bytes=chunk_bytes,
            write_delay=write_delay,
            staging_bytes=staging_bytes,
            bounce=BouncePolicy() if bounce is None else bounce,
        )
        await worker.register()  # once, before anyone connects
        if on_worker is not None:
            on_worker(worker)
        if on_listening is not None:
            on_listening(tx.address)
        if once:
            await worker.serve(await tx.accept())
            return
        async with anyio.create_task_group() as peers:
            while True:
                peers.start_soon(_serve_peer, worker, await tx.accept())


async def _serve_peer(worker: ContextWorker, peer: Any) -> None:
    try:
        await worker.serve(peer)
    except* KvferryError as failures:  # a push task's failure comes grouped: it must not end the others
        exc = _first_leaf(failures)
        log.warning("generation peer %s: %s: %s", getattr(peer, "address", peer), type(exc).__name__, exc)
    finally:
        with anyio.CancelScope(shield=True), contextlib.suppress(KvferryError):
            await peer.aclose()


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def _serve_context(
    transport_name: str,
    options: EngineOptions,
    out: IO[str],
    *,
    model: str = "tiny",
    host: str = "127.0.0.1",
    port: int = 0,
    advertise_host: str | None = None,
    forever: bool = False,
    write_delay: float = 0.0,
    chunk_bytes: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    bounce: BouncePolicy | None = None,
    secret: bytes | None = None,
) -> None:
    def listening(address: str) -> None:
        out.write(_MARKER + json.dumps({"address": address, "pid": os.getpid()}) + "\n")
        out.flush()

    async with anyio.create_task_group() as tg:

        async def stdin_closed() -> None:
            await anyio.to_thread.run_sync(sys.stdin.read, abandon_on_cancel=True)
            tg.cancel_scope.cancel()

        # the parent closing stdin ends the wait for its connection too (it may never come)
        tg.start_soon(stdin_closed)
        await serve_context(
            model,
            options,
            transport=transport_name,
            host=host,
            port=port,
            advertise_host=advertise_host,
            secret=secret,
            on_listening=listening,
            once=not forever,
            write_delay=write_delay,
            chunk_bytes=chunk_bytes,
            staging_bytes=staging_bytes,
            bounce=bounce,
        )
        tg.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvferry.disagg.serve")
    parser.add_argument("--transport", default="auto")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free one)")
    parser.add_argument("--advertise-host", default=None, help="the host put in the address peers connect to")
    parser.add_argument(
        "--forever",
        action="store_true",
        help="serve every generation peer until stdin closes, not only the first",
    )
    parser.add_argument("--num-pages", type=int, default=512)
    parser.add_argument("--max-running", type=int, default=16)
    parser.add_argument(
        "--secret-file",
        default=None,
        help=f"the secret shared with the generation engine (default: ${SECRET_FILE_ENV}, then ${SECRET_ENV})",
    )
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--spec-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float64")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
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
    options = _options(
        args.tp,
        args.spec_k,
        args.seed,
        args.dtype,
        num_pages=args.num_pages,
        max_running=args.max_running,
        device=args.device,
    )
    try:
        anyio.run(
            partial(
                _serve_context,
                args.transport,
                options,
                out,
                model=args.model,
                host=args.host,
                port=args.port,
                advertise_host=args.advertise_host,
                forever=args.forever,
                write_delay=args.write_delay,
                chunk_bytes=args.chunk_bytes or None,
                staging_bytes=args.staging_bytes,
                bounce=BouncePolicy(args.bounce_min_fragments, args.bounce_max_mean_bytes),
                secret=load_secret(args.secret_file),
            )
        )
    except BaseException as exc:
        from kvferry.exits import exit_status

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
    model: str = "tiny",
    num_pages: int = 512,
    max_running: int = 16,
    device: str = "cpu",
    write_delay: float = 0.0,
    chunk_bytes: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    bounce: BouncePolicy | None = None,
    secret: bytes | None = None,
    start_timeout: float = DEFAULT_START_TIMEOUT,
) -> ContextProcess:
    """Launch ``python -m kvferry.disagg.serve`` and wait (at most ``start_timeout`` seconds) for its
    address. ``secret`` (authenticate the peers with it) travels in the child's environment, never on its
    command line.

    :raises ~kvferry.errors.PeerTimeout: it did not tell its address within ``start_timeout`` seconds (it is
        killed).
    :raises ~kvferry.errors.PeerDisconnected: it exited before telling its address.
    """
    if not start_timeout > 0:
        raise ConfigError(f"start_timeout must be > 0 seconds, got {start_timeout}")
    policy = BouncePolicy() if bounce is None else bounce
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvferry.disagg.serve",
            "--transport",
            transport,
            "--model",
            model,
            "--num-pages",
            str(num_pages),
            "--max-running",
            str(max_running),
            "--tp",
            str(tp),
            "--spec-k",
            str(spec_k),
            "--seed",
            str(seed),
            "--dtype",
            dtype,
            "--device",
            device,
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
        env=_child_environment(secret),
    )
    try:
        info = _await_address(proc, start_timeout)
    except BaseException:
        proc.kill()
        proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()
        raise
    return ContextProcess(proc, info["address"], info["pid"])


def _child_environment(secret: bytes | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, SECRET_FILE_ENV)}
    if secret is not None:
        env[SECRET_ENV] = secret.decode()
    return env


def _await_address(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    """The JSON object of ``proc``'s marker line on its stdout, within ``timeout`` seconds (else ``proc`` is
    killed, which ends the read)."""
    assert proc.stdout is not None
    late = threading.Event()

    def kill() -> None:
        late.set()
        proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.daemon = True
    timer.start()
    try:
        while True:  # libraries may print to stdout before us: our line carries a marker
            line = proc.stdout.readline()
            if line.startswith(_MARKER):
                break
            if not line:
                proc.wait()
                if late.is_set():
                    raise PeerTimeout(f"the context process did not listen within {timeout} s (killed)")
                raise PeerDisconnected(f"the context process exited with {proc.returncode} before listening")
    finally:
        timer.cancel()
    if late.is_set():  # the deadline passed right as the line came: the process is being killed
        raise PeerTimeout(f"the context process did not listen within {timeout} s (killed)")
    info: dict[str, Any] = json.loads(line[len(_MARKER) :])
    return info


@asynccontextmanager
async def disaggregated(
    *,
    model: str = "tiny",
    options: EngineOptions | None = None,
    ctx_num_pages: int = 0,
    ctx_device: str | None = None,
    contexts: Sequence[str] = (),
    context_window: int = DEFAULT_CONTEXT_WINDOW,
    transport: str = "auto",
    ctx_tp: int = 1,
    gen_tp: int = 1,
    spec_k: int = 0,
    seed: int = 0,
    dtype: str = "float64",
    device: str = "cpu",
    separate_process: bool = True,
    stall_timeout: float = 30.0,
    write_delay: float = 0.0,
    chunk_bytes: int | None = None,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    bounce: BouncePolicy | None = None,
    secret: bytes | None = None,
    authenticate: bool = True,
    prefill_timeout: float = DEFAULT_PREFILL_TIMEOUT,
    handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
    control_timeout: float = DEFAULT_CONTROL_TIMEOUT,
    start_timeout: float = DEFAULT_START_TIMEOUT,
) -> AsyncIterator[tuple[Router, dict[str, Any]]]:
    """A :class:`~.router.Router` over a context engine (another process, or this one with
    ``separate_process=False``) and a generation engine in this process. Yields (router, parts) where parts
    holds ``worker`` (the GenerationWorker), ``context`` (ContextWorker or ContextProcess), ``gen`` (its
    BuiltEngine) and ``transport`` (the generation side's).

    ``staging_bytes``: each side's staging pool; ``bounce`` (default :class:`~.mapping.BouncePolicy`): the
    policy of both sides (``BouncePolicy.always()`` bounces every writer with bytes while the pools have
    room). Each worker registers its memory before its handshake (and again after a rebalance).

    The two sides authenticate each other with ``secret`` (a fresh random one by default); ``authenticate=False``
    runs them without (loopback only).

    Deadlines (seconds; see :class:`~.roles.GenerationWorker`): ``prefill_timeout`` (a prefill's answer),
    ``handshake_timeout`` (each side's handshake), ``control_timeout`` (best-effort control messages, each
    side), ``stall_timeout`` (a transfer's reports), ``start_timeout`` (the context process's start).

    ``model``: a preset or a checkpoint directory, for both engines. ``options`` sizes the generation engine
    (its ``tp``, ``max_spec_k``, ``seed``, ``dtype`` and ``device`` then replace ``gen_tp``, ``spec_k``,
    ``seed``, ``dtype`` and ``device``; its steps always run on the event loop); the context engine gets the
    same (dtype included, also in its own process) with ``ctx_tp`` ranks, ``ctx_num_pages`` pages (0: the same
    number) and its weights and caches on ``ctx_device`` (None: the generation engine's device; ``cuda:0`` for
    the context engine and ``cuda:1`` for the generation engine put the two on their own GPUs).

    ``contexts``: the transport addresses of running context engines (:func:`serve_context`, ``kvferry serve
    --role context``) to connect to instead of starting one; requests are spread over them
    (:meth:`~.router.Router.pick`). They need the secret they were started with (``secret``, else the one
    :func:`~kvferry.transports.handshake.load_secret` finds). ``context_window``: requests each context engine is
    asked to work on at once (:class:`~.router.Router`)."""
    policy = BouncePolicy() if bounce is None else bounce
    if secret is None and contexts:
        secret = load_secret(None)
        if secret is None and authenticate:
            raise ConfigError(
                f"connecting to running context engines needs their secret (--secret-file, ${SECRET_FILE_ENV} "
                f"or ${SECRET_ENV})"
            )
    if secret is None and authenticate:
        secret = new_secret()
    if options is None:
        options = _options(gen_tp, spec_k, seed, dtype, device=device)
    spec_k, seed, dtype = options.max_spec_k, options.seed, options.dtype
    ctx_options = attrs.evolve(
        options,
        tp=ctx_tp,
        num_pages=ctx_num_pages or options.num_pages,
        device=options.device if ctx_device is None else ctx_device,
    )
    gen = build_engine(model, options)
    factory = get_transport(transport)
    context_process: ContextProcess | None = None
    try:
        async with factory(secret=secret) as gen_transport, gen.engine, anyio.create_task_group() as tg:
            worker = GenerationWorker(
                gen,
                gen_transport,
                stall_timeout=stall_timeout,
                staging_bytes=staging_bytes,
                bounce=policy,
                prefill_timeout=prefill_timeout,
                handshake_timeout=handshake_timeout,
                control_timeout=control_timeout,
            )
            await worker.register()
            parts: dict[str, Any] = {"worker": worker, "gen": gen, "transport": gen_transport}
            if contexts:
                peers = []
                for address in contexts:
                    peers.append(await gen_transport.connect(address))
                    await worker.connect(peers[-1], tg)
                yield Router(worker, context_window), parts
                for peer in peers:
                    await peer.aclose()
            elif separate_process:
                context_process = await anyio.to_thread.run_sync(
                    partial(
                        start_context_process,
                        transport,
                        ctx_tp,
                        spec_k,
                        seed,
                        dtype,
                        model=model,
                        num_pages=ctx_options.num_pages,
                        max_running=ctx_options.max_running,
                        device=ctx_options.device,
                        write_delay=write_delay,
                        chunk_bytes=chunk_bytes,
                        staging_bytes=staging_bytes,
                        bounce=policy,
                        secret=secret,
                        start_timeout=start_timeout,
                    )
                )
                parts["context"] = context_process
                peer = await gen_transport.connect(context_process.address)
                await worker.connect(peer, tg)
                yield Router(worker, context_window), parts
                await peer.aclose()
            else:
                ctx = build_engine(model, ctx_options)
                async with factory(secret=secret) as ctx_transport, ctx.engine:
                    context = ContextWorker(
                        ctx,
                        ctx_transport,
                        max_chunk_bytes=chunk_bytes,
                        write_delay=write_delay,
                        staging_bytes=staging_bytes,
                        bounce=policy,
                        handshake_timeout=handshake_timeout,
                        control_timeout=control_timeout,
                    )
                    await context.register()
                    parts["context"] = context
                    parts["ctx"] = ctx
                    peer = await gen_transport.connect(ctx_transport.address)
                    ctx_peer = await ctx_transport.accept()
                    tg.start_soon(context.serve, ctx_peer)
                    await worker.connect(peer, tg)
                    yield Router(worker, context_window), parts
                    await peer.aclose()
            tg.cancel_scope.cancel()
    finally:
        if context_process is not None:
            await anyio.to_thread.run_sync(context_process.close)


if __name__ == "__main__":
    sys.exit(main())
