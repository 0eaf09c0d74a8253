"""``kvferry bench serve --url``: requests to a running ``kvferry serve`` (or any OpenAI-compatible server that
returns token ids), streamed over HTTP with httpx.

Each request is ``POST /v1/completions`` with the prompt as token ids, ``temperature: 0``, ``stream: true``,
``return_token_ids: true`` and ``stream_options: {"include_usage": true}``; its tokens are the ``token_ids`` of
the stream's chunks, each timed when its event arrives. A request fails (its ``error_kind``) on a status other
than 200 (``http_STATUS[_CODE]``, the code from the error body), an error event (``stream_error[_CODE]``), a
stream that ends without ``[DONE]`` (``incomplete_stream``), an event that is not JSON (``bad_event``), a
finish reason other than ``stop``/``length`` (``finish_REASON``), a usage that counts other tokens than arrived
(``usage_mismatch``), a missed deadline (``timeout``), or a connection failure (the httpx error's type).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from attrs import frozen

from kvferry.errors import ConfigError
from kvferry.tools.serve_bench import BenchRequest, Outcome

__all__ = ["HttpTarget", "http_target"]

#: seconds to ask the server which model it serves, before the run
CONNECT_DEADLINE = 10.0


@frozen
class HttpTarget:
    """A server's ``/v1/completions`` through ``client`` (whose base URL is the server)."""

    client: httpx.AsyncClient
    model_name: str

    async def send(self, request: BenchRequest, time_limit: float) -> Outcome:
        body = {
            "model": self.model_name,
            "prompt": list(request.prompt_ids),
            "max_tokens": request.max_tokens,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,
            "stream_options": {"include_usage": True},
        }
        outcome = Outcome(
            request.index, len(request.prompt_ids), request.max_tokens, time.perf_counter(), 0.0
        )
        try:
            with anyio.fail_after(time_limit):
                await self._stream(body, outcome)
        except TimeoutError:
            outcome.error_kind, outcome.error = "timeout", f"no end within {time_limit:g} s"
        except httpx.HTTPError as exc:
            outcome.error_kind, outcome.error = type(exc).__name__, str(exc) or type(exc).__name__
        outcome.ended_at = time.perf_counter()
        return outcome

    async def _stream(self, body: dict[str, Any], outcome: Outcome) -> None:
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                message, code = _error_of(response.content)
                suffix = f"_{code}" if code else ""
                outcome.error_kind, outcome.error = f"http_{response.status_code}{suffix}", message
                return
            finish: str | None = None
            completion_tokens: int | None = None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue  # the blank line that ends an event
                data = line[len("data: ") :]
                if data == "[DONE]":
                    break
                try:
                    payload = json.loads(data)
                except ValueError:
                    outcome.error_kind, outcome.error = "bad_event", data[:200]
                    return
                if not isinstance(payload, dict):
                    outcome.error_kind, outcome.error = "bad_event", data[:200]
                    return
                if "error" in payload:
                    message, code = _error_fields(payload)
                    outcome.error_kind = "stream_error" + (f"_{code}" if code else "")
                    outcome.error = message
                    return
                now = time.perf_counter()
                for choice in payload.get("choices") or ():
                    ids = choice.get("token_ids") or ()
                    outcome.token_ids.extend(int(t) for t in ids)
                    outcome.token_times.extend(now for _ in ids)
                    finish = choice.get("finish_reason") or finish
                usage = payload.get("usage")
                if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
                    completion_tokens = int(usage["completion_tokens"])
            else:
                outcome.error_kind, outcome.error = "incomplete_stream", "the stream ended without [DONE]"
                return
        if finish not in ("stop", "length"):
            outcome.error_kind, outcome.error = f"finish_{finish}", f"finish_reason {finish!r}"
        elif completion_tokens is not None and completion_tokens != len(outcome.token_ids):
            outcome.error_kind = "usage_mismatch"
            outcome.error = f"usage counts {completion_tokens} tokens, {len(outcome.token_ids)} arrived"


def _error_fields(payload: dict[str, Any]) -> tuple[str, str | None]:
    error = payload.get("error")
    if not isinstance(error, dict):
        return str(error), None
    code = error.get("code")
    return str(error.get("message", "")), None if code is None else str(code)


def _error_of(content: bytes) -> tuple[str, str | None]:
    try:
        payload = json.loads(content)
    except ValueError:
        return content[:200].decode(errors="replace"), None
    return _error_fields(payload) if isinstance(payload, dict) else (str(payload)[:200], None)


@asynccontextmanager
async def http_target(url: str, model: str, time_limit: float) -> AsyncIterator[tuple[HttpTarget, int]]:
    """A target at ``url`` and the vocabulary size of its model, after checking that the server answers and
    serves ``model`` (``"tiny"``, or a checkpoint directory named as the server names it).

    :raises ~kvferry.errors.ConfigError: the server cannot be reached, or serves another model.
    """
    # no connection limit: a request waiting for a pooled connection would count that wait as its TTFT
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        base_url=url, timeout=httpx.Timeout(time_limit), limits=limits, trust_env=False
    ) as client:
        served = await _served_model(client, url)
        name = _model_name(model)
        if served != name:
            raise ConfigError(
                f"--url {url} serves the model {served!r}, not {name!r}: give --model as the server was started "
                "(its vocabulary sizes the prompts, and --check runs it offline)"
            )
        yield HttpTarget(client, served), _vocab_size(model)


async def _served_model(client: httpx.AsyncClient, url: str) -> str:
    try:
        with anyio.fail_after(CONNECT_DEADLINE):
            response = await client.get("/v1/models")
    except TimeoutError:
        raise ConfigError(f"--url {url}: no answer to GET /v1/models within {CONNECT_DEADLINE:g} s") from None
    except httpx.HTTPError as exc:
        raise ConfigError(f"--url {url}: cannot reach the server: {exc or type(exc).__name__}") from None
    try:
        models = response.json()["data"]
        return str(models[0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ConfigError(
            f"--url {url}: GET /v1/models answered {response.status_code} without a model list"
        ) from None


def _model_name(model: str) -> str:
    return "tiny" if model == "tiny" else model.rstrip("/").rsplit("/", 1)[-1]


def _vocab_size(model: str) -> int:
    if model == "tiny":
        from kvferry.pools.spec import preset

        return preset("tiny").vocab_size
    from pathlib import Path

    try:
        config = json.loads((Path(model) / "config.json").read_text())
        return int(config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"--model {model}: cannot read vocab_size from its config.json: {exc}") from None
