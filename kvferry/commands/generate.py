"""``kvferry generate``: generate tokens with the paged reference model (or a local NemotronH or KimiLinear
checkpoint).

Text streams to stdout as it is generated (characters that are not printable, such as control bytes, are
escaped: ``\\x1b``); a line of statistics per prompt goes to stderr. With ``--json``: one object per prompt,
printed as each prompt ends.

Seeds (``--seed``, ``--weights-seed``, and ``demo --seed``) are ints in [0, 2**62). Without ``--seed``
generation is greedy; ``--temperature`` applies to seeded sampling only and is refused without ``--seed``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from kvferry.commands._common import (
    add_device_arguments,
    check_device,
    check_model,
    check_tp,
    non_negative_int,
    positive_int,
    seed_int,
)
from kvferry.errors import ConfigError, PoolExhausted

if TYPE_CHECKING:
    from kvferry.engine.engine import Engine
    from kvferry.model.tokenizer import Tokenizer


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0.0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="a preset: tiny (the seeded reference model), tiny-kimi (the seeded KimiLinear reference: KDA, MLA, "
        "MoE), nemotron-h-1b, nemotron-h-8b (seeded weights at real proportions); or a local transformers "
        "NemotronH or KimiLinear checkpoint directory",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="prompt text (repeat for several prompts, run in order: later ones reuse shared prefixes)",
    )
    source.add_argument("--ids", nargs="+", type=int, metavar="N", help="prompt token ids")
    parser.add_argument(
        "--max-tokens", type=positive_int, required=True, metavar="N", help="tokens to generate"
    )
    parser.add_argument(
        "--spec-k", type=non_negative_int, default=0, metavar="K", help="draft tokens per step (0: off)"
    )
    parser.add_argument(
        "--tp", type=positive_int, default=1, metavar="N", help="simulated tensor-parallel ranks"
    )
    add_device_arguments(parser)
    parser.add_argument(
        "--seed", type=seed_int, default=None, metavar="S", help="sample with this seed (default: greedy)"
    )
    parser.add_argument(
        "--temperature",
        type=_temperature,
        default=None,
        metavar="T",
        help="sampling temperature (needs --seed; default 1.0)",
    )
    parser.add_argument(
        "--stop-ids", nargs="+", type=non_negative_int, default=[], metavar="N", help="stop after these ids"
    )
    parser.add_argument(
        "--weights-seed", type=seed_int, default=0, metavar="S", help="seed of a preset's weights"
    )
    parser.add_argument(
        "--num-pages", type=positive_int, default=512, metavar="N", help="attention pages per rank"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    chat = parser.add_argument_group("conversations")
    chat.add_argument(
        "--chat",
        action="store_true",
        help="the prompts are the turns of one conversation: turn i sees every earlier prompt and answer, and "
        "the cache is kept between turns",
    )
    chat.add_argument(
        "--offload-between-turns",
        action="store_true",
        help="with --chat: move the conversation's cache to host memory after each turn (the next restores it)",
    )
    chat.add_argument(
        "--rebalance-between-turns",
        action="store_true",
        help="with --chat: change the pool split between turns (more pages and slots, then back)",
    )
    chat.add_argument(
        "--drop-between-turns",
        action="store_true",
        help="with --chat: free the conversation's cache after each turn (the next computes it again)",
    )


def escape(text: str) -> str:
    """``text`` safe for a terminal: newlines and tabs stay, other unprintable characters are escaped."""
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape").decode("ascii") for c in text
    )


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a ``--prompt``. Arguments that are not valid UTF-8 reach Python as lone surrogates: the
    byte-level tiny model takes their bytes as they are; a checkpoint's tokenizer needs text."""
    from kvferry.model.tokenizer import ByteTokenizer

    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        if isinstance(tokenizer, ByteTokenizer):
            return list(os.fsencode(text))
        raise ConfigError(
            f"--prompt {text.encode('utf-8', 'backslashreplace').decode()!r} is not valid UTF-8; "
            "this model's tokenizer needs text (or give --ids)"
        ) from None
    return tokenizer.encode(text)


class _TextStream:
    """Prints a prompt's text as its tokens arrive: whatever of the decoded text is final (a multi-byte
    character split over tokens waits for its last byte), escaped for the terminal."""

    def __init__(self, tokenizer: Tokenizer | None, out: TextIO) -> None:
        self.tokenizer = tokenizer
        self.out = out
        self.tokens: list[int] = []
        self.shown = ""

    def add(self, token: int) -> None:
        self.tokens.append(token)
        if self.tokenizer is None:
            self.out.write(("" if len(self.tokens) == 1 else " ") + str(token))
            self.out.flush()
            return
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return  # maybe a character still incomplete: wait for the next token (or the end)
        self._show(text)

    def _show(self, text: str) -> None:
        if not text.startswith(self.shown):
            return  # the tokenizer rewrote text already shown (rare): keep what is on screen
        self.out.write(escape(text[len(self.shown) :]))
        self.out.flush()
        self.shown = text

    def end(self) -> None:
        if self.tokenizer is not None:
            self._show(self.tokenizer.decode(self.tokens))
        self.out.write("\n")
        self.out.flush()


def _pages_needed(prompt: list[int], args: argparse.Namespace, tokens_per_block: int) -> int:
    max_tokens: int = args.max_tokens
    return math.ceil((len(prompt) + max_tokens - 1) / tokens_per_block)


def _cannot_fit(
    index: int, prompt: list[int], args: argparse.Namespace, tokens_per_block: int
) -> ConfigError:
    needed = _pages_needed(prompt, args, tokens_per_block)
    return ConfigError(
        f"prompt {index} ({len(prompt)} tokens) with --max-tokens {args.max_tokens} needs about "
        f"{needed} pages of {tokens_per_block} tokens; --num-pages {args.num_pages} holds "
        f"{args.num_pages - 1} (page 0 is reserved): raise --num-pages to at least {needed + 1}"
    )


def run(args: argparse.Namespace) -> int:
    import anyio

    from kvferry.engine.runner import EngineOptions, build_engine
    from kvferry.model.tokenizer import load_tokenizer

    if args.temperature is not None and args.seed is None:
        raise ConfigError(
            "--temperature needs --seed S: sampling is seeded (reproducible per seed); without --seed "
            "generation is greedy"
        )
    temperature = 1.0 if args.temperature is None else args.temperature
    between = [f for f in ("offload_between_turns", "drop_between_turns") if getattr(args, f)]
    if (between or args.rebalance_between_turns) and not args.chat:
        flag = between[0] if between else "rebalance_between_turns"
        raise ConfigError(f"--{flag.replace('_', '-')} needs --chat")
    if len(between) > 1:
        raise ConfigError("--offload-between-turns and --drop-between-turns exclude each other")
    if args.chat and args.prompt is None:
        raise ConfigError("--chat takes its turns as --prompt TEXT (one per turn)")
    check_model(args.model)
    check_tp(args.model, "--tp", args.tp)
    check_device(args.device)
    tokenizer = load_tokenizer(args.model)
    if args.prompt is not None:
        if tokenizer is None:
            raise ConfigError(f"{args.model} has no tokenizer: give token ids with --ids")
        prompts = [_encode(tokenizer, text) for text in args.prompt]
    else:
        prompts = [list(args.ids)]
    built = build_engine(
        args.model,
        EngineOptions(
            tp=args.tp,
            dtype=args.dtype,
            device=args.device,
            seed=args.weights_seed,
            num_pages=args.num_pages,
            max_running=max(1, len(prompts)),
            max_spec_k=args.spec_k,
            step_in_thread=False,
        ),
    )
    tokens_per_block = built.runner.model.spec.tokens_per_block
    for index, prompt in enumerate(prompts):
        # at once, not after generating what fits: the last token's KV is never written
        if _pages_needed(prompt, args, tokens_per_block) > args.num_pages - 1:
            raise _cannot_fit(index, prompt, args, tokens_per_block)

    if args.chat:
        # every turn's prompt holds the earlier turns: check the whole conversation's worst case
        total = [t for prompt in prompts for t in prompt] + [0] * (args.max_tokens * (len(prompts) - 1))
        if _pages_needed(total, args, tokens_per_block) > args.num_pages - 1:
            raise _cannot_fit(len(prompts) - 1, total, args, tokens_per_block)
        anyio.run(_chat, args, built.engine, prompts, tokenizer, temperature)
        return 0

    async def main() -> None:
        async with built.engine as engine:
            for index, prompt in enumerate(prompts):
                started = time.perf_counter()
                generation = engine.generate(
                    prompt,
                    max_tokens=args.max_tokens,
                    stop_ids=args.stop_ids,
                    seed=args.seed,
                    temperature=temperature,
                    spec_k=args.spec_k,
                )
                stream = None if args.json else _TextStream(tokenizer, sys.stdout)
                tokens: list[int] = []
                try:
                    async for token in generation:
                        tokens.append(token)
                        if stream is not None:
                            stream.add(token)
                except PoolExhausted as exc:
                    if stream is not None:
                        stream.end()
                    raise _cannot_fit(index, prompt, args, tokens_per_block) from exc
                if stream is not None:
                    stream.end()
                _report(args, prompt, tokens, tokenizer, generation.statistics(), started)

    anyio.run(main)
    return 0


async def _chat(
    args: argparse.Namespace,
    engine: Engine,
    prompts: list[list[int]],
    tokenizer: Tokenizer | None,
    temperature: float,
) -> None:
    """The prompts as the turns of one conversation, with what ``--*-between-turns`` asks for between them."""
    async with engine:
        with engine.conversation(spec_k=args.spec_k) as conversation:
            base = engine.cache.primary.config  # type: ignore[attr-defined]
            for index, prompt in enumerate(prompts):
                if index and args.offload_between_turns:
                    await conversation.offload()
                elif index and args.drop_between_turns:
                    conversation.drop()
                if index and args.rebalance_between_turns:
                    grown = index % 2  # more pages and slots after odd turns, back after even ones
                    await engine.rebalance(
                        num_pages=base.num_pages + grown * base.num_pages // 2,
                        num_slots=base.num_slots + grown * 8,
                    )
                started = time.perf_counter()
                turn = conversation.turn(
                    prompt,
                    max_tokens=args.max_tokens,
                    stop_ids=args.stop_ids,
                    seed=args.seed,
                    temperature=temperature,
                )
                stream = None if args.json else _TextStream(tokenizer, sys.stdout)
                tokens: list[int] = []
                async for token in turn:
                    tokens.append(token)
                    if stream is not None:
                        stream.add(token)
                if stream is not None:
                    stream.end()
                done = conversation.turns[-1]
                extra = {
                    "turn": index,
                    "restored_bytes": done.restored_bytes,
                    "recomputed_tokens": done.recomputed_tokens,
                }
                _report(args, prompt, tokens, tokenizer, turn.statistics(), started, extra)


def _report(
    args: argparse.Namespace,
    prompt: list[int],
    tokens: list[int],
    tokenizer: Tokenizer | None,
    stats: Any,
    started: float,
    extra: dict[str, int] | None = None,
) -> None:
    seconds = time.perf_counter() - started
    if args.json:
        result = {
            "prompt_tokens": list(prompt),
            "tokens": tokens,
            "text": tokenizer.decode(tokens) if tokenizer is not None else None,
            "finish_reason": stats.finish_reason,
            "acceptance_rate": stats.acceptance_rate,
            "num_drafted": stats.num_drafted,
            "num_accepted": stats.num_accepted,
            "reused_tokens": stats.reused_tokens,
            **(extra or {}),
            "seconds": seconds,
        }
        print(json.dumps(result), flush=True)
        return
    more = "".join(
        f", {key.replace('_', ' ')} {value}" for key, value in (extra or {}).items() if key != "turn"
    )
    print(
        f"[{len(tokens)} tokens, {stats.finish_reason}, acceptance {stats.acceptance_rate:.2f}, "
        f"reused {stats.reused_tokens}{more}, {seconds:.2f} s]",
        file=sys.stderr,
        flush=True,
    )
