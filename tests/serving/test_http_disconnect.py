"""A client that goes away cancels its request: the engine ends up running nothing and the pools are back to
what they held before (streamed and not streamed)."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import anyio
import pytest

from tests.support.http_server import first_event, serving, until, wait_until_idle

#: long enough that only the disconnect can end it (about 2000 tokens fit the pages)
LONG = {"prompt": "goodbye", "max_tokens": 1900, "temperature": 0}
NUM_PAGES = 1024


@pytest.mark.anyio
async def test_closing_a_stream_cancels_its_request() -> None:
    async with serving(num_pages=NUM_PAGES) as served, served.client() as client:
        service = served.service
        initial = service.statistics().pools
        async with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as stream:
            await first_event(stream.aiter_lines())
            assert service.statistics().pools.pages_used > initial.pages_used
        # leaving the block closed the connection with the body unread
        await wait_until_idle(service)
        stats = service.statistics()
        assert stats.finished == {"stop": 0, "length": 0, "cancelled": 1, "error": 0}
        assert stats.pools == initial
        assert stats.backend["running"] == 0 and stats.backend["waiting"] == 0
        # and the server serves on
        after = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert after.status_code == 200


@pytest.mark.anyio
async def test_a_client_that_leaves_before_its_answer_cancels_its_request() -> None:
    async with serving(num_pages=NUM_PAGES) as served:
        service = served.service
        initial = service.statistics().pools
        url = urlsplit(served.url)
        assert url.hostname is not None and url.port is not None
        body = json.dumps(LONG).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode()
        async with await anyio.connect_tcp(url.hostname, url.port) as connection:
            await connection.send(head + body)
            await until(lambda: service.statistics().tokens_generated > 0)  # it runs: tokens come
        # the connection is closed, no answer read
        await wait_until_idle(service)
        stats = service.statistics()
        assert stats.finished == {"stop": 0, "length": 0, "cancelled": 1, "error": 0}
        assert stats.pools == initial
        assert stats.backend["running"] == 0 and stats.backend["waiting"] == 0
