"""The paged KimiLinear model against transformers (float64), and against itself across chunking, batching, TP
and speculative replay.

Two specs: ``mla`` (tiny-kimi's dims, every layer full attention: MLA + dense MLP / MoE, legal in transformers)
and ``tiny-kimi`` itself (KDA and MLA layers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.model.family import build_model
from kvferry.model.kimi_args import KimiLinearArgs, tiny_kimi_args
from kvferry.model.kimi_linear import KimiLinearModel
from kvferry.model.nemotron_h import DenseCache, Model, SequenceInput
from kvferry.model.weights import ModelWeights, hf_generate, hf_model, tiny_args
from kvferry.pools.spec import LayerKind, ModelSpec, preset

pytest.importorskip("transformers")

PAGES, SLOTS, REPLAY = 48, 6, 5
TINY_KIMI = preset("tiny-kimi").with_dtype("float64")
#: tiny-kimi's dims with every layer MLA
MLA_ONLY = attrs.evolve(TINY_KIMI, layer_kinds=(LayerKind.ATTENTION,) * TINY_KIMI.num_layers, kda=None)
SPECS = [
    pytest.param(MLA_ONLY, id="mla"),
    pytest.param(TINY_KIMI, id="tiny-kimi"),
]


def _caches(spec: ModelSpec, tp: int = 1, kind: str = "dense") -> list[Any]:
    if kind == "arena":
        from kvferry.pools.arena import CacheArena
        from kvferry.pools.layout import CacheLayout

        return [
            CacheArena(
                CacheLayout.build(
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


def _model(weights: ModelWeights, spec: ModelSpec, tp: int = 1, kind: str = "dense") -> KimiLinearModel:
    model = build_model(weights, spec, _caches(spec, tp, kind))
    assert isinstance(model, KimiLinearModel)
    return model


def _table(slot: int, blocks: int = 10) -> list[int]:
    # interleaved, non-monotonic page ids so that sequences share no page and order matters
    return [(slot + SLOTS * b) * 7 % PAGES for b in range(blocks)]


def greedy(
    model: KimiLinearModel, prompt: Sequence[int], new: int, *, slot: int = 1, chunk: int | None = None
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


_WEIGHTS: dict[tuple[str, int], ModelWeights] = {}


def weights_of(spec: ModelSpec, seed: int) -> ModelWeights:
    key = (",".join(k.value for k in spec.layer_kinds), seed)
    if key not in _WEIGHTS:
        _WEIGHTS[key] = ModelWeights.seeded(tiny_kimi_args(spec), seed, torch.float64)
    return _WEIGHTS[key]


# --- the transformers oracle ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize(("seed", "prompt_len"), [(0, 3), (1, 9), (2, 17)])
def test_greedy_tokens_and_logits_equal_transformers_generate(
    spec: ModelSpec, seed: int, prompt_len: int
) -> None:
    # prompt lengths cross tokens_per_block (4); 12 new tokens cross more blocks
    w = weights_of(spec, seed)
    prompt = [(seed * 37 + 11 * i) % 256 for i in range(prompt_len)]
    ref_tokens, ref_logits = hf_generate(hf_model(w), prompt, 12)
    tokens, logits = greedy(_model(w, spec), prompt, 12)
    assert tokens == ref_tokens
    assert len(set(tokens)) > 4  # the seeded weights do not collapse onto one token
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-9)


@pytest.mark.parametrize("spec", SPECS)
def test_float32_tokens_equal_transformers_float32(spec: ModelSpec) -> None:
    spec32 = spec.with_dtype("float32")
    w = ModelWeights.seeded(tiny_kimi_args(spec32), 3, torch.float32)
    prompt = list(range(40, 50))
    ref_tokens, ref_logits = hf_generate(hf_model(w), prompt, 10, exact=False)
    tokens, logits = greedy(_model(w, spec32), prompt, 10)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-4)


def test_the_seeded_router_uses_every_expert_and_its_bias_changes_choices() -> None:
    # otherwise the MoE equality above could hold with a degenerate router
    from kvferry.model.moe import route

    w = weights_of(MLA_ONLY, 0)
    args = w.args
    assert isinstance(args, KimiLinearArgs)
    h = torch.randn(64, args.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    p = "model.layers.3.mlp.gate."
    kw = dict(top_k=2, n_group=2, topk_group=1, norm_topk_prob=True, scaling=2.446)
    _, experts = route(h, w[p + "weight"], w[p + "e_score_correction_bias"], **kw)  # type: ignore[arg-type]
    _, unbiased = route(h, w[p + "weight"], torch.zeros(8, dtype=torch.float64), **kw)  # type: ignore[arg-type]
    assert set(experts.flatten().tolist()) == set(range(8))
    assert not torch.equal(experts.sort(-1).values, unbiased.sort(-1).values)


def test_an_unseen_checkpoint_saved_by_transformers_gives_its_tokens(tmp_path: Path) -> None:
    # other dims than tiny-kimi (odd head dims, 3 experts of 4 groups chosen, q_lora), another seed
    args = KimiLinearArgs(
        hidden_size=40,
        vocab_size=300,
        layer_types=("full_attention",) * 3,
        mlp_layer_types=("sparse", "dense", "sparse"),
        intermediate_size=72,
        moe_intermediate_size=20,
        num_attention_heads=2,
        kv_lora_rank=12,
        qk_rope_head_dim=4,
        qk_nope_head_dim=6,
        v_head_dim=10,
        num_experts=12,
        num_experts_per_tok=3,
        linear_num_heads=2,
        linear_head_dim=8,
        q_lora_rank=24,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=1.3,
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
    )
    hf = hf_model(ModelWeights.seeded(args, 11, torch.float64))
    hf.save_pretrained(tmp_path)
    loaded = ModelWeights.from_checkpoint(tmp_path)
    assert loaded.args == args
    spec = loaded.args.model_spec(tokens_per_block=3, dtype="float64")
    prompt = [(7 * i + 5) % 300 for i in range(10)]
    ref_tokens, ref_logits = hf_generate(hf, prompt, 10)
    tokens, logits = greedy(_model(loaded, spec), prompt, 10, chunk=4)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-9)


# --- self-consistency ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_prefill_chunk_size_does_not_change_tokens(spec: ModelSpec) -> None:
    w = weights_of(spec, 0)
    prompt = [(5 * i + 3) % 256 for i in range(19)]
    ref_tokens, ref_logits = greedy(_model(w, spec), prompt, 8)
    for chunk in (1, 3, 4, 7):
        tokens, logits = greedy(_model(w, spec), prompt, 8, chunk=chunk)
        assert tokens == ref_tokens, chunk
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-9)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_ranks_give_identical_tokens(spec: ModelSpec, tp: int) -> None:
    w = weights_of(spec, 2)
    prompt = [(9 * i + 1) % 256 for i in range(14)]
    ref_tokens, ref_logits = greedy(_model(w, spec), prompt, 10, chunk=6)
    tokens, logits = greedy(_model(w, spec, tp=tp), prompt, 10, chunk=6)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-9)


def test_tensor_parallel_ranks_hold_only_their_shard() -> None:
    w = weights_of(MLA_ONLY, 0)
    shards = _model(w, MLA_ONLY, tp=4).rank_tensors
    a, m = "model.layers.2.self_attn.", "model.layers.2.mlp."
    # one query head of 24 channels, its 32 kv_b rows and 16 o_proj columns; the latent projection whole
    assert torch.equal(shards[1][a + "q_proj.weight"], w[a + "q_proj.weight"][24:48])
    assert torch.equal(shards[1][a + "kv_b_proj.weight"], w[a + "kv_b_proj.weight"][32:64])
    assert torch.equal(shards[1][a + "o_proj.weight"], w[a + "o_proj.weight"][:, 16:32])
    assert shards[3][a + "kv_a_proj_with_mqa.weight"] is w[a + "kv_a_proj_with_mqa.weight"]
    # every expert, 8 of its 32 intermediate channels (gate rows then up rows)
    gate_up = w[m + "experts.gate_up_proj"]
    assert torch.equal(
        shards[2][m + "experts.gate_up_proj"], torch.cat((gate_up[:, 16:24], gate_up[:, 48:56]), 1)
    )
    assert torch.equal(shards[2][m + "experts.down_proj"], w[m + "experts.down_proj"][:, :, 16:24])
    assert shards[0]["model.layers.0.mlp.gate_proj.weight"].shape == (32, 64)
    with pytest.raises(ConfigError):  # 4 query heads do not split over 8 ranks
        _model(w, MLA_ONLY, tp=8)


@pytest.mark.parametrize("spec", SPECS)
def test_batched_sequences_match_running_alone(spec: ModelSpec) -> None:
    w = weights_of(spec, 1)
    prompts = {0: [1, 2, 3, 4, 5, 6, 7], 2: [200, 100], 3: list(range(60, 73)), 5: [9] * 5}
    alone = {slot: greedy(_model(w, spec), p, 6, slot=slot) for slot, p in prompts.items()}
    model = _model(w, spec)
    # staggered: slot 3 prefills in chunks while the others already decode
    out_tokens: dict[int, list[int]] = {s: [] for s in prompts}
    out_logits: dict[int, list[torch.Tensor]] = {s: [] for s in prompts}
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
                out_logits[seq.slot].append(logits[-1])
    assert out_tokens == {slot: tokens for slot, (tokens, _) in alone.items()}
    for slot, (_, logits) in alone.items():
        torch.testing.assert_close(torch.stack(out_logits[slot]), logits, rtol=0, atol=1e-9)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("kind", ["dense", "arena"])
def test_garbage_in_free_pages_and_slots_changes_nothing(spec: ModelSpec, kind: str) -> None:
    w = weights_of(spec, 0)
    prompt = [(13 * i) % 256 for i in range(10)]
    ref_tokens, ref_logits = greedy(_model(w, spec, kind=kind), prompt, 8, slot=2)
    dirty = _model(w, spec, kind=kind)
    for cache in dirty.caches:
        if isinstance(cache, DenseCache):
            cache.fill_garbage(seed=4)
        else:
            for group in ("attention", "draft"):
                cache.fill_garbage(group, range(cache.layout.pool_group(group).num_slots))  # type: ignore[attr-defined]
            if spec.kda is not None:
                cache.fill_garbage("kda", range(SLOTS))  # type: ignore[attr-defined]
            cache.num_accepted.fill_(3)
    tokens, logits = greedy(dirty, prompt, 8, slot=2)
    assert tokens == ref_tokens
    assert torch.equal(logits, ref_logits)


def test_a_verify_window_over_mla_gives_the_decode_logits() -> None:
    # all_logits over k + 1 tokens at once: each row equals the plain decode step's logits
    w = weights_of(MLA_ONLY, 1)
    prompt = [(3 * i + 8) % 256 for i in range(6)]
    ref_tokens, ref_logits = greedy(_model(w, MLA_ONLY), prompt, 9)
    model = _model(w, MLA_ONLY)
    table = _table(1)
    model.step([SequenceInput(prompt, 0, table, 1)])
    out = model.step([SequenceInput(ref_tokens[:5], len(prompt), table, 1, verify=True, all_logits=True)])
    torch.testing.assert_close(out.logits[0], ref_logits[1:6], rtol=0, atol=1e-9)


# --- speculative verify + replay (KDA) -------------------------------------------------------------------------


def spec_decode(
    model: KimiLinearModel,
    prompt: Sequence[int],
    new: int,
    k: int,
    drafts_for: Callable[[int, list[int]], list[int]],
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


@pytest.mark.parametrize("k", [1, 3])
def test_verify_and_replay_give_the_plain_decode_tokens(k: int) -> None:
    w = weights_of(TINY_KIMI, 2)
    prompt = [(7 * i + 2) % 256 for i in range(9)]
    ref_tokens, ref_logits = greedy(_model(w, TINY_KIMI), prompt, 16)

    def drafts(round_: int, tokens: list[int]) -> list[int]:
        # the true continuation with one token spoiled at a round-dependent place (some rounds none)
        true = ref_tokens[len(tokens) : len(tokens) + k]
        true += [0] * (k - len(true))
        spoil = round_ % (k + 2)
        if spoil < k:
            true[spoil] = (true[spoil] + 1) % 256
        return true

    model = _model(w, TINY_KIMI)
    tokens, accepted, logits = spec_decode(model, prompt, 16, k, drafts)
    assert tokens == ref_tokens
    assert 0 in accepted and k in accepted  # both reject and full-accept paths ran
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-9)
    stats = model.statistics()
    assert stats["replayed_tokens"] > 0 and stats["verify_tokens"] > 0


def test_a_verify_step_leaves_the_kda_state_alone_and_the_replay_catches_up() -> None:
    w = weights_of(TINY_KIMI, 0)
    model, plain = _model(w, TINY_KIMI), _model(w, TINY_KIMI)
    table = _table(1)
    for m in (model, plain):
        m.step([SequenceInput([1, 2, 3, 4, 5], 0, table, 1)])
    cache = model.caches[0]
    conv, ssm = cache.conv(0)[1].clone(), cache.ssm(4)[1].clone()
    model.step([SequenceInput([6, 7, 8], 5, table, 1, verify=True, all_logits=True)])
    assert torch.equal(cache.conv(0)[1], conv) and torch.equal(cache.ssm(4)[1], ssm)
    assert int(cache.num_accepted[1]) == 0
    model.accept(1, 2)
    # the next step replays 6 and 7, then decodes 9 at position 7
    model.step([SequenceInput([9], 7, table, 1)])
    assert int(cache.num_accepted[1]) == 0
    for t, p in ((6, 5), (7, 6), (9, 7)):
        plain.step([SequenceInput([t], p, table, 1)])
    for layer in TINY_KIMI.recurrent_layer_ids:
        torch.testing.assert_close(cache.ssm(layer)[1], plain.caches[0].ssm(layer)[1], rtol=0, atol=1e-12)
        torch.testing.assert_close(cache.conv(layer)[1], plain.caches[0].conv(layer)[1], rtol=0, atol=1e-12)
    cache.num_accepted[1] = REPLAY + 1  # garbage in a resumed slot's count is refused, not replayed
    with pytest.raises(ConfigError):
        model.step([SequenceInput([10], 8, table, 1)])
    with pytest.raises(ConfigError):
        model.accept(1, REPLAY + 1)


# --- bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch",
    [
        [],
        [SequenceInput([1, 2, 3, 4, 5], 0, [0], 1)],  # block table too short
        [SequenceInput([1], 0, [PAGES], 1)],  # page id out of range
        [SequenceInput([256], 0, [0], 1)],  # token outside vocab
        [SequenceInput([], 0, [0], 1)],  # no tokens
    ],
)
def test_bad_batches_raise_and_change_nothing(batch: list[SequenceInput]) -> None:
    model = _model(weights_of(MLA_ONLY, 0), MLA_ONLY)
    model.step([SequenceInput([5, 6, 7], 0, [3], 2)])
    before = [model.caches[0].latent(i).clone() for i in MLA_ONLY.attention_layer_ids]
    with pytest.raises(ConfigError):
        model.step(batch)
    after = [model.caches[0].latent(i) for i in MLA_ONLY.attention_layer_ids]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_mismatched_weights_specs_and_caches_are_refused() -> None:
    w = weights_of(MLA_ONLY, 0)
    with pytest.raises(ConfigError):
        KimiLinearModel.build(w, MLA_ONLY, [])
    with pytest.raises(ConfigError):  # pages of another block size
        other_pages = attrs.evolve(MLA_ONLY, tokens_per_block=8)
        KimiLinearModel.build(w, MLA_ONLY, [DenseCache(other_pages.shard(1, 0), num_pages=4, num_slots=2)])
    with pytest.raises(ConfigError):  # other MLA dims
        assert MLA_ONLY.mla is not None
        other = attrs.evolve(MLA_ONLY, mla=attrs.evolve(MLA_ONLY.mla, kv_lora_rank=16))
        KimiLinearModel.build(w, other, _caches(other))
    with pytest.raises(ConfigError):  # the families do not cross
        Model.build(w, MLA_ONLY, _caches(MLA_ONLY))
    tiny = preset("tiny")
    with pytest.raises(ConfigError):
        KimiLinearModel.build(ModelWeights.seeded(tiny_args(tiny), 0), tiny, _caches(tiny))
    model = _model(w, MLA_ONLY)
    with pytest.raises(ConfigError, match="decode graphs"):
        model.enable_decode_graphs(4)
    assert model.decode_graphs is None
    with pytest.raises(ConfigError):
        model.rebind(_caches(MLA_ONLY, tp=2))


def test_one_rank_holds_the_weights_without_copies() -> None:
    w = weights_of(MLA_ONLY, 0)
    shard = _model(w, MLA_ONLY).rank_tensors[0]
    assert all(shard[name].data_ptr() == t.data_ptr() for name, t in w.tensors.items())
