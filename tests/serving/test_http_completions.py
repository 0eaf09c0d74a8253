"""``POST /v1/completions`` over real HTTP: text and token-id prompts, the exact stream format, token ids, usage,
stop strings, tokens equal to the engine's own offline, and the official ``openai`` client unchanged."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import anyio
import openai
import pytest

from kvferry.engine.runner import EngineOptions, build_engine
from kvferry.errors import RequestAborted
from kvferry.model.tokenizer import ByteTokenizer
from kvferry.serving import RequestHandle
from kvferry.serving.http import _Api, _Completion
from kvferry.serving.protocol import parse_completion
from tests.support.http_server import DTYPE, event_payloads, serving

PROMPT = "The cache moves"
PROMPT_IDS = list(PROMPT.encode())


async def offline(prompt: list[int], max_tokens: int, **sampling: Any) -> list[int]:
    """The tokens ``Engine.generate`` gives on an engine of its own (same model, weights and dtype)."""
    built = build_engine("tiny", EngineOptions(dtype=DTYPE, step_in_thread=False))
    async with built.engine:
        tokens: list[int] = await built.engine.generate(prompt, max_tokens=max_tokens, **sampling).collect()
    return tokens


@pytest.mark.anyio
async def test_text_and_token_id_prompts_give_the_engines_greedy_tokens() -> None:
    expected = await offline(PROMPT_IDS, 12)
    async with serving() as served, served.client() as client:
        by_text = await client.post(
            "/v1/completions",
            json={
                "model": "tiny",
                "prompt": PROMPT,
                "max_tokens": 12,
                "temperature": 0,
                "return_token_ids": True,
            },
        )
        by_ids = await client.post(
            "/v1/completions",
            json={"prompt": [PROMPT_IDS], "max_tokens": 12, "temperature": 0, "return_token_ids": True},
        )
    assert by_text.status_code == by_ids.status_code == 200
    body = by_text.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "text_completion" and body["model"] == "tiny" and body["id"].startswith("cmpl-")
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "text": ByteTokenizer().decode(expected),
        "logprobs": None,
        "finish_reason": "length",
        "token_ids": expected,
    }
    assert body["usage"] == {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": 12, "total_tokens": 27}
    assert by_ids.json()["choices"][0]["token_ids"] == expected


@pytest.mark.anyio
async def test_seeded_sampling_is_the_engines_and_token_ids_are_left_out_unless_asked() -> None:
    expected = await offline(PROMPT_IDS, 10, seed=7, temperature=0.8)
    request = {"prompt": PROMPT_IDS, "max_tokens": 10, "seed": 7, "temperature": 0.8}
    async with serving() as served, served.client() as client:
        plain = (await client.post("/v1/completions", json=request)).json()
        again = (await client.post("/v1/completions", json={**request, "return_token_ids": True})).json()
    assert "token_ids" not in plain["choices"][0]
    assert again["choices"][0]["token_ids"] == expected
    assert plain["choices"][0]["text"] == again["choices"][0]["text"] == ByteTokenizer().decode(expected)


@pytest.mark.anyio
async def test_the_stream_is_server_sent_events_in_openais_chunk_format() -> None:
    expected = await offline(PROMPT_IDS, 9)
    request = {
        "prompt": PROMPT,
        "max_tokens": 9,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    async with serving() as served, served.client() as client:
        response = await client.post("/v1/completions", json=request)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = event_payloads(response.text)
    chunks, usage_chunk = payloads[:-2], payloads[-2]
    ids = {chunk["id"] for chunk in payloads[:-1]}
    assert len(ids) == 1 and ids.pop().startswith("cmpl-")
    for chunk in chunks:
        assert set(chunk) == {"id", "object", "created", "model", "choices", "usage"}
        assert chunk["object"] == "text_completion" and chunk["model"] == "tiny" and chunk["usage"] is None
        (choice,) = chunk["choices"]
        assert set(choice) == {"index", "text", "logprobs", "finish_reason", "token_ids"}
        assert choice["index"] == 0 and choice["logprobs"] is None
    # every chunk but the last is unfinished; the pieces add up to the tokens and their text
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
    assert "".join(c["choices"][0]["text"] for c in chunks) == ByteTokenizer().decode(expected)
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == {
        "prompt_tokens": len(PROMPT_IDS),
        "completion_tokens": 9,
        "total_tokens": len(PROMPT_IDS) + 9,
    }


@pytest.mark.anyio
async def test_a_plain_stream_has_no_usage_and_no_token_ids() -> None:
    async with serving() as served, served.client() as client:
        response = await client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
        )
    payloads = event_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    for chunk in payloads[:-1]:
        assert "usage" not in chunk and "token_ids" not in chunk["choices"][0]
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def first_printable(tokens: list[int]) -> int:
    """The index of the first token that is a printable ASCII character (a valid one-character stop)."""
    return next(i for i, t in enumerate(tokens) if 0x21 <= t < 0x7F)


@pytest.mark.anyio
@pytest.mark.parametrize("stream", [False, True])
async def test_a_stop_string_ends_the_completion_and_is_left_out_of_the_text(stream: bool) -> None:
    unstopped = await offline(PROMPT_IDS, 60)
    at = first_printable(unstopped)
    stop = chr(unstopped[at])
    request = {
        "prompt": PROMPT,
        "max_tokens": 60,
        "temperature": 0,
        "stop": stop if stream else [stop],  # a string, or a list of strings
        "return_token_ids": True,
        "stream": stream,
    }
    async with serving() as served, served.client() as client:
        response = await client.post("/v1/completions", json=request)
    assert response.status_code == 200
    if stream:
        chunks = event_payloads(response.text)[:-1]
        tokens = [t for c in chunks for t in c["choices"][0]["token_ids"]]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        (choice,) = response.json()["choices"]
        tokens, text, finish = choice["token_ids"], choice["text"], choice["finish_reason"]
    assert finish == "stop"
    assert tokens == unstopped[: at + 1]  # the stop token is the last token
    assert text == ByteTokenizer().decode(unstopped[:at])  # and not part of the text


@pytest.mark.anyio
async def test_stop_token_ids_end_the_completion() -> None:
    unstopped = await offline(PROMPT_IDS, 30)
    async with serving() as served, served.client() as client:
        response = await client.post(
            "/v1/completions",
            json={"prompt": PROMPT_IDS, "max_tokens": 30, "temperature": 0, "stop_token_ids": [unstopped[4]]},
        )
    body = response.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == unstopped.index(unstopped[4]) + 1


@pytest.mark.anyio
async def test_the_official_openai_client_works_unchanged() -> None:
    expected = await offline(PROMPT_IDS, 8)
    async with serving() as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=60)
        try:
            completion = await anyio.to_thread.run_sync(
                partial(
                    client.completions.create,
                    model="tiny",
                    prompt=PROMPT,
                    max_tokens=8,
                    temperature=0,
                    extra_body={"return_token_ids": True},
                )
            )

            def streamed() -> tuple[list[str], list[str | None]]:
                texts: list[str] = []
                reasons: list[str | None] = []
                stream = client.completions.create(
                    model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True
                )
                for chunk in stream:
                    texts.extend(choice.text for choice in chunk.choices)
                    reasons.extend(choice.finish_reason for choice in chunk.choices)
                return texts, reasons

            texts, reasons = await anyio.to_thread.run_sync(streamed)
            models = await anyio.to_thread.run_sync(client.models.list)
        finally:
            client.close()
    (choice,) = completion.choices
    assert choice.text == ByteTokenizer().decode(expected) and choice.finish_reason == "length"
    assert choice.model_extra is not None and choice.model_extra["token_ids"] == expected
    assert completion.usage is not None and completion.usage.completion_tokens == 8
    assert "".join(texts) == choice.text and reasons[-1] == "length"
    assert [model.id for model in models.data] == ["tiny"]


@pytest.mark.anyio
async def test_the_openai_client_sees_a_typed_error() -> None:
    async with serving() as served:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0, timeout=60)
        try:
            with pytest.raises(openai.BadRequestError) as bad:
                await anyio.to_thread.run_sync(
                    partial(client.completions.create, model="tiny", prompt="hi", max_tokens=4, n=2)
                )
            with pytest.raises(openai.NotFoundError):
                await anyio.to_thread.run_sync(
                    partial(client.completions.create, model="gpt-4", prompt="hi", max_tokens=4)
                )
        finally:
            client.close()
    assert "n must be 1" in bad.value.message


@pytest.mark.anyio
async def test_a_request_that_fails_ends_its_stream_with_an_error_event_or_is_a_500() -> None:
    """A failure after the request was accepted (a model step, a lost context engine): made here on a handle
    of the app's own kind, since the tiny model does not fail on its own."""
    async with serving() as served:
        api: _Api = served.app.state.api
        params = parse_completion(
            {"prompt": "x", "max_tokens": 4, "stream": True, "return_token_ids": True},
            model_name="tiny",
            tokenizer=ByteTokenizer(),
        )
        handle = RequestHandle("req-failing", (120,), 4, frozenset())
        handle.push(ord("o"))
        handle.finish(error=RequestAborted("a model step failed"))
        completion = _Completion(api, handle, params)
        events = b"".join([event async for event in completion.events()]).decode()
        unstreamed = completion.response(await handle.result())
    payloads = event_payloads(events)
    assert payloads[0]["choices"][0]["text"] == "o" and payloads[0]["choices"][0]["token_ids"] == [ord("o")]
    assert payloads[1]["error"]["code"] == "request_failed"
    assert "a model step failed (RequestAborted)" in payloads[1]["error"]["message"]
    assert len(payloads) == 3
    assert unstreamed.status_code == 500
    assert json.loads(bytes(unstreamed.body))["error"]["type"] == "server_error"
