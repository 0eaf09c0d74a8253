"""The engine roles of ``kvferry serve`` for engines on separate hosts.

``kvferry serve --role context --listen HOST:PORT --transport nixl`` runs a context engine only: it listens on the
transport at ``HOST:PORT``, prints one line on stderr, ``kvferry serve: context engine listening at ADDRESS``
(ADDRESS is what a generation engine's ``--context`` takes), and serves every generation engine that connects
until SIGINT or SIGTERM (exit 0). ``kvferry serve --role generation --context ADDRESS [--context ADDRESS ...]``
runs the HTTP server over a generation engine fed by those context engines (requests are spread over them). Both
sides authenticate with the secret of ``--secret-file`` (else ``$KVFERRY_SECRET_FILE``, ``$KVFERRY_SECRET``); one is
required to listen on anything but loopback.
"""

from __future__ import annotations

import argparse
import signal
from typing import TYPE_CHECKING

from kvferry.commands._common import resolve_transport, say
from kvferry.errors import ConfigError

if TYPE_CHECKING:
    from kvferry.engine.runner import EngineOptions

ROLES = ("all", "context", "generation")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    roles = parser.add_argument_group("engines on separate hosts")
    roles.add_argument(
        "--role",
        choices=ROLES,
        default="all",
        help="all (default): the HTTP server and every engine here; context: a context engine only, listening "
        "on --listen; generation: the HTTP server over a generation engine fed by --context engines",
    )
    roles.add_argument(
        "--listen",
        default=None,
        metavar="HOST:PORT",
        help="--role context: where its transport listens (default 127.0.0.1:0, any free port)",
    )
    roles.add_argument(
        "--advertise-host",
        default=None,
        metavar="HOST",
        help="--role context: the host put in its address (default: the --listen host)",
    )
    roles.add_argument(
        "--context",
        action="append",
        default=None,
        metavar="ADDRESS",
        help="--role generation: a context engine's transport address (repeat for several)",
    )
    roles.add_argument(
        "--secret-file",
        default=None,
        metavar="PATH",
        help="the secret the engines authenticate with (default: $KVFERRY_SECRET_FILE, then $KVFERRY_SECRET)",
    )


def check(args: argparse.Namespace) -> None:
    """Refuse flags that do not belong to ``args.role``, before anything starts."""
    if args.role != "context" and (args.listen is not None or args.advertise_host is not None):
        raise ConfigError("--listen and --advertise-host only apply with --role context")
    if args.role != "generation" and args.context:
        raise ConfigError("--context only applies with --role generation")
    if args.role == "generation" and not args.context:
        raise ConfigError("--role generation needs at least one --context ADDRESS")
    if args.role != "all" and args.disagg:
        raise ConfigError(
            "--disagg starts both engines here; --role splits them over hosts: give one of them"
        )


def listen_address(text: str | None) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6 in brackets) -> (host, port); None -> loopback, any free port."""
    if text is None:
        return "127.0.0.1", 0
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"--listen {text!r}: expected HOST:PORT, e.g. 0.0.0.0:7400")
    return host.strip("[]"), int(port)


async def run_context(args: argparse.Namespace, engine_options: EngineOptions) -> None:
    """``--role context``: serve generation engines until SIGINT or SIGTERM."""
    import anyio

    from kvferry.disagg.serve import serve_context
    from kvferry.transports.handshake import load_secret

    host, port = listen_address(args.listen)
    secret = load_secret(args.secret_file)
    transport = args.transport or "auto"
    if transport == "auto":
        transport, separate = resolve_transport("auto")
        if not separate:
            raise ConfigError(
                "--role context needs a cross-process transport: install kvferry[nixl] or [ucx]"
            )
    if transport == "local":
        raise ConfigError("--role context needs a cross-process transport (nixl or ucx), not local")

    def listening(address: str) -> None:
        say(
            f"kvferry serve: context engine listening at {address} (model {args.model}, transport {transport})"
        )

    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:

            async def stop_on_signal() -> None:
                async for signum in signals:
                    say(f"kvferry serve: {signal.Signals(signum).name}: shutting down")
                    tg.cancel_scope.cancel()
                    return

            tg.start_soon(stop_on_signal)
            await serve_context(
                args.model,
                engine_options,
                transport=transport,
                host=host,
                port=port,
                advertise_host=args.advertise_host,
                secret=secret,
                on_listening=listening,
            )
            tg.cancel_scope.cancel()
