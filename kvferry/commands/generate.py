"""``kvferry generate``: generate tokens with the paged reference model (or a local NemotronH checkpoint)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from kvferry.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny",
        help="'tiny' (the built-in seeded reference model) or a local transformers NemotronH checkpoint directory",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--prompt",
        action="append",
        metavar="TEXT",
        help="prompt text (repeat for several prompts, run in order: later ones reuse shared prefixes)",
    )
    source.add_argument("--ids", nargs="+", type=int, metavar="N", help="prompt token ids")
    parser.add_argument("--max-tokens", type=int, required=True, metavar="N", help="tokens to generate")
    parser.add_argument("--spec-k", type=int, default=0, metavar="K", help="draft tokens per step (0: off)")
    parser.add_argument("--tp", type=int, default=1, metavar="N", help="simulated tensor-parallel ranks")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument(
        "--seed", type=int, default=None, metavar="S", help="sample with this seed (default: greedy)"
    )
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (with --seed)")
    parser.add_argument(
        "--stop-ids", nargs="+", type=int, default=[], metavar="N", help="stop after these ids"
    )
    parser.add_argument(
        "--weights-seed", type=int, default=0, metavar="S", help="seed of the tiny model's weights"
    )
    parser.add_argument("--num-pages", type=int, default=512, metavar="N", help="attention pages per rank")
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")


def run(args: argparse.Namespace) -> int:
    import anyio

    from kvferry.engine.runner import EngineOptions, build_engine
    from kvferry.engine.tokenizer import load_tokenizer

    if args.max_tokens < 1:
        raise ConfigError("--max-tokens must be at least 1")
    tokenizer = load_tokenizer(args.model)
    if args.prompt is not None:
        if tokenizer is None:
            raise ConfigError(f"{args.model} has no tokenizer: give token ids with --ids")
        prompts = [tokenizer.encode(text) for text in args.prompt]
    else:
        prompts = [list(args.ids)]
    built = build_engine(
        args.model,
        EngineOptions(
            tp=args.tp,
            dtype=args.dtype,
            seed=args.weights_seed,
            num_pages=args.num_pages,
            max_running=max(1, len(prompts)),
            max_spec_k=args.spec_k,
            step_in_thread=False,
        ),
    )
    results: list[dict[str, Any]] = []

    async def main() -> None:
        async with built.engine as engine:
            for prompt in prompts:
                started = time.perf_counter()
                generation = engine.generate(
                    prompt,
                    max_tokens=args.max_tokens,
                    stop_ids=args.stop_ids,
                    seed=args.seed,
                    temperature=args.temperature,
                    spec_k=args.spec_k,
                )
                tokens = await generation.collect()
                stats = generation.statistics()
                results.append(
                    {
                        "prompt_tokens": list(prompt),
                        "tokens": tokens,
                        "text": tokenizer.decode(tokens) if tokenizer is not None else None,
                        "finish_reason": stats.finish_reason,
                        "acceptance_rate": stats.acceptance_rate,
                        "num_drafted": stats.num_drafted,
                        "num_accepted": stats.num_accepted,
                        "reused_tokens": stats.reused_tokens,
                        "seconds": time.perf_counter() - started,
                    }
                )

    anyio.run(main)
    for result in results:
        if args.json:
            print(json.dumps(result))
        else:
            print(result["text"] if result["text"] is not None else " ".join(map(str, result["tokens"])))
            print(
                f"[{len(result['tokens'])} tokens, {result['finish_reason']}, "
                f"acceptance {result['acceptance_rate']:.2f}, reused {result['reused_tokens']}, "
                f"{result['seconds']:.2f} s]",
                file=sys.stderr,
            )
    return 0
