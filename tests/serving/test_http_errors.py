"""Refusals over real HTTP: every kind of bad input is a 400 in OpenAI's error format, another model a 404, a
full queue a 503; and the server keeps serving after each."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import anyio
import httpx
import pytest

from kvferry.serving.http import MAX_BODY_BYTES
from tests.support.http_server import first_event, serving

GOOD = {"prompt": "hello", "max_tokens": 3, "temperature": 0}

#: (request body, the ``param`` the error names, a piece of its message)
BAD_BODIES: list[tuple[Any, str | None, str]] = [
    ([1, 2], None, "JSON object"),
    ({"max_tokens": 3}, "prompt", "prompt must be"),
    ({"prompt": 5}, "prompt", "prompt must be"),
    ({"prompt": {"text": "hi"}}, "prompt", "prompt must be"),
    ({"prompt": [1, "a"]}, "prompt", "prompt must be"),
    ({"prompt": [1, True]}, "prompt", "prompt must be"),
    ({"prompt": []}, "prompt", "at least one token"),
    ({"prompt": ""}, "prompt", "at least one token"),
    ({"prompt": ["one", "two"]}, "prompt", "only one prompt per request"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "only one prompt per request"),
    ({"prompt": "hi", "model": 5}, "model", "model must be a string"),
    ({"prompt": [300]}, None, "prompt token ids must be in [0, 256)"),
    ({**GOOD, "max_tokens": "ten"}, "max_tokens", "must be an integer"),
    ({**GOOD, "max_tokens": 1.5}, "max_tokens", "must be an integer"),
    ({**GOOD, "max_tokens": True}, "max_tokens", "must be an integer"),
    ({**GOOD, "max_tokens": 0}, "max_tokens", "at least 1"),
    ({**GOOD, "temperature": "hot"}, "temperature", "must be a number"),
    ({**GOOD, "temperature": -0.5}, "temperature", ">= 0"),
    ({**GOOD, "seed": -1}, "seed", "[0, 2**62)"),
    ({**GOOD, "seed": "x"}, "seed", "must be an integer"),
    ({**GOOD, "n": 2}, "n", "n must be 1"),
    ({**GOOD, "stop": 5}, "stop", "string or a list of strings"),
    ({**GOOD, "stop": ["ab"]}, "stop", "single ASCII character"),
    ({**GOOD, "stop": "é"}, "stop", "single ASCII character"),
    ({**GOOD, "stop_token_ids": [-1]}, "stop_token_ids", "list of token ids"),
    ({**GOOD, "stream": "yes"}, "stream", "must be a boolean"),
    ({**GOOD, "stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream"),
    ({**GOOD, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options", "boolean"),
    ({**GOOD, "return_token_ids": "yes"}, "return_token_ids", "must be a boolean"),
    ({**GOOD, "echo": True}, "echo", "not supported"),
    ({**GOOD, "logprobs": 2}, "logprobs", "not supported"),
    ({**GOOD, "best_of": 3}, "best_of", "not supported"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None, message: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == ("invalid_request_error" if status < 500 else "server_error")
    assert body["error"]["param"] == param
    assert message in body["error"]["message"], body["error"]["message"]


@pytest.mark.anyio
async def test_each_kind_of_bad_input_is_a_400_and_the_server_keeps_serving() -> None:
    async with serving() as served, served.client() as client:
        for body, param, message in BAD_BODIES:
            assert_openai_error(await client.post("/v1/completions", json=body), 400, param, message)
            if isinstance(body, dict) and "stream" not in body and "stream_options" not in body:
                # a stream is refused before it starts: with a status code too
                streamed = await client.post("/v1/completions", json={**body, "stream": True})
                assert_openai_error(streamed, 400, param, message)
        for raw in (b"{not json", b"\xff\xfe", b"[" * 100_000):
            response = await client.post(
                "/v1/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert_openai_error(response, 400, None, "not valid JSON")
        surrogate = await client.post(
            "/v1/completions", content=b'{"prompt": "a\\ud800"}', headers={"content-type": "application/json"}
        )
        assert_openai_error(surrogate, 400, "prompt", "not valid Unicode")
        too_large = await client.post("/v1/completions", json={**GOOD, "max_tokens": 100_000})
        assert_openai_error(too_large, 400, None, "--num-pages")
        assert too_large.json()["error"]["code"] == "context_length_exceeded"
        good = await client.post("/v1/completions", json=GOOD)
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3
        stats = served.service.statistics()
    assert stats.submitted == 1 and stats.active == 0  # nothing refused was ever submitted


@pytest.mark.anyio
async def test_a_body_over_the_limit_is_refused_before_it_is_read() -> None:
    async with serving() as served:
        url = urlsplit(served.url)
        assert url.hostname is not None and url.port is not None
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: {url.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {MAX_BODY_BYTES + 1}\r\n\r\n"
        )
        async with await anyio.connect_tcp(url.hostname, url.port) as connection:
            await connection.send(head.encode())
            answer = b""
            with anyio.fail_after(30):
                while b"\r\n\r\n" not in answer:
                    answer += await connection.receive()
    assert answer.startswith(b"HTTP/1.1 413 ")


@pytest.mark.anyio
async def test_another_model_is_a_404_and_unknown_routes_are_openai_errors() -> None:
    async with serving() as served, served.client() as client:
        other = await client.post("/v1/completions", json={**GOOD, "model": "gpt-4"})
        assert_openai_error(other, 404, "model", "`gpt-4` does not exist")
        assert other.json()["error"]["code"] == "model_not_found"
        assert_openai_error(await client.get("/v1/nothing"), 404, None, "Not Found")
        assert_openai_error(await client.get("/v1/completions"), 405, None, "Method Not Allowed")
        assert (await client.post("/v1/completions", json={**GOOD, "model": "tiny"})).status_code == 200


@pytest.mark.anyio
async def test_a_full_queue_is_a_503_and_the_server_keeps_serving() -> None:
    long = {"prompt": "hello", "max_tokens": 1000, "temperature": 0, "stream": True}
    async with serving(max_running=1, max_queued=1) as served, served.client() as client:
        # one request runs (it streamed its first token) and one waits for its batch row: the queue is full
        async with client.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            await first_event(running.aiter_lines())
            async with client.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200  # its status came once it was submitted
                assert served.service.statistics().queued == 1
                full = await client.post("/v1/completions", json=GOOD)
                assert_openai_error(full, 503, None, "max_queued 1")
                assert full.json()["error"]["code"] == "overloaded"
        # both streams were closed unread: their requests were cancelled, and new ones are served
        good = await client.post("/v1/completions", json=GOOD)
        assert good.status_code == 200 and good.json()["choices"][0]["finish_reason"] == "length"
