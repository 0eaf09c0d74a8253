"""``kvferry serve``: an OpenAI-compatible HTTP server (``/v1/completions``, ``/v1/models``, ``/health``,
``/metrics``) over one aggregated engine, or disaggregated with ``--disagg``.

Once it listens it prints one line on stderr, ``kvferry serve: listening on http://HOST:PORT (...)`` (with
``--port 0``, the port the system picked). SIGINT or SIGTERM stops it: it stops accepting, every running
request is cancelled (an open stream ends with an error event and ``data: [DONE]``), the engines stop and the
transports close; the exit status is then 0. A second signal stops waiting for responses to end.

With ``--disagg``, ``--gen-tp`` sizes the generation engine (this process) and ``--ctx-tp`` the context engine;
``--tp`` is refused there, so that a flag means one thing. ``--device`` and ``--dtype`` apply to every engine
(the context engine's process too).
"""

from __future__ import annotations

import argparse
import signal
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING

from kvferry.commands import serve_roles
from kvferry.commands._common import (
    add_device_arguments,
    check_device,
    check_model,
    non_negative_int,
    positive_int,
    resolve_transport,
    say,
    seed_int,
)
from kvferry.errors import ConfigError, MissingExtraError

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from kvferry.engine.runner import EngineOptions
    from kvferry.serving import Service
    from kvferry.serving.http import HttpServer

#: the transports --disagg may use (auto: nixl, else ucx, else local in this process)
TRANSPORTS = ("auto", "nixl", "ucx", "local")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="a preset: tiny (the seeded reference model), nemotron-h-1b, nemotron-h-8b (seeded weights at real "
        "proportions); or a local transformers NemotronH checkpoint directory",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=non_negative_int, default=8000, help="port to listen on (0: any free port)"
    )
    parser.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        metavar="N",
        help="simulated tensor-parallel ranks (default 1)",
    )
    parser.add_argument(
        "--spec-k", type=non_negative_int, default=0, metavar="K", help="draft tokens per step (0: off)"
    )
    parser.add_argument(
        "--num-pages", type=positive_int, default=512, metavar="N", help="attention pages per rank"
    )
    parser.add_argument(
        "--max-running", type=positive_int, default=16, metavar="N", help="requests decoded together"
    )
    parser.add_argument(
        "--max-queued",
        type=positive_int,
        default=1024,
        metavar="N",
        help="requests waiting for admission past which new ones get 503",
    )
    add_device_arguments(parser)
    parser.add_argument(
        "--weights-seed", type=seed_int, default=0, metavar="S", help="seed of a preset's weights"
    )
    disagg = parser.add_argument_group("disaggregated serving")
    disagg.add_argument(
        "--disagg",
        action="store_true",
        help="a context engine prefills, its cache moves over --transport, this process decodes",
    )
    disagg.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default=None,
        help="auto (default): nixl, else ucx; without either the context engine runs in this process over local",
    )
    disagg.add_argument(
        "--ctx-tp", type=positive_int, default=None, metavar="N", help="context engine TP ranks (default 1)"
    )
    disagg.add_argument(
        "--ctx-device",
        default=None,
        metavar="DEVICE",
        help="the context engine's device (default: --device; cuda:0 here and --device cuda:1: one GPU each)",
    )
    serve_roles.add_arguments(parser)
    disagg.add_argument(
        "--gen-tp",
        type=positive_int,
        default=None,
        metavar="M",
        help="generation engine TP ranks (default 1)",
    )


def engine_options(args: argparse.Namespace, tp: int) -> EngineOptions:
    """The engine the flags size (``tp`` ranks)."""
    from kvferry.engine.runner import EngineOptions

    return EngineOptions(
        tp=tp,
        dtype=args.dtype,
        device=args.device,
        seed=args.weights_seed,
        num_pages=args.num_pages,
        max_running=args.max_running,
        max_spec_k=args.spec_k,
    )


def open_service_from_args(args: argparse.Namespace) -> AbstractAsyncContextManager[Service]:
    """The service the arguments describe (not started: enter it). The one place that turns flags into
    :func:`~kvferry.serving.open_service` arguments; other roles (a context engine only, remote context
    engines) extend it here.

    :raises ~kvferry.errors.ConfigError: contradictory flags.
    """
    from kvferry.serving import DisaggOptions, open_service

    check_model(args.model)
    check_device(args.device)
    serve_roles.check(args)
    disagg_only = [
        flag
        for flag, value in (
            ("--transport", args.transport),
            ("--ctx-tp", args.ctx_tp),
            ("--ctx-device", args.ctx_device),
            ("--gen-tp", args.gen_tp),
        )
        if value is not None
    ]
    if args.ctx_device is not None:
        check_device(args.ctx_device, "--ctx-device")
    if args.role == "generation":
        disagg_only = [flag for flag in disagg_only if flag != "--transport"]
    if not args.disagg and disagg_only:
        raise ConfigError(f"{', '.join(disagg_only)} only apply with --disagg")
    if args.disagg and args.tp is not None:
        raise ConfigError("with --disagg give --gen-tp (and --ctx-tp) instead of --tp")
    tp = (args.gen_tp if args.disagg else args.tp) or 1
    engine = engine_options(args, tp)
    options = None
    if args.role == "generation":
        from kvferry.transports.handshake import load_secret

        transport, separate = resolve_transport(args.transport or "auto")
        if not separate:
            raise ConfigError("--role generation needs a cross-process transport (nixl or ucx)")
        options = DisaggOptions(
            transport=transport, contexts=tuple(args.context), secret=load_secret(args.secret_file)
        )
    elif args.disagg:
        transport, separate = resolve_transport(args.transport or "auto")
        options = DisaggOptions(
            transport=transport,
            ctx_tp=args.ctx_tp or 1,
            separate_process=separate,
            ctx_device=args.ctx_device,
        )
    return open_service(args.model, engine=engine, disagg=options, max_queued=args.max_queued)


def run(args: argparse.Namespace) -> int:
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise MissingExtraError(exc.name or "starlette", "serve") from None
    import anyio

    from kvferry._stdio import quiet_library_env

    quiet_library_env()  # before nixl or ucxx loads, and inherited by a context process it starts
    if args.role == "context":
        check_model(args.model)
        check_device(args.device)
        serve_roles.check(args)
        if args.gen_tp is not None or args.ctx_tp is not None:
            raise ConfigError("--role context: give its TP size with --tp")
        if args.ctx_device is not None:
            raise ConfigError("--role context: give its device with --device")
        anyio.run(serve_roles.run_context, args, engine_options(args, args.tp or 1))
        return 0
    anyio.run(_serve, args)
    return 0


async def _serve(args: argparse.Namespace) -> None:
    import anyio

    from kvferry.model.tokenizer import load_tokenizer
    from kvferry.serving.http import HttpServer, create_app, shut_down

    tokenizer = load_tokenizer(args.model)
    serving: list[tuple[Starlette, HttpServer]] = []  # once it listens
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    say(f"kvferry serve: {signal.Signals(signum).name}: shutting down")
                    if not serving:
                        tg.cancel_scope.cancel()  # still starting: leaving the block stops what started
                        return
                    app, server = serving[0]
                    shut_down(app)
                    server.stop()

            tg.start_soon(stop_on_signal)
            async with open_service_from_args(args) as service:
                app = create_app(service, tokenizer)
                server = HttpServer(app, args.host, args.port)
                serving.append((app, server))
                say(
                    f"kvferry serve: listening on {server.url} "
                    f"(model {service.model_name}, {service.backend.describe()})"
                )
                await server.serve()
            tg.cancel_scope.cancel()
