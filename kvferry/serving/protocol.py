"""The OpenAI completions protocol, without the HTTP: a request body checked and turned into
:class:`CompletionParams` (:func:`parse_completion`), and the JSON objects of responses, stream chunks and errors.

What the server accepts (``POST /v1/completions``):

- ``prompt``: text, or a list of token ids; one prompt per request (a list of one string or one id list is
  that prompt);
- ``max_tokens`` (default 16), ``temperature`` (default 1; 0 is greedy), ``seed`` (an int in [0, 2**62)):
  sampling is seeded, so a request without a seed and with a temperature above 0 gets a random seed;
- ``stop``: a string or a list of strings, each of which must be exactly one token (a single ASCII character
  for the byte-level ``tiny`` model); ``stop_token_ids`` (as vLLM): token ids. The stop token is the last of
  ``token_ids`` and is left out of ``text``;
- ``stream``, ``stream_options: {"include_usage": true}``, ``n`` (1 only), ``return_token_ids`` (as vLLM:
  each choice, and each stream chunk's choice, carries its token ids).

Fields that would change the output in a way this server does not implement (``echo``, ``logprobs``,
``best_of`` above 1, ``suffix``, ``top_p`` below 1, penalties, ``logit_bias``) are refused unless they hold
their neutral value; any other field is ignored.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Any

from attrs import frozen

from kvferry.errors import ConfigError
from kvferry.model.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "CompletionParams",
    "InvalidRequest",
    "ModelNotFound",
    "TextDelta",
    "chunk_object",
    "completion_object",
    "error_object",
    "parse_completion",
    "usage_object",
]

DEFAULT_MAX_TOKENS = 16
#: seeds are ints in [0, 2**62) (kvferry's one rule for seeds)
SEED_LIMIT = 2**62


class InvalidRequest(ConfigError):
    """A completions request the server refuses (HTTP 400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(InvalidRequest):
    """The request names a model this server does not serve (HTTP 404, as OpenAI answers)."""


@frozen
class CompletionParams:
    """One checked completions request."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    stop_ids: frozenset[int]
    #: None: greedy
    seed: int | None
    temperature: float
    stream: bool
    include_usage: bool
    return_token_ids: bool


#: fields refused unless they hold this neutral value (None is always accepted as "not given")
_NEUTRAL: dict[str, object] = {
    "echo": False,
    "logprobs": None,
    "best_of": 1,
    "suffix": None,
    "top_p": 1,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": {},
}


def parse_completion(body: Any, *, model_name: str, tokenizer: Tokenizer | None) -> CompletionParams:
    """Check a decoded JSON body and turn it into :class:`CompletionParams`.

    :raises ModelNotFound: ``model`` names another model.
    :raises InvalidRequest: anything else wrong with the body (the message says what, ``param`` where).
    """
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest(f"model must be a string, got {model!r}", "model")
    if model is not None and model != model_name:
        raise ModelNotFound(
            f"The model `{model}` does not exist (this server serves `{model_name}`)", "model"
        )
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != neutral:
            raise InvalidRequest(f"{name} {value!r} is not supported by this server", name)
    n = _optional_int(body, "n", 1)
    if n != 1:
        raise InvalidRequest(f"n must be 1 (one completion per request), got {n}", "n")
    temperature = _temperature(body.get("temperature"))
    seed: int | None = None
    if body.get("seed") is not None:
        seed = _optional_int(body, "seed", 0)
        if not 0 <= seed < SEED_LIMIT:
            raise InvalidRequest(f"seed must be an int in [0, 2**62), got {seed}", "seed")
    if temperature == 0.0:
        seed, temperature = None, 1.0  # greedy: the engine ignores the temperature
    elif seed is None:
        seed = secrets.randbelow(SEED_LIMIT)
    max_tokens = _optional_int(body, "max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    stream = _optional_bool(body, "stream", False)
    return CompletionParams(
        prompt_ids=_prompt(body.get("prompt"), tokenizer),
        max_tokens=max_tokens,
        stop_ids=_stop_ids(body.get("stop"), tokenizer) | _stop_token_ids(body.get("stop_token_ids")),
        seed=seed,
        temperature=temperature,
        stream=stream,
        include_usage=_include_usage(body.get("stream_options"), stream),
        return_token_ids=_optional_bool(body, "return_token_ids", False),
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_int(body: dict[str, Any], name: str, default: int) -> int:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}", name)
    return value


def _optional_bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be a boolean, got {value!r}", name)
    return value


def _temperature(value: object) -> float:
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequest(f"temperature must be a number, got {value!r}", "temperature")
    if not 0.0 <= value < math.inf:
        raise InvalidRequest(f"temperature must be a finite number >= 0, got {value}", "temperature")
    return float(value)


def _include_usage(value: object, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise InvalidRequest("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(value, dict):
        raise InvalidRequest("stream_options must be an object", "stream_options")
    include = value.get("include_usage", False)
    if not isinstance(include, bool):
        raise InvalidRequest("stream_options.include_usage must be a boolean", "stream_options")
    return include


def _prompt(value: object, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    if isinstance(value, list) and value and all(isinstance(v, str | list) for v in value):
        if len(value) > 1:
            raise InvalidRequest(
                f"only one prompt per request is supported, got {len(value)} prompts", "prompt"
            )
        value = value[0]
    if isinstance(value, str):
        if tokenizer is None:
            raise InvalidRequest("this model has no tokenizer: give the prompt as token ids", "prompt")
        ids = _encode(tokenizer, value, "prompt")
    elif isinstance(value, list) and all(_is_int(v) for v in value):
        ids = value
    else:
        raise InvalidRequest("prompt must be a string or a list of token ids", "prompt")
    if not ids:
        raise InvalidRequest("prompt must hold at least one token", "prompt")
    return tuple(ids)


def _stop_ids(value: object, tokenizer: Tokenizer | None) -> frozenset[int]:
    if value is None:
        return frozenset()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise InvalidRequest("stop must be a string or a list of strings", "stop")
    if not stops:
        return frozenset()
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer: give stop_token_ids instead of stop", "stop")
    return frozenset(_single_token(tokenizer, s) for s in stops)


def _encode(tokenizer: Tokenizer, text: str, param: str, *, special_tokens: bool = True) -> list[int]:
    """``text``'s tokens; ``special_tokens=False`` leaves out those a checkpoint's tokenizer may add (BOS)."""
    try:
        text.encode("utf-8")  # JSON may carry lone surrogates, which no tokenizer takes
        backend = getattr(tokenizer, "backend", None)
        if special_tokens or backend is None:
            return tokenizer.encode(text)
        encoded = backend.encode(text, add_special_tokens=False)
        return [int(t) for t in (encoded.ids if hasattr(encoded, "ids") else encoded)]
    except UnicodeEncodeError:
        raise InvalidRequest(f"{param} is not valid Unicode text (a lone surrogate)", param) from None


def _single_token(tokenizer: Tokenizer, text: str) -> int:
    ids = _encode(tokenizer, text, "stop", special_tokens=False)
    if len(ids) != 1:
        what = "a single ASCII character" if isinstance(tokenizer, ByteTokenizer) else "exactly one token"
        raise InvalidRequest(
            f"stop {text!r} is {len(ids)} tokens; each stop string must be {what} (or give stop_token_ids)",
            "stop",
        )
    return ids[0]


def _stop_token_ids(value: object) -> frozenset[int]:
    if value is None:
        return frozenset()
    if not isinstance(value, list) or not all(_is_int(v) and v >= 0 for v in value):
        raise InvalidRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
    return frozenset(value)


# --- responses -----------------------------------------------------------------------------------------


class TextDelta:
    """Turns tokens into text as they arrive: each :meth:`add` returns the text that became final (a character
    split over tokens waits for its last token); :meth:`flush` returns the rest at the end."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.shown = ""

    def add(self, token: int) -> str:
        self.tokens.append(token)
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""  # maybe a character still incomplete: wait for the next token (or the end)
        return self._advance(text)

    def flush(self) -> str:
        return "" if self.tokenizer is None else self._advance(self.tokenizer.decode(self.tokens))

    def _advance(self, text: str) -> str:
        if not text.startswith(self.shown):
            return ""  # the tokenizer rewrote text already sent (rare): what was sent stays
        new, self.shown = text[len(self.shown) :], text
        return new


def decode_output(tokenizer: Tokenizer | None, token_ids: Sequence[int], stopped: bool) -> str:
    """The ``text`` of a finished completion: its tokens without the stop token that ended it."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(token_ids[:-1] if stopped else token_ids)


def usage_object(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _choice(text: str, finish_reason: str | None, token_ids: Sequence[int] | None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def completion_object(
    completion_id: str,
    created: int,
    model: str,
    *,
    text: str,
    finish_reason: str,
    token_ids: Sequence[int] | None,
    usage: dict[str, int],
) -> dict[str, Any]:
    """A whole (non-streamed) completion; ``token_ids`` None leaves them out."""
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice(text, finish_reason, token_ids)],
        "usage": usage,
    }


def chunk_object(
    completion_id: str,
    created: int,
    model: str,
    *,
    text: str = "",
    finish_reason: str | None = None,
    token_ids: Sequence[int] | None = None,
    usage: dict[str, int] | None = None,
    include_usage: bool = False,
    final_usage: bool = False,
) -> dict[str, Any]:
    """One stream chunk. With ``include_usage`` every chunk carries ``usage`` (null but on the last one, whose
    choices are empty: ``final_usage``), as OpenAI streams it."""
    chunk: dict[str, Any] = {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [] if final_usage else [_choice(text, finish_reason, token_ids)],
    }
    if include_usage:
        chunk["usage"] = usage
    return chunk


def error_object(
    message: str, *, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
