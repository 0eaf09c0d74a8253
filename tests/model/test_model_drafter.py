"""The Eagle-style drafter: speculative decoding with it gives the plain greedy tokens, and it is accepted often
but not always."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.model.drafter import Drafter, DrafterWeights, DraftInput
from kvferry.model.nemotron_h import DenseCache, Model, SequenceInput
from kvferry.model.weights import ModelWeights, tiny_args
from kvferry.pools.spec import ModelSpec, preset

SPEC = preset("tiny")
SPEC64 = SPEC.with_dtype("float64")
#: the prompts kvferry's tools default to: short byte strings and an id run
PROMPTS = [list(b"Hello, world!"), list(b"The quick brown fox"), list(b"kvferry"), list(range(100, 120))]
PAGES, DRAFT_PAGES, SLOTS = 128, 64, 4


def _pair(weights: ModelWeights, spec: ModelSpec, k: int, tp: int = 1) -> tuple[Model, Drafter]:
    caches = [
        DenseCache(
            spec.shard(tp, r),
            num_pages=PAGES,
            num_slots=SLOTS,
            num_draft_pages=DRAFT_PAGES,
            max_replay_tokens=k + 1,
        )
        for r in range(tp)
    ]
    model = Model.build(weights, spec, caches)
    assert spec.drafter is not None
    return model, Drafter.build(model, DrafterWeights.derived(weights, spec.drafter, seed=7))


def _tables(i: int) -> tuple[list[int], list[int]]:
    return list(range(i * 32, i * 32 + 32)), list(range(i * 16, i * 16 + 16))


def plain(model: Model, prompt: Sequence[int], new: int, slot: int) -> list[int]:
    table, _ = _tables(slot)
    out = model.step([SequenceInput(prompt, 0, table, slot)])
    tokens = [int(out.logits[0][-1].argmax())]
    while len(tokens) < new:
        out = model.step([SequenceInput([tokens[-1]], len(prompt) + len(tokens) - 1, table, slot)])
        tokens.append(int(out.logits[0][-1].argmax()))
    return tokens


def speculative(
    model: Model,
    drafter: Drafter,
    prompts: Sequence[Sequence[int]],
    new: int,
    k: int,
    *,
    prompt_draft_kv: bool = True,
) -> tuple[list[list[int]], int, int, list[list[tuple[int, ...]]]]:
    """All prompts decoded together: draft k, verify k+1, accept, catch the drafter up. Tokens, accepted and
    proposed draft counts, and every proposal made.

    ``prompt_draft_kv=False`` starts the drafter the way a generation engine does that did not receive the
    prompt's draft KV: from the prompt's last hidden state only, over zeroed draft pages."""
    batch = [SequenceInput(p, 0, _tables(i)[0], i) for i, p in enumerate(prompts)]
    out = model.step(batch)
    tokens = [[int(lg[-1].argmax())] for lg in out.logits]
    pos = [len(p) for p in prompts]
    if prompt_draft_kv:
        catch_up = [
            DraftInput(out.hidden[i], [*p[1:], tokens[i][0]], 0, _tables(i)[1]) for i, p in enumerate(prompts)
        ]
    else:
        catch_up = [
            DraftInput(out.hidden[i][-1:], [tokens[i][0]], len(p) - 1, _tables(i)[1])
            for i, p in enumerate(prompts)
        ]
    accepted = proposed = 0
    proposals: list[list[tuple[int, ...]]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        drafts = drafter.propose([catch_up[i] for i in live], k)
        verify = []
        for i, d in zip(live, drafts, strict=True):
            proposals[i].append(d.tokens)
            verify.append(
                SequenceInput(
                    [tokens[i][-1], *d.tokens], pos[i], _tables(i)[0], i, verify=True, all_logits=True
                )
            )
        out = model.step(verify)
        for j, i in enumerate(live):
            preds = out.logits[j].argmax(-1).tolist()
            drafted = drafts[j].tokens
            n = 0
            while n < k and drafted[n] == preds[n]:
                n += 1
            model.accept(i, n + 1)
            new_tokens = [*drafted[:n], preds[n]]
            catch_up[i] = DraftInput(out.hidden[j][: n + 1], new_tokens, pos[i], _tables(i)[1])
            tokens[i] += new_tokens
            pos[i] += n + 1
            accepted += n
            proposed += k
        live = [i for i in live if len(tokens[i]) < new]
    return [t[:new] for t in tokens], accepted, proposed, proposals


@pytest.mark.parametrize(("seed", "k"), [(0, 1), (1, 3), (2, 4)])
def test_speculative_decoding_gives_the_plain_tokens_and_is_accepted_20_to_90_percent(
    seed: int, k: int
) -> None:
    weights = ModelWeights.seeded(tiny_args(SPEC), seed)
    reference, _ = _pair(weights, SPEC, k)
    expected = [plain(reference, p, 20, i) for i, p in enumerate(PROMPTS)]
    model, drafter = _pair(weights, SPEC, k)
    tokens, accepted, proposed, _ = speculative(model, drafter, PROMPTS, 20, k)
    assert tokens == expected
    rate = accepted / proposed
    assert 0.2 <= rate <= 0.9, rate
    assert drafter.statistics()["drafted_tokens"] == proposed


@pytest.mark.parametrize("seed", [0, 3])
def test_leaving_the_prompts_draft_kv_behind_lowers_acceptance_and_keeps_the_tokens(seed: int) -> None:
    # longer random byte prompts (like kvferry demo's): the drafter's attention averages over the whole
    # context, so zeroed prompt positions leave its features uncentred
    rng = torch.Generator().manual_seed(100 + seed)
    prompts = [torch.randint(0, 256, (n,), generator=rng).tolist() for n in (19, 34, 62, 100)]
    weights = ModelWeights.seeded(tiny_args(SPEC64), seed, torch.float64)
    with_kv = speculative(*_pair(weights, SPEC64, 2), prompts, 12, 2)
    without = speculative(*_pair(weights, SPEC64, 2), prompts, 12, 2, prompt_draft_kv=False)
    assert without[0] == with_kv[0]  # verification keeps the tokens exact either way
    rate_with, rate_without = with_kv[1] / with_kv[2], without[1] / without[2]
    assert 0.2 <= rate_with <= 0.9, rate_with
    assert 0 < rate_without <= rate_with - 0.05, (rate_with, rate_without)  # both paths ran: accepts, rejects


def test_derived_drafter_is_a_pure_function_of_weights_and_seed() -> None:
    weights = ModelWeights.seeded(tiny_args(SPEC), 5)
    assert SPEC.drafter is not None
    first = DrafterWeights.derived(weights, SPEC.drafter, seed=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        second = DrafterWeights.derived(weights, SPEC.drafter, seed=2)
    finally:
        torch.set_num_threads(threads)
    assert first.tensors.keys() == second.tensors.keys()
    assert all(torch.equal(first[name], second[name]) for name in first.tensors)
    other = DrafterWeights.derived(weights, SPEC.drafter, seed=3)
    assert not torch.equal(first["fc.weight"], other["fc.weight"])
    assert all(t.dtype == torch.float32 for t in first.tensors.values())


def test_drafter_proposals_are_identical_across_tp_sizes() -> None:
    weights = ModelWeights.seeded(tiny_args(SPEC64), 3, torch.float64)
    runs = []
    for tp in (1, 2, 4):
        model, drafter = _pair(weights, SPEC64, 2, tp=tp)
        runs.append(speculative(model, drafter, PROMPTS[:2], 12, 2))
    assert runs[0][0] == runs[1][0] == runs[2][0]
    assert runs[0][3] == runs[1][3] == runs[2][3]


def test_garbage_in_draft_pages_changes_no_proposal() -> None:
    weights = ModelWeights.seeded(tiny_args(SPEC64), 4, torch.float64)
    clean = speculative(*_pair(weights, SPEC64, 3), PROMPTS[:2], 12, 3)
    model, drafter = _pair(weights, SPEC64, 3)
    for cache in model.caches:
        assert isinstance(cache, DenseCache)
        cache.fill_garbage(seed=11)
    assert speculative(model, drafter, PROMPTS[:2], 12, 3) == clean


def test_bad_draft_inputs_raise_before_writing() -> None:
    weights = ModelWeights.seeded(tiny_args(SPEC), 0)
    model, drafter = _pair(weights, SPEC, 2)
    out = model.step([SequenceInput([1, 2, 3], 0, [0], 0)])
    k_cache = model.caches[0].kv(SPEC.drafter.global_layer_ids[0])[0].clone()  # type: ignore[union-attr]
    good = DraftInput(out.hidden[0], [2, 3, 9], 0, [0])
    for bad, k in (
        ([], 2),
        ([good], 0),
        ([DraftInput(out.hidden[0], [2, 3], 0, [0])], 2),  # hidden rows != next tokens
        ([DraftInput(out.hidden[0], [2, 3, 256], 0, [0])], 2),  # outside vocab
        ([DraftInput(out.hidden[0], [2, 3, 9], 6, [0])], 2),  # table too short for start + n - 1 + k
        ([DraftInput(out.hidden[0], [2, 3, 9], 0, [DRAFT_PAGES])], 2),  # page out of range
    ):
        with pytest.raises(ConfigError):
            drafter.propose(bad, k)
    assert torch.equal(model.caches[0].kv(SPEC.drafter.global_layer_ids[0])[0], k_cache)  # type: ignore[union-attr]
    assert len(drafter.propose([good], 2)[0].tokens) == 2


def test_a_target_without_drafter_spec_refuses_a_drafter() -> None:
    spec = SPEC.without_drafter()
    weights = ModelWeights.seeded(tiny_args(spec), 0)
    model = Model.build(
        weights, spec, [DenseCache(spec.shard(1, 0), num_pages=4, num_slots=2, max_replay_tokens=2)]
    )
    with pytest.raises(ConfigError):
        Drafter.build(model, DrafterWeights.derived(weights, SPEC.drafter))  # type: ignore[arg-type]
