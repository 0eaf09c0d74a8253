"""The paged NemotronH model against transformers, and against itself across chunking, batching, TP and replay."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.model.nemotron_h import CacheViews, DenseCache, Model, SequenceInput
from kvferry.model.weights import ModelWeights, NemotronHArgs, hf_generate, hf_model, tiny_args
from kvferry.pools.spec import ModelSpec, preset

SPEC64 = preset("tiny").with_dtype("float64")
PAGES, SLOTS, REPLAY = 48, 6, 5


def _caches(spec: ModelSpec, tp: int = 1, kind: str = "dense") -> list[CacheViews]:
    if kind == "arena":
        arena = pytest.importorskip("kvferry.pools.arena")
        layout = pytest.importorskip("kvferry.pools.layout")
        return [
            arena.CacheArena(
                layout.CacheLayout.build(
                    spec.shard(tp, r),
                    num_pages=PAGES,
                    num_slots=SLOTS,
                    num_draft_pages=16,
                    max_replay_tokens=REPLAY,
                ),
                "cpu",
            )
            for r in range(tp)
        ]
    return [
        DenseCache(
            spec.shard(tp, r), num_pages=PAGES, num_slots=SLOTS, num_draft_pages=16, max_replay_tokens=REPLAY
        )
        for r in range(tp)
    ]


def _model(weights: ModelWeights, tp: int = 1, kind: str = "dense", spec: ModelSpec = SPEC64) -> Model:
    return Model.build(weights, spec, _caches(spec, tp, kind))


def _table(slot: int, blocks: int = 8) -> list[int]:
    # interleaved, non-monotonic page ids so that sequences share no page and order matters
    return [(slot + SLOTS * b) * 7 % PAGES for b in range(blocks)]


def greedy(
    model: Model, prompt: Sequence[int], new: int, *, slot: int = 1, chunk: int | None = None
) -> tuple[list[int], torch.Tensor]:
    """Chunked prefill then plain decode; the tokens and the logits that chose them."""
    table = _table(slot)
    chunk = chunk or len(prompt)
    for begin in range(0, len(prompt), chunk):
        out = model.step([SequenceInput(prompt[begin : begin + chunk], begin, table, slot)])
    tokens, logits = [], []
    pos = len(prompt)
    for _ in range(new):
        row = out.logits[0][-1]
        tokens.append(int(row.argmax()))
        logits.append(row)
        if len(tokens) < new:
            out = model.step([SequenceInput([tokens[-1]], pos, table, slot)])
            pos += 1
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module")
def weights64() -> dict[int, ModelWeights]:
    args = tiny_args(SPEC64)
    return {seed: ModelWeights.seeded(args, seed, torch.float64) for seed in (0, 1, 2)}


# --- the transformers oracle ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("seed", "prompt_len"), [(0, 3), (1, 9), (2, 17), (0, 13)])
def test_greedy_tokens_and_logits_equal_transformers_generate(
    weights64: dict[int, ModelWeights], seed: int, prompt_len: int
) -> None:
    # prompt lengths cross tokens_per_block (4) and the Mamba2 scan chunk (8); 12 new tokens cross more blocks
    w = weights64[seed]
    prompt = [(seed * 37 + 11 * i) % 256 for i in range(prompt_len)]
    ref_tokens, ref_logits = hf_generate(hf_model(w), prompt, 12)
    tokens, logits = greedy(_model(w), prompt, 12)
    assert tokens == ref_tokens
    assert len(set(tokens)) > 4  # the seeded weights do not collapse onto one token
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-9)


def test_float32_tokens_equal_transformers_float32() -> None:
    spec = preset("tiny")
    w = ModelWeights.seeded(tiny_args(spec), 3, torch.float32)
    prompt = list(range(40, 50))
    ref_tokens, ref_logits = hf_generate(hf_model(w), prompt, 10, exact=False)
    tokens, logits = greedy(_model(w, spec=spec), prompt, 10)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)


def test_checkpoint_written_by_save_pretrained_loads_to_the_same_model(
    weights64: dict[int, ModelWeights], tmp_path: Path
) -> None:
    w = weights64[1]
    hf_model(w).save_pretrained(tmp_path)
    loaded = ModelWeights.from_checkpoint(tmp_path)
    assert loaded.args == w.args
    assert loaded.tensors.keys() == w.tensors.keys()
    assert all(torch.equal(loaded[k], w[k]) for k in w.tensors)
    # and our own writer round-trips too
    ours = tmp_path / "ours"
    w.save_checkpoint(ours)
    again = ModelWeights.from_checkpoint(ours, torch.float32)
    assert again.dtype == torch.float32
    assert torch.equal(again["lm_head.weight"], w["lm_head.weight"].float())


def test_bad_checkpoints_are_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        ModelWeights.from_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError):
        ModelWeights.from_checkpoint(tmp_path)
    (tmp_path / "x.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(ConfigError):
        ModelWeights.from_checkpoint(tmp_path)


# --- self-consistency ------------------------------------------------------------------------------------------


def test_prefill_chunk_size_does_not_change_tokens(weights64: dict[int, ModelWeights]) -> None:
    w = weights64[0]
    prompt = [(5 * i + 3) % 256 for i in range(19)]
    ref_tokens, ref_logits = greedy(_model(w), prompt, 8)
    for chunk in (1, 3, 4, 5, 8):
        tokens, logits = greedy(_model(w), prompt, 8, chunk=chunk)
        assert tokens == ref_tokens, chunk
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-9)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_ranks_give_identical_tokens(weights64: dict[int, ModelWeights], tp: int) -> None:
    w = weights64[2]
    prompt = [(9 * i + 1) % 256 for i in range(14)]
    ref_tokens, ref_logits = greedy(_model(w), prompt, 10, chunk=6)
    tokens, logits = greedy(_model(w, tp=tp), prompt, 10, chunk=6)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-9)


def test_tensor_parallel_ranks_hold_only_their_shard(weights64: dict[int, ModelWeights]) -> None:
    model = _model(weights64[0], tp=4)
    shards = model.rank_weights
    q = shards[1]["model.layers.1.mixer.q_proj.weight"]
    assert q.shape == (2 * 16, 64)
    assert torch.equal(q, weights64[0]["model.layers.1.mixer.q_proj.weight"][32:64])
    # 4 ranks, 2 Mamba groups: ranks 0, 1 hold group 0's B/C, ranks 2, 3 group 1's (duplicated)
    assert shards[2]["model.layers.0.mixer.in_proj.weight"].shape == (32 + 32 + 16 + 16 + 2, 64)
    assert model.caches[3].conv(0).shape == (SLOTS, 32 + 16 + 16, 3)


def test_batched_sequences_match_running_alone(weights64: dict[int, ModelWeights]) -> None:
    w = weights64[1]
    prompts = {0: [1, 2, 3, 4, 5, 6, 7], 2: [200, 100], 3: list(range(60, 73)), 5: [9] * 5}
    alone = {slot: greedy(_model(w), p, 6, slot=slot) for slot, p in prompts.items()}
    model = _model(w)
    # staggered: slot 3 prefills in chunks while the others already decode
    out_tokens: dict[int, list[int]] = {s: [] for s in prompts}
    pos = dict.fromkeys(prompts, 0)
    pending: dict[int, int] = {}
    for _ in range(12):
        batch = []
        for slot, prompt in prompts.items():
            if len(out_tokens[slot]) >= 6:
                continue
            if pos[slot] < len(prompt):
                chunk = prompt[pos[slot] : pos[slot] + (4 if slot == 3 else 100)]
            else:
                chunk = [pending[slot]]
            batch.append(SequenceInput(chunk, pos[slot], _table(slot), slot))
        if not batch:
            break
        out = model.step(batch)
        for seq, logits in zip(batch, out.logits, strict=True):
            pos[seq.slot] += len(seq.token_ids)
            if pos[seq.slot] >= len(prompts[seq.slot]):
                pending[seq.slot] = int(logits[-1].argmax())
                out_tokens[seq.slot].append(pending[seq.slot])
    assert out_tokens == {slot: tokens for slot, (tokens, _) in alone.items()}


@pytest.mark.parametrize("kind", ["dense", "arena"])
def test_garbage_in_free_pages_and_slots_changes_nothing(
    weights64: dict[int, ModelWeights], kind: str
) -> None:
    w = weights64[0]
    prompt = [(13 * i) % 256 for i in range(10)]
    clean = _model(w, kind=kind)
    ref_tokens, ref_logits = greedy(clean, prompt, 8, slot=2)
    dirty = _model(w, kind=kind)
    for cache in dirty.caches:
        if isinstance(cache, DenseCache):
            cache.fill_garbage(seed=4)
        else:
            for group in ("attention", "draft"):
                cache.fill_garbage(group, range(cache.layout.pool_group(group).num_slots))  # type: ignore[attr-defined]
            cache.fill_garbage("mamba2", range(SLOTS))  # type: ignore[attr-defined]
            cache.num_accepted.fill_(3)
    tokens, logits = greedy(dirty, prompt, 8, slot=2)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)


# --- speculative verify + replay -----------------------------------------------------------------------------


def spec_decode(
    model: Model, prompt: Sequence[int], new: int, k: int, drafts_for: Callable[[int, list[int]], list[int]]
) -> tuple[list[int], list[int], torch.Tensor]:
    """Greedy decoding through verify steps: the tokens, accepted counts per round, and the choosing logits."""
    slot, table = 4, _table(4, 12)
    out = model.step([SequenceInput(prompt, 0, table, slot)])
    tokens = [int(out.logits[0][-1].argmax())]
    chosen = [out.logits[0][-1]]
    pos, accepted = len(prompt), []
    round_ = 0
    while len(tokens) < new:
        drafts = drafts_for(round_, tokens)[:k]
        out = model.step(
            [SequenceInput([tokens[-1], *drafts], pos, table, slot, verify=True, all_logits=True)]
        )
        preds = out.logits[0].argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == preds[n]:
            n += 1
        model.accept(slot, n + 1)
        tokens += [*drafts[:n], preds[n]]
        chosen += list(out.logits[0][: n + 1])
        pos += n + 1
        accepted.append(n)
        round_ += 1
    return tokens[:new], accepted, torch.stack(chosen[:new])


@pytest.mark.parametrize("k", [1, 2, 4])
def test_verify_and_replay_give_the_plain_decode_tokens(weights64: dict[int, ModelWeights], k: int) -> None:
    w = weights64[2]
    prompt = [(7 * i + 2) % 256 for i in range(9)]
    ref_tokens, ref_logits = greedy(_model(w), prompt, 20)

    def drafts(round_: int, tokens: list[int]) -> list[int]:
        # the true continuation with one token spoiled at a round-dependent place (some rounds none)
        true = ref_tokens[len(tokens) : len(tokens) + k]
        true += [0] * (k - len(true))
        spoil = round_ % (k + 2)
        if spoil < k:
            true[spoil] = (true[spoil] + 1) % 256
        return true

    model = _model(w)
    tokens, accepted, logits = spec_decode(model, prompt, 20, k, drafts)
    assert tokens == ref_tokens
    assert 0 in accepted and k in accepted  # both reject and full-accept paths ran
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-9)
    stats = model.statistics()
    assert stats["replayed_tokens"] > 0 and stats["verify_tokens"] > 0


def test_a_verify_step_leaves_the_slot_state_alone(weights64: dict[int, ModelWeights]) -> None:
    model = _model(weights64[0])
    table = _table(1)
    model.step([SequenceInput([1, 2, 3, 4, 5], 0, table, 1)])
    cache = model.caches[0]
    conv, ssm = cache.conv(0)[1].clone(), cache.ssm(4)[1].clone()
    model.step([SequenceInput([6, 7, 8], 5, table, 1, verify=True, all_logits=True)])
    assert torch.equal(cache.conv(0)[1], conv) and torch.equal(cache.ssm(4)[1], ssm)
    assert int(cache.num_accepted[1]) == 0
    model.accept(1, 2)
    assert int(cache.num_accepted[1]) == 2
    # the next step replays 2 tokens, then decodes token 9 at position 7
    model.step([SequenceInput([9], 7, table, 1)])
    assert int(cache.num_accepted[1]) == 0
    plain = _model(weights64[0])
    plain.step([SequenceInput([1, 2, 3, 4, 5], 0, table, 1)])
    for t, p in ((6, 5), (7, 6), (9, 7)):
        plain.step([SequenceInput([t], p, table, 1)])
    torch.testing.assert_close(cache.ssm(4)[1], plain.caches[0].ssm(4)[1], rtol=0, atol=1e-12)
    torch.testing.assert_close(cache.conv(2)[1], plain.caches[0].conv(2)[1], rtol=0, atol=1e-12)


# --- bad input -------------------------------------------------------------------------------------------------


def _snapshot(model: Model) -> list[torch.Tensor]:
    c = model.caches[0]
    return [
        c.kv(1)[0].clone(),
        c.conv(0).clone(),
        c.ssm(0).clone(),
        c.replay(0).clone(),
        c.num_accepted.clone(),
    ]


@pytest.mark.parametrize(
    "batch",
    [
        [],
        [SequenceInput([1], 0, [0], 1), SequenceInput([2], 0, [1], 1)],  # same slot twice
        [SequenceInput([1, 2, 3, 4, 5], 0, [0], 1)],  # block table too short
        [SequenceInput([1], 0, [PAGES], 1)],  # page id out of range
        [SequenceInput([256], 0, [0], 1)],  # token outside vocab
        [SequenceInput([1], 0, [0], SLOTS)],  # slot out of range
        [SequenceInput([], 0, [0], 1)],  # no tokens
        [
            SequenceInput([1] * (REPLAY + 1), 0, [0, 1], 1, verify=True)
        ],  # verify longer than the replay buffer
    ],
)
def test_bad_batches_raise_and_change_nothing(
    weights64: dict[int, ModelWeights], batch: list[SequenceInput]
) -> None:
    model = _model(weights64[0])
    model.step([SequenceInput([5, 6, 7], 0, [3], 2)])
    before = _snapshot(model)
    with pytest.raises(ConfigError):
        model.step(batch)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model), strict=True))


def test_garbage_num_accepted_on_a_resumed_slot_is_refused(weights64: dict[int, ModelWeights]) -> None:
    model = _model(weights64[0])
    model.step([SequenceInput([5, 6, 7], 0, [3], 2)])
    model.caches[0].num_accepted[2] = REPLAY + 1
    with pytest.raises(ConfigError):
        model.step([SequenceInput([8], 3, [3], 2)])
    with pytest.raises(ConfigError):
        model.accept(2, REPLAY + 1)


def test_mismatched_caches_and_configs_are_refused(weights64: dict[int, ModelWeights]) -> None:
    w = weights64[0]
    with pytest.raises(ConfigError):
        Model.build(w, SPEC64, [])
    with pytest.raises(ConfigError):  # a tp=2 rank's cache handed to a tp=1 model
        Model.build(
            w, SPEC64, [DenseCache(SPEC64.shard(2, 0), num_pages=4, num_slots=2, max_replay_tokens=2)]
        )
    with pytest.raises(ConfigError):
        NemotronHArgs.from_config({"hidden_size": 8})
    with pytest.raises(ConfigError):
        ModelWeights(w.args, {k: v for k, v in w.tensors.items() if k != "lm_head.weight"})
