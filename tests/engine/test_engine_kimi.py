"""The engine over a KimiLinear model: ``tiny-kimi`` (KDA + MLA + MoE, seeded) and KimiLinear checkpoint
directories give the model's own greedy tokens and transformers' (float64), batched, tensor-parallel, with the
real drafter, with replay state suspended and offloaded between a verify step and the next, and across pool
rebalances (KDA replay buffers follow the state pool)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest
import torch

from kvferry.engine.engine import Engine
from kvferry.engine.runner import BuiltEngine, build_engine
from kvferry.errors import ConfigError
from kvferry.model.family import build_model
from kvferry.model.kimi_args import KimiLinearArgs, tiny_kimi_args
from kvferry.model.nemotron_h import DenseCache, SequenceInput
from kvferry.model.weights import ModelWeights
from kvferry.pools.spec import ModelSpec, preset
from tests.engine.test_engine import (
    MAX_TOKENS,
    PROMPTS,
    OracleDraftRunner,
    assert_all_free,
    free_counts,
    options,
    run_all,
    submits_in_order,
)

#: an MLA-only KimiLinear (every layer full attention): runs without the KDA block
MLA_ARGS = KimiLinearArgs(
    hidden_size=48,
    vocab_size=256,
    layer_types=("full_attention",) * 3,
    mlp_layer_types=("dense", "sparse", "sparse"),
    intermediate_size=96,
    moe_intermediate_size=16,
    num_attention_heads=4,
    kv_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=12,
    num_experts=6,
    num_experts_per_tok=2,
    linear_num_heads=2,
    linear_head_dim=8,
    n_group=3,
    topk_group=2,
)


def model_greedy(weights: ModelWeights, spec: ModelSpec, prompt: Sequence[int], new: int) -> list[int]:
    """The paged model's own greedy run (one sequence, a dense cache, no engine)."""
    blocks = -(-(len(prompt) + new) // spec.tokens_per_block)
    model = build_model(
        weights, spec.without_drafter(), [DenseCache(spec.shard(1, 0), num_pages=blocks, num_slots=2)]
    )
    table = list(range(blocks))
    out = model.step([SequenceInput(prompt, 0, table, 1)])
    tokens = [int(out.logits[0][-1].argmax())]
    while len(tokens) < new:
        out = model.step([SequenceInput(tokens[-1:], len(prompt) + len(tokens) - 1, table, 1)])
        tokens.append(int(out.logits[0][-1].argmax()))
    return tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLA-only KimiLinear checkpoint as transformers' save_pretrained writes it."""
    pytest.importorskip("transformers")
    from kvferry.model.weights import hf_model

    path = tmp_path_factory.mktemp("kimi")
    hf_model(ModelWeights.seeded(MLA_ARGS, 3, torch.float64)).save_pretrained(path)
    return path


def test_a_checkpoint_directory_serves_transformers_tokens(checkpoint: Path) -> None:
    from kvferry.model.weights import hf_generate, hf_model

    weights = ModelWeights.from_checkpoint(checkpoint)
    built = build_engine(checkpoint, options())
    assert type(built.runner.model).__name__ == "KimiLinearModel"
    tokens = anyio.run(run_all, built, PROMPTS[2:5], MAX_TOKENS[2:5])
    for prompt, new, got in zip(PROMPTS[2:5], MAX_TOKENS[2:5], tokens, strict=True):
        assert got == hf_generate(hf_model(weights), prompt, new)[0]
        assert got == model_greedy(weights, built.runner.model.spec, prompt, new)


@pytest.mark.anyio
@pytest.mark.parametrize(("tp", "k"), [(1, 0), (2, 0), (1, 3), (2, 2)])
async def test_a_checkpoint_batched_tensor_parallel_and_drafted_gives_the_same_tokens(
    checkpoint: Path, tp: int, k: int
) -> None:
    alone = await run_all(build_engine(checkpoint, options(enable_reuse=False)), sequential=True)
    built = build_engine(checkpoint, options(tp=tp, max_spec_k=k, num_pages=64, max_prefill_chunk=5))
    initial = free_counts(built)
    assert await run_all(built, spec_k=k) == alone
    if k:
        stats = built.engine.statistics()
        assert 0 < stats.num_accepted < stats.num_drafted  # the drafter runs on a KimiLinear target
    assert_all_free(built, initial)


def test_decode_graphs_are_refused_for_kimi_and_off_by_default(checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="decode graphs"):
        build_engine(checkpoint, options(decode_graphs=True))
    assert build_engine(checkpoint, options()).runner.model.decode_graphs is None


# --- tiny-kimi: KDA + MLA + MoE --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kimi_alone() -> list[list[int]]:
    """Each prompt on its own through tiny-kimi (sequential, no reuse): the reference of every batched run."""
    built = build_engine("tiny-kimi", options(enable_reuse=False))
    return anyio.run(lambda: run_all(built, sequential=True))


def test_tiny_kimi_engine_equals_its_model_and_transformers(kimi_alone: list[list[int]]) -> None:
    pytest.importorskip("transformers")
    from kvferry.model.weights import hf_generate, hf_model

    spec = preset("tiny-kimi").with_dtype("float64")
    weights = ModelWeights.seeded(tiny_kimi_args(spec), 0, torch.float64)
    for i in (1, 4):
        assert kimi_alone[i] == model_greedy(weights, spec, PROMPTS[i], MAX_TOKENS[i])
        assert kimi_alone[i] == hf_generate(hf_model(weights), PROMPTS[i], MAX_TOKENS[i])[0]


@pytest.mark.anyio
@pytest.mark.parametrize(("tp", "k"), [(1, 0), (2, 0), (1, 2), (2, 3)])
async def test_tiny_kimi_batched_tensor_parallel_and_drafted_gives_the_same_tokens(
    kimi_alone: list[list[int]], tp: int, k: int
) -> None:
    built = build_engine("tiny-kimi", options(tp=tp, max_spec_k=k, num_pages=64, max_prefill_chunk=5))
    initial = free_counts(built)
    assert await run_all(built, spec_k=k) == kimi_alone
    if k:
        stats = built.engine.statistics()
        assert 0 < stats.num_accepted < stats.num_drafted
        assert built.runner.model.statistics()["replayed_tokens"] > 0
    assert_all_free(built, initial)


@pytest.mark.anyio
@pytest.mark.parametrize(("k", "pages"), [(1, 40), (2, 14), (3, 13)])
async def test_tiny_kimi_replay_state_survives_suspend_offload_and_resume_in_another_slot(
    kimi_alone: list[list[int]], k: int, pages: int, anyio_backend: str
) -> None:
    """Verify steps whose acceptance the next step replays; with tight pools requests are preempted between a
    verify step and that replay, their KDA slot, replay buffer and num_accepted go to the host and come back
    into another slot: the tokens stay those of an uninterrupted run."""
    built = build_engine(
        "tiny-kimi",
        options(max_spec_k=k, drafter=False, num_pages=pages, max_prefill_chunk=5, step_in_thread=True),
    )
    runner = OracleDraftRunner(built.runner, dict(zip(PROMPTS, kimi_alone, strict=True)))
    engine = Engine(runner, built.cache, built.engine.config)
    initial = free_counts(built)
    assert await run_all(built._replace(engine=engine, runner=runner), spec_k=k) == kimi_alone
    stats = engine.statistics()
    assert 0 < stats.num_accepted < stats.num_drafted
    assert runner.model.statistics()["replayed_tokens"] > 0
    if pages < 20 and submits_in_order(anyio_backend):
        assert engine.scheduler.statistics().num_preemptions > 0 and built.cache.statistics().restores > 0
    assert_all_free(built, initial)


@pytest.mark.anyio
async def test_tiny_kimi_rebalances_mid_run_keep_every_token(kimi_alone: list[list[int]]) -> None:
    built: BuiltEngine = build_engine("tiny-kimi", options(num_pages=40, max_spec_k=2))
    expected = await run_all(build_engine("tiny-kimi", options(enable_reuse=False, max_spec_k=2)), spec_k=2)
    assert expected == kimi_alone
    results: list[list[int]] = [[] for _ in PROMPTS]
    sizes = [{"num_pages": 128, "num_slots": 40}, {"num_pages": 30, "num_slots": 12}]
    done: list[int] = []
    with anyio.fail_after(120):
        async with built.engine:

            async def one(i: int) -> None:
                generation = built.engine.generate(PROMPTS[i], max_tokens=MAX_TOKENS[i], spec_k=2)
                async for token in generation:
                    results[i].append(token)
                    if i == 2 and len(done) < len(sizes) and len(results[i]) >= 2 + 3 * len(done):
                        await built.engine.rebalance(**sizes[len(done)])
                        done.append(len(results[i]))
                        # the model runs over the new arenas: the KDA replay buffers grew with the slots
                        layer = built.runner.model.spec.recurrent_layer_ids[0]
                        arena = built.runner.model.caches[0]
                        assert arena.replay(layer).shape[0] == sizes[len(done) - 1]["num_slots"]

            async with anyio.create_task_group() as tg:
                for i in range(len(PROMPTS)):
                    tg.start_soon(one, i)
    assert len(done) == len(sizes)
    assert results == expected
    assert built.engine.statistics().num_failed == 0


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
@pytest.mark.parametrize("model", ["checkpoint", "tiny-kimi"])
def test_a_kimi_engine_on_cuda_gives_the_cpu_tokens(model: str, checkpoint: Path) -> None:
    name: str | Path = checkpoint if model == "checkpoint" else model
    cpu = anyio.run(run_all, build_engine(name, options()), PROMPTS[:4], MAX_TOKENS[:4])
    built = build_engine(name, options(device="cuda"))
    assert built.runner.model.device.type == "cuda" and built.runner.model.decode_graphs is None
    assert anyio.run(run_all, built, PROMPTS[:4], MAX_TOKENS[:4]) == cpu


@cuda
@pytest.mark.parametrize("spec_k", [0, 2])
def test_a_kimi_engine_on_cuda_runs_fla_and_gives_the_torch_forms_tokens(
    spec_k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """float32 on CUDA: with flash-linear-attention's kernels (prefill chunks, decode, verify windows and their
    replay) the tokens are those of kvferry's torch forms on the same device."""
    from kvferry.kernels import kda

    if not kda.fla_available(torch.device("cuda")):
        pytest.skip("flash-linear-attention (fla.ops.kda) does not import")
    calls: list[bool] = []
    scan = kda._fla_scan

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(bool(kwargs["chunked"]))
        return scan(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kda, "_fla_scan", counted)
    opts = options(device="cuda", dtype="float32", max_spec_k=spec_k, max_prefill_chunk=8)
    with_fla = anyio.run(
        lambda: run_all(build_engine("tiny-kimi", opts), PROMPTS[:4], MAX_TOKENS[:4], spec_k=spec_k)
    )
    assert True in calls and False in calls  # chunk_kda and fused_recurrent_kda both ran
    monkeypatch.setattr(kda, "fla_available", lambda device: False)
    calls.clear()
    torch_forms = anyio.run(
        lambda: run_all(build_engine("tiny-kimi", opts), PROMPTS[:4], MAX_TOKENS[:4], spec_k=spec_k)
    )
    assert not calls
    assert with_fla == torch_forms


@pytest.mark.anyio
@pytest.mark.parametrize("spec_k", [1, 2, 3])
async def test_a_kimi_request_offloaded_with_acceptance_pending_replay_resumes_in_another_slot(
    spec_k: int,
) -> None:
    """Suspended right after a verify step, when its KDA slot still lacks the accepted tokens (they wait in the
    replay buffer, ``num_accepted`` > 0), moved to the host, its slot taken by another request, and resumed
    into a new slot: the tokens are those of an uninterrupted run. A restore that dropped the replay state
    (buffer or count) would lose the accepted tokens' conv and KDA state and change the tokens."""
    prompt, other, max_tokens = PROMPTS[1], PROMPTS[2], 24
    opts = options(max_spec_k=spec_k, max_running=2, num_pages=64)
    expected = await run_all(build_engine("tiny-kimi", opts), [prompt], [max_tokens], spec_k=spec_k)
    built = build_engine("tiny-kimi", opts)
    manager = built.cache.managers[0]
    initial = free_counts(built)
    moved: list[tuple[int, int, int]] = []  # (num_accepted, slot before, slot after) per pending-replay move
    tokens: list[int] = []
    with anyio.fail_after(120):
        async with built.engine:
            generation = built.engine.generate(prompt, max_tokens=max_tokens, spec_k=spec_k)
            resumed: tuple[int, int] | None = None  # (num_accepted, slot before) of the last move
            async for token in generation:
                tokens.append(token)
                rid = generation.request.request_id
                if resumed is not None:  # a token after the resume: the cache is back, in its new slot
                    after = manager.slot_id(rid)
                    assert after is not None and not manager.is_offloaded(rid)
                    moved.append((*resumed, after))
                    resumed = None
                if len(tokens) < 2 or len(moved) >= 3 or len(tokens) >= max_tokens - spec_k - 1:
                    continue
                await generation.suspend()
                manager.flush_num_accepted()
                before = manager.slot_id(rid)
                assert before is not None and manager.arena is not None
                pending = int(manager.arena.num_accepted[before])
                if pending > 0:
                    await generation.offload()
                    assert manager.is_offloaded(rid)
                    # another request takes the freed slot meanwhile
                    assert len(await built.engine.generate(other, max_tokens=3).collect()) == 3
                    resumed = (pending, before)
                generation.resume()
    assert tokens == expected[0]
    assert len(moved) >= 2, moved
    assert any(before != after for _, before, after in moved), moved
    assert_all_free(built, initial)
