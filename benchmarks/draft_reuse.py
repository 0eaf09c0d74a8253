"""Draft reuse over multi-turn conversations: the drafter's acceptance per turn with the draft mirror and without
it, against a ceiling measured in the same run.

``--conversations`` seeded conversations of ``--turns`` turns each run through one engine over the tiny
reference model and its derived drafter (``--spec-k`` drafts a step, greedy): turn i's prompt is every earlier
prompt and answer of its conversation plus a new prompt of random tokens (``--prompt-tokens LO HI`` of them),
submitted as a new request, so prefix reuse applies; each answer is ``--max-tokens`` tokens. The conversations
run concurrently, each one turn after another. Three modes run the same conversations, each with an engine of
its own; their tokens are the same (checked: ``tokens_identical``), only the drafts differ:

- ``draft_reuse``: the engine as built by default: the target's prefix reuse and the draft mirror, which
  indexes the draft blocks computed after a zero-filled gap, so a next turn's draft match covers them;
- ``no_draft_reuse``: ``EngineOptions(draft_reuse=False)``: the target still reuses the prefix, the drafter
  reads zeros for all of it;
- ``fresh``, **the ceiling**: an engine like ``draft_reuse`` whose prefix cache is dropped before every turn,
  so the drafter computes the draft KV of the whole prompt as a fresh run does. Snapshots, and the cap a
  snapshot boundary puts on a verify window's acceptance, are those of the other modes.

Acceptance is accepted over drafted tokens, summed over the conversations: ``turn1``, ``turns2plus`` and
``per_turn``; ``ratio_turns2plus`` is a mode's ``turns2plus`` over the ceiling's of the same repetition. Per turn
2+, rank 0's cache manager says how many reused tokens the draft mirror covered (``draft_hit_per_turn``) and
how many it zero-filled (``draft_zeroed_per_turn``). Each repetition (``--repeat``, default 3) runs new
conversations (seeds ``--seed + repetition``); every figure is the median over the repetitions, ``_spread`` its
``[min, max]``. Goal: with draft reuse, turns 2+ accept at least as often as turn 1, and more often than
without draft reuse.

``--snapshot-interval`` (default 4, every block of the tiny model) lets a turn's target reuse reach into the
previous answer, past the draft KV that turn could index (its drafter catches up one step late, and a draft
block needs the token after it), so turns start with a small gap; with a snapshot only at each prompt's end
(0) gaps are rare.

    python benchmarks/draft_reuse.py [--conversations 8] [--turns 8] [--prompt-tokens 12 32] [--max-tokens 24]
        [--spec-k 3] [--snapshot-interval 4] [--seed 0] [--repeat 3] [--threads 1]
        [--json benchmarks/results/<machine>/draft_reuse.json]
"""

from __future__ import annotations

import argparse
import random
from typing import Any

import anyio
import torch
from _provenance import median_spread, write_result

from kvferry.engine.runner import BuiltEngine, EngineOptions, build_engine

MODES = ("draft_reuse", "no_draft_reuse", "fresh")
#: the mode whose acceptance is the ceiling
CEILING = "fresh"


def conversation_prompts(seed: int, turns: int, low: int, high: int) -> list[list[int]]:
    """The new prompt of each turn of one conversation: random tokens of the tiny model's 256."""
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(low, high))] for _ in range(turns)]


def options(args: argparse.Namespace, mode: str) -> EngineOptions:
    longest = args.turns * (args.prompt_tokens[1] + args.max_tokens) + args.spec_k + 1
    blocks = -(-longest // 4) + 2
    return EngineOptions(
        dtype="float32",
        # room for every conversation's cache: no block or snapshot is evicted, so the target reuses the same
        # tokens in every mode and only the draft KV differs
        num_pages=2 * args.conversations * blocks + 1,
        num_slots=args.conversations * (blocks + 1) + 1,
        max_running=args.conversations,
        max_spec_k=args.spec_k,
        snapshot_interval=args.snapshot_interval,
        draft_reuse=mode != "no_draft_reuse",
        step_in_thread=False,
    )


async def run_mode(args: argparse.Namespace, mode: str, seeds: list[int]) -> dict[str, Any]:
    """Every conversation through one engine in ``mode``: per turn its answers, drafts and acceptances."""
    built: BuiltEngine = build_engine("tiny", options(args, mode))
    manager = built.cache.primary
    turns = args.turns
    drafted, accepted = [0] * turns, [0] * turns
    hit, zeroed, reused = [0] * turns, [0] * turns, [0] * turns
    answers: list[list[list[int]]] = [[] for _ in seeds]
    # the conversations take turns together: each turn's requests are submitted once every conversation has
    # finished its last turn, so each turn's cache-manager counts are that turn's alone
    prompts = [conversation_prompts(seed, turns, *args.prompt_tokens) for seed in seeds]
    history: list[list[int]] = [[] for _ in seeds]
    async with built.engine as engine:
        for turn in range(turns):
            if mode == "fresh":
                for m in built.cache.managers:
                    m.reset_prefix_cache()
            before = manager.statistics()

            async def one(c: int, turn: int = turn) -> None:
                prompt = [*history[c], *prompts[c][turn]]
                g = engine.generate(prompt, max_tokens=args.max_tokens, spec_k=args.spec_k)
                answer = await g.collect()
                s = g.statistics()
                drafted[turn] += s.num_drafted
                accepted[turn] += s.num_accepted
                reused[turn] += s.reused_tokens
                answers[c].append(answer)
                history[c] = [*prompt, *answer]

            async with anyio.create_task_group() as tg:
                for c in range(len(seeds)):
                    tg.start_soon(one, c)
            after = manager.statistics()
            hit[turn] = after.draft_hit_tokens - before.draft_hit_tokens
            zeroed[turn] = after.draft_zeroed_tokens - before.draft_zeroed_tokens

    def rate(a: int, d: int) -> float:
        return a / d if d else 0.0

    later = range(1, turns)
    n = len(seeds)
    return {
        "answers": answers,
        "turn1": rate(accepted[0], drafted[0]),
        "turns2plus": rate(sum(accepted[t] for t in later), sum(drafted[t] for t in later)),
        "per_turn": [rate(a, d) for a, d in zip(accepted, drafted, strict=True)],
        "drafted": sum(drafted),
        "reused_per_turn": sum(reused[t] for t in later) / (n * len(later)),
        "draft_hit_per_turn": sum(hit[t] for t in later) / (n * len(later)),
        "draft_zeroed_per_turn": sum(zeroed[t] for t in later) / (n * len(later)),
    }


#: the figures of a mode that are summarised over the repetitions
FIGURES = (
    "turn1",
    "turns2plus",
    "ratio_turns2plus",
    "reused_per_turn",
    "draft_hit_per_turn",
    "draft_zeroed_per_turn",
)


def repetition(args: argparse.Namespace, index: int) -> dict[str, dict[str, Any]]:
    base = (args.seed + index) * 1000
    seeds = [base + c for c in range(args.conversations)]
    runs = {mode: anyio.run(run_mode, args, mode, seeds) for mode in MODES}
    ceiling = runs[CEILING]["turns2plus"]
    for run in runs.values():
        run["ratio_turns2plus"] = run["turns2plus"] / ceiling if ceiling else 0.0
    return runs


def summarise(reps: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    modes: dict[str, Any] = {}
    for mode in MODES:
        row: dict[str, Any] = {}
        for key in FIGURES:
            row[key], row[f"{key}_spread"] = median_spread(rep[mode][key] for rep in reps)
        turns = len(reps[0][mode]["per_turn"])
        row["per_turn"] = [median_spread(rep[mode]["per_turn"][t] for rep in reps)[0] for t in range(turns)]
        row["drafted"] = [rep[mode]["drafted"] for rep in reps]
        modes[mode] = row
    identical = all(rep[mode]["answers"] == rep[MODES[0]]["answers"] for rep in reps for mode in MODES)
    on, off = modes["draft_reuse"], modes["no_draft_reuse"]
    return {
        "modes": modes,
        "tokens_identical": identical,
        "goal_turns2plus_at_least_turn1": on["turns2plus"] >= on["turn1"],
        "goal_above_no_draft_reuse": on["turns2plus"] > off["turns2plus"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[12, 32], metavar=("LO", "HI"))
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens of each answer")
    parser.add_argument("--spec-k", type=int, default=3)
    parser.add_argument("--snapshot-interval", type=int, default=4, help="a multiple of 4 (tiny's block)")
    parser.add_argument("--seed", type=int, default=0, help="the first repetition's conversations")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions, each of new conversations")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="write the stamped result here")
    args = parser.parse_args()
    if args.repeat < 1 or args.conversations < 1 or args.turns < 2 or args.spec_k < 1:
        parser.error("--repeat and --conversations must be at least 1, --turns 2, --spec-k 1")
    low, high = args.prompt_tokens
    if not 1 <= low <= high:
        parser.error("--prompt-tokens LO HI needs 1 <= LO <= HI")
    if args.snapshot_interval < 0 or args.snapshot_interval % 4:
        parser.error("--snapshot-interval must be a non-negative multiple of 4")
    torch.set_num_threads(args.threads)
    reps = []
    for index in range(args.repeat):
        reps.append(repetition(args, index))
        line = ", ".join(
            f"{mode} {reps[-1][mode]['turn1']:.3f} / {reps[-1][mode]['turns2plus']:.3f}" for mode in MODES
        )
        print(f"repetition {index + 1}/{args.repeat}: acceptance turn 1 / turns 2+: {line}", flush=True)
    result = summarise(reps)
    for mode, row in result["modes"].items():
        print(
            f"{mode:>15}: acceptance turn 1 {row['turn1']:.3f}, turns 2+ {row['turns2plus']:.3f} "
            f"({row['turns2plus_spread'][0]:.3f}-{row['turns2plus_spread'][1]:.3f}), ratio to {CEILING} "
            f"{row['ratio_turns2plus']:.2f}; per turn 2+: {row['reused_per_turn']:.1f} reused tokens, draft "
            f"{row['draft_hit_per_turn']:.1f} covered, {row['draft_zeroed_per_turn']:.1f} zero-filled"
        )
    print(
        f"tokens identical in every mode: {result['tokens_identical']}; goals: turns 2+ >= turn 1: "
        f"{result['goal_turns2plus_at_least_turn1']}, above no_draft_reuse: {result['goal_above_no_draft_reuse']}"
    )
    config = {
        "model": "tiny",
        "dtype": "float32",
        "conversations": args.conversations,
        "turns": args.turns,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "spec_k": args.spec_k,
        "snapshot_interval": args.snapshot_interval,
        "seed": args.seed,
        "repeat": args.repeat,
        "threads": args.threads,
        "statistic": "accepted / drafted over the conversations per repetition; median and [min, max] over "
        "--repeat repetitions of new conversations",
        "ceiling": "fresh: the same conversations with the prefix cache dropped before every turn (the drafter "
        "computes every prompt's draft KV)",
    }
    if args.json:
        write_result(args.json, "draft_reuse", {"config": config, "results": result}, "cpu")
    return 0 if result["tokens_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
