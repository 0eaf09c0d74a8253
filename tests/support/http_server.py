"""A real HTTP server for the serving suites: the tiny model's service behind the HTTP app, on uvicorn on a free
port of this host, in a task of the test; and the server-sent events of a stream, read as they are."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from attrs import frozen
from starlette.applications import Starlette

from kvferry.engine.runner import EngineOptions
from kvferry.model.tokenizer import ByteTokenizer
from kvferry.serving import Service, open_service
from kvferry.serving.http import HttpServer, create_app

#: the engines of these suites (float64: the tiny model's fastest dtype on a CPU)
DTYPE = "float64"
#: seconds the server has to start listening, and to stop once asked
START_DEADLINE = 30.0
STOP_DEADLINE = 20.0


@frozen
class Served:
    service: Service
    app: Starlette
    url: str

    def client(self, timeout: float = 60.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=timeout)


@asynccontextmanager
async def serving(
    *, max_running: int = 4, max_queued: int = 1024, num_pages: int = 512
) -> AsyncIterator[Served]:
    """The tiny model served over HTTP until the block ends (the server is stopped, then the service closed)."""
    options = EngineOptions(dtype=DTYPE, max_running=max_running, num_pages=num_pages)
    async with open_service("tiny", engine=options, max_queued=max_queued) as service:
        app = create_app(service, ByteTokenizer())
        server = HttpServer(app)
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            await until(lambda: server.started, START_DEADLINE)
            try:
                yield Served(service, app, server.url)
            finally:
                server.stop()
                tg.cancel_scope.deadline = anyio.current_time() + STOP_DEADLINE


def event_payloads(raw: str) -> list[Any]:
    """The payloads of a whole server-sent-events body, checking its framing: every event is exactly
    ``data: PAYLOAD`` followed by a blank line, and the last one is ``[DONE]`` (returned as the string)."""
    assert raw.endswith("\n\n"), raw[-200:]
    events = raw[:-2].split("\n\n")
    payloads: list[Any] = []
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
        data = event[len("data: ") :]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads


async def first_event(lines: AsyncIterator[str]) -> Any:
    """Read a stream's lines up to its first event and return its payload."""
    async for line in lines:
        if line.startswith("data: "):
            return json.loads(line[len("data: ") :])
    raise AssertionError("the stream ended before its first event")


async def until(condition: Callable[[], bool], deadline: float = 30.0) -> None:
    """Wait until ``condition()`` holds (TimeoutError after ``deadline`` seconds)."""
    with anyio.fail_after(deadline):
        while not condition():  # noqa: ASYNC110 (polls state no event exposes)
            await anyio.sleep(0.01)


async def wait_until_idle(service: Service, deadline: float = 30.0) -> None:
    """Until no request of ``service`` runs (a cancel frees a request's cache at the engine's next step)."""

    def idle() -> bool:
        stats = service.statistics()
        return stats.active == 0 and stats.backend["running"] == 0

    await until(idle, deadline)
