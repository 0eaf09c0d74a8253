"""An OpenAI-compatible HTTP API over a :class:`~kvferry.serving.service.Service` (Starlette; served by uvicorn
through :class:`HttpServer`, or by any ASGI server).

Routes: ``POST /v1/completions`` (see :mod:`~kvferry.serving.protocol` for what a request may hold),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus, :mod:`~kvferry.serving.metrics`).

Status codes: 400 with OpenAI's error body for a body that is not JSON, a wrong type or value, or a request
that can never fit the pools; 404 for another model; 503 when the service's queue is full or it is shutting
down; 500 when a request failed after it was accepted (not streamed). Every request is submitted before a byte
of the response is sent, so a refusal is always a status code; once a stream has started, a failure ends it
with an event ``data: {"error": {...}}`` and ``data: [DONE]``.

A client that goes away (streamed or not) cancels its request: the engine frees its cache at its next step.
:func:`shut_down` (``kvferry serve`` calls it on SIGINT/SIGTERM) closes the service: every running request is
cancelled and each open stream ends with an error event and ``[DONE]``.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from kvferry.errors import ConfigError, EngineClosed, KvferryError, RequestTooLarge, ServiceOverloaded
from kvferry.exits import one_line
from kvferry.model.tokenizer import Tokenizer
from kvferry.serving.handle import CompletionResult, FinishReason, RequestHandle
from kvferry.serving.metrics import ServingMetrics
from kvferry.serving.protocol import (
    CompletionParams,
    InvalidRequest,
    ModelNotFound,
    TextDelta,
    chunk_object,
    completion_object,
    decode_output,
    error_object,
    parse_completion,
    usage_object,
)
from kvferry.serving.service import Service

__all__ = ["HttpServer", "create_app", "shut_down"]

#: request bodies above this are refused (413) before they are read in full
MAX_BODY_BYTES = 16 << 20
#: seconds a shutdown waits for responses to end before uvicorn cancels them
GRACEFUL_SHUTDOWN_SECONDS = 10.0

_DONE = b"data: [DONE]\n\n"
_SHUTTING_DOWN = "the request was cancelled: the server is shutting down"


def create_app(
    service: Service, tokenizer: Tokenizer | None, *, metrics: ServingMetrics | None = None
) -> Starlette:
    """The HTTP API over ``service`` (see the module docstring). ``tokenizer`` turns text prompts and stop
    strings into token ids and tokens into text (None: prompts must be token ids and ``text`` is empty).
    ``metrics`` defaults to a new :class:`~kvferry.serving.metrics.ServingMetrics` of ``service``."""
    api = _Api(service, tokenizer, metrics if metrics is not None else ServingMetrics(service))
    app = Starlette(
        routes=[
            Route("/v1/completions", api.completions, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/health", api.health, methods=["GET"]),
            Route("/metrics", api.metrics_page, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
    app.state.api = api
    return app


def shut_down(app: Starlette) -> None:
    """Close the app's service: refuse new requests (503), cancel every running one; open streams end with an
    error event and ``[DONE]``. ``/health`` answers 503 from now on."""
    api: _Api = app.state.api
    api.closing = True
    api.service.close()


class _Api:
    def __init__(self, service: Service, tokenizer: Tokenizer | None, metrics: ServingMetrics) -> None:
        self.service = service
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.created = int(time.time())
        self.closing = False

    async def completions(self, request: Request) -> Any:
        try:
            body = await _read_json(request)
            params = parse_completion(body, model_name=self.service.model_name, tokenizer=self.tokenizer)
        except ModelNotFound as exc:
            return _error(404, str(exc), param=exc.param, code="model_not_found")
        except InvalidRequest as exc:
            return _error(400, str(exc), param=exc.param)
        try:
            handle = await self.service.submit(
                params.prompt_ids,
                max_tokens=params.max_tokens,
                stop_ids=params.stop_ids,
                seed=params.seed,
                temperature=params.temperature,
            )
        except RequestTooLarge as exc:
            return _error(400, str(exc), code="context_length_exceeded")
        except ConfigError as exc:
            return _error(400, str(exc))
        except ServiceOverloaded as exc:
            return _error(503, str(exc), kind="server_error", code="overloaded")
        except EngineClosed:
            self.closing = True
            return _error(503, "the server is shutting down", kind="server_error", code="shutting_down")
        completion = _Completion(self, handle, params)
        return _Streamed(completion) if params.stream else _Pending(completion)

    async def models(self, request: Request) -> Response:
        model = {
            "id": self.service.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvferry",
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def health(self, request: Request) -> Response:
        if self.closing:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_page(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(self.metrics.render(), headers={"content-type": CONTENT_TYPE_LATEST})


async def _read_json(request: Request) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise HTTPException(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise HTTPException(413, f"the request body exceeds {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None


def _error(
    status: int,
    message: str,
    *,
    kind: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    return JSONResponse(error_object(message, kind=kind, param=param, code=code), status_code=status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return _error(exc.status_code, exc.detail, kind=kind)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return _error(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


class _Completion:
    """One accepted request and what its response needs."""

    def __init__(self, api: _Api, handle: RequestHandle, params: CompletionParams) -> None:
        self.api = api
        self.handle = handle
        self.params = params
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(self, result: CompletionResult) -> Response:
        """The whole completion (200), or the error that ended it."""
        if result.finish_reason is FinishReason.ERROR:
            message = one_line(result.error) if result.error is not None else "the request failed"
            return _error(500, message, kind="server_error", code="request_failed")
        if result.finish_reason is FinishReason.CANCELLED:
            return _error(503, _SHUTTING_DOWN, kind="server_error", code="shutting_down")
        stopped = result.finish_reason is FinishReason.STOP
        body = completion_object(
            self.id,
            self.created,
            self.api.service.model_name,
            text=decode_output(self.api.tokenizer, result.token_ids, stopped),
            finish_reason=result.finish_reason.value,
            token_ids=result.token_ids if self.params.return_token_ids else None,
            usage=usage_object(len(result.prompt_ids), len(result.token_ids)),
        )
        return JSONResponse(body)

    async def events(self) -> AsyncGenerator[bytes, None]:
        """The server-sent events of a streamed completion, ``[DONE]`` last."""
        handle, params = self.handle, self.params
        delta = TextDelta(self.api.tokenizer)
        pending: list[int] = []  # tokens not sent yet (their text is not final)
        try:
            async for token in handle:
                pending.append(token)
                if token in params.stop_ids:
                    continue  # the last token: its text is left out
                text = delta.add(token)
                if text:
                    yield self._chunk(text=text, token_ids=pending)
                    pending = []
        except KvferryError as exc:
            yield _event(error_object(one_line(exc), kind="server_error", code="request_failed"))
            yield _DONE
            return
        reason = handle.finish_reason
        if reason is FinishReason.CANCELLED or reason is None:
            yield _event(error_object(_SHUTTING_DOWN, kind="server_error", code="shutting_down"))
            yield _DONE
            return
        yield self._chunk(text=delta.flush(), token_ids=pending, finish_reason=reason.value)
        if params.include_usage:
            usage = usage_object(len(handle.prompt_ids), len(handle.tokens))
            yield _event(
                chunk_object(
                    self.id,
                    self.created,
                    self.api.service.model_name,
                    usage=usage,
                    include_usage=True,
                    final_usage=True,
                )
            )
        yield _DONE

    def _chunk(self, *, text: str, token_ids: list[int], finish_reason: str | None = None) -> bytes:
        return _event(
            chunk_object(
                self.id,
                self.created,
                self.api.service.model_name,
                text=text,
                finish_reason=finish_reason,
                token_ids=token_ids if self.params.return_token_ids else None,
                include_usage=self.params.include_usage,
            )
        )


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _while_connected(
    receive: Receive, handle: RequestHandle, work: Callable[[], Awaitable[None]]
) -> bool:
    """Run ``work`` unless the client disconnects first; a disconnect cancels ``handle`` and ``work``.
    Returns whether ``work`` ran to its end."""
    finished = False
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            handle.cancel()
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        await work()
        finished = True
        tg.cancel_scope.cancel()
    return finished


class _Pending:
    """The ASGI response of a non-streamed completion: waits for the end (a disconnect cancels the request),
    then sends the completion."""

    def __init__(self, completion: _Completion) -> None:
        self.completion = completion

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handle = self.completion.handle
        results: list[CompletionResult] = []
        try:

            async def wait() -> None:
                results.append(await handle.result())

            if await _while_connected(receive, handle, wait):
                await self.completion.response(results[0])(scope, receive, send)
        finally:
            handle.cancel()  # no-op once it ended


class _Streamed:
    """The ASGI response of a streamed completion (server-sent events); a disconnect cancels the request."""

    def __init__(self, completion: _Completion) -> None:
        self.completion = completion

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handle = self.completion.handle
        events = self.completion.events()
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # proxies: pass each event on at once
        ]

        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await _while_connected(receive, handle, stream)
        except OSError:
            pass  # the client went away while an event was sent: the request is cancelled below
        finally:
            handle.cancel()  # no-op once it ended
            with anyio.CancelScope(shield=True):
                await events.aclose()


# --- serving with uvicorn ------------------------------------------------------------------------------


class HttpServer:
    """uvicorn serving an ASGI app on a socket bound (and listening) at construction, so that the port (also
    one the system picked for ``port=0``) is known before :meth:`serve` starts.

    Signals are left to the caller: :meth:`serve` installs no handlers; call :meth:`stop` to make it return
    (it stops accepting, lets running responses end for up to ``GRACEFUL_SHUTDOWN_SECONDS``, then cancels
    them).

    :raises ~kvferry.errors.ConfigError: the address cannot be bound (in use, not a local address).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self.socket = socket.create_server((host, port), family=family)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        self.host = host
        self.port: int = self.socket.getsockname()[1]
        config = uvicorn.Config(
            app,
            http="h11",
            lifespan="off",
            log_config=None,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(GRACEFUL_SHUTDOWN_SECONDS),
        )
        self._server = _UnsignalledServer(config)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def started(self) -> bool:
        return bool(self._server.started)

    async def serve(self) -> None:
        """Serve until :meth:`stop` (the socket is closed on return)."""
        try:
            await self._server.serve(sockets=[self.socket])
        finally:
            self.socket.close()

    def stop(self) -> None:
        """Make :meth:`serve` return; a second call stops waiting for running responses."""
        if self._server.should_exit:
            self._server.force_exit = True
        self._server.should_exit = True


class _UnsignalledServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # the caller owns SIGINT/SIGTERM (uvicorn's own handlers would re-raise them after shutdown)
        yield
