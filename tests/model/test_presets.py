"""The seeded NemotronH presets: real proportions, their specs, made on the target device and dtype, seeded,
finite in bfloat16 over every layer; a full-size build where memory allows (slow) and on CUDA (gpu)."""

from __future__ import annotations

import anyio
import pytest
import torch

from kvferry.engine.runner import EngineOptions, build_engine
from kvferry.errors import ConfigError
from kvferry.model.nemotron_h import Model, SequenceInput
from kvferry.model.presets import load_preset, preset_args
from kvferry.model.weights import ModelWeights, NemotronHArgs
from kvferry.pools.arena import CacheArena
from kvferry.pools.layout import CacheLayout
from kvferry.pools.spec import LayerKind, preset, preset_names

PROMPT = 128


def test_the_presets_have_their_stated_proportions() -> None:
    small = preset_args("nemotron-h-1b")
    assert isinstance(small, NemotronHArgs)
    assert (small.hidden_size, small.vocab_size, small.intermediate_size) == (2048, 131072, 8192)
    kinds = small.layer_kinds
    assert (kinds.count(LayerKind.MAMBA2), kinds.count(LayerKind.ATTENTION), kinds.count(LayerKind.MLP)) == (
        20,
        4,
        4,
    )
    assert (small.mamba_num_heads, small.mamba_head_dim, small.ssm_state_size, small.n_groups) == (
        32,
        64,
        128,
        8,
    )
    assert (small.num_attention_heads, small.num_key_value_heads, small.head_dim) == (16, 4, 128)
    assert 0.85e9 <= small.num_parameters <= 1.1e9
    big = preset_args("nemotron-h-8b")
    assert 7.5e9 <= big.num_parameters <= 8.5e9
    assert big.layer_kinds == preset("nemotron-h-8b").layer_kinds


@pytest.mark.parametrize("name", ["nemotron-h-1b", "nemotron-h-8b"])
def test_the_args_produce_exactly_the_preset_spec(name: str) -> None:
    spec = preset(name)
    for dtype in ("bfloat16", "float32"):
        made = preset_args(name).model_spec(
            name=name, tokens_per_block=spec.tokens_per_block, dtype=dtype, drafter=spec.drafter
        )
        # the attention and Mamba2 shapes come from the args; the drafter's dtype is the engine's (with_dtype)
        assert made.attention == spec.with_dtype(dtype).attention
        assert made.mamba2 == spec.with_dtype(dtype).mamba2
        assert made.with_dtype(dtype) == spec.with_dtype(dtype)
        assert made.with_dtype(dtype).shard(4, 1) == spec.with_dtype(dtype).shard(4, 1)


def test_an_unknown_preset_is_refused_with_the_list() -> None:
    with pytest.raises(ConfigError, match=r"nemotron-h-1b.*nemotron-h-8b.*tiny"):
        preset_args("nemotron-h-2b")
    with pytest.raises(ConfigError, match="preset scale"):
        preset_args("nemotron-h-1b", scale=0)
    with pytest.raises(ConfigError, match="tiny preset cannot be scaled"):
        preset_args("tiny", scale=2)
    with pytest.raises(ConfigError, match=r"a preset .*nemotron-h-1b.* or a checkpoint directory"):
        build_engine("nemotron-h-2b", EngineOptions())
    assert set(preset_names()) == {"tiny", "tiny-kimi", "nemotron-h-1b", "nemotron-h-8b"}


def test_weights_are_made_in_the_dtype_on_the_device_and_seeded() -> None:
    args = preset_args("nemotron-h-1b", scale=16)
    a = ModelWeights.seeded(args, 5, torch.bfloat16, device="cpu")
    b = ModelWeights.seeded(args, 5, torch.bfloat16, device="cpu")
    c = ModelWeights.seeded(args, 6, torch.bfloat16, device="cpu")
    assert a.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in a.tensors.values())
    assert all(torch.equal(a[k], b[k]) for k in a.tensors)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    # the LM head is scaled so that logits are O(1), the embeddings unit-variance
    assert 0.5 < float(a["model.embeddings.weight"].float().std()) < 2.0


def _all_logits(name: str, dtype: str, scale: int, device: str = "cpu") -> torch.Tensor:
    weights, spec = load_preset(name, seed=3, dtype=dtype, device=device, scale=scale)
    spec = spec.without_drafter()
    pages = -(-PROMPT // spec.tokens_per_block) + 1
    arena = CacheArena(CacheLayout.build(spec.shard(1, 0), num_pages=pages, num_slots=2), device)
    model = Model.build(weights, spec, [arena])
    prompt = torch.randint(0, spec.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        out = model.step([SequenceInput(prompt, 0, tuple(range(1, pages)), 1, all_logits=True)])
    return out.logits[0]


def _check(logits: torch.Tensor, dtype: torch.dtype) -> None:
    assert logits.shape[0] == PROMPT and logits.dtype == dtype
    assert bool(torch.isfinite(logits).all())
    greedy = logits.float().argmax(dim=-1)
    # not degenerate: the greedy choice follows the context, it is not one token everywhere
    assert len(set(greedy.tolist())) > PROMPT // 4
    assert float(logits.float().std()) > 0.1


@pytest.mark.parametrize("name", ["nemotron-h-1b", "nemotron-h-8b"])
def test_a_scaled_preset_stays_finite_in_bfloat16_over_every_layer(name: str) -> None:
    _check(_all_logits(name, "bfloat16", scale=16), torch.bfloat16)


def test_build_engine_runs_a_scaled_preset_in_bfloat16() -> None:
    built = build_engine(
        "nemotron-h-1b",
        EngineOptions(dtype="bfloat16", preset_scale=16, num_pages=16, max_running=2, step_in_thread=False),
    )
    assert built.runner.model.weights.dtype == torch.bfloat16
    prompt = list(range(1, PROMPT + 1))

    async def main() -> list[int]:
        async with built.engine as engine:
            with anyio.fail_after(60):
                return [t async for t in engine.generate(prompt, max_tokens=8)]

    tokens = anyio.run(main)
    assert len(tokens) == 8 and all(0 <= t < built.runner.vocab_size for t in tokens)


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.mark.slow
@pytest.mark.skipif(_available_bytes() < 12 << 30, reason="needs about 12 GiB of free memory")
def test_the_full_1b_preset_builds_and_runs_in_float32_on_cpu() -> None:
    _check(_all_logits("nemotron-h-1b", "float32", scale=1), torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["nemotron-h-1b", "nemotron-h-8b"])
def test_the_full_presets_on_cuda_in_bfloat16(name: str) -> None:
    free, _ = torch.cuda.mem_get_info()
    if name == "nemotron-h-8b" and free < 40 << 30:
        pytest.skip("needs about 40 GiB of free GPU memory")
    weights, _spec = load_preset(name, seed=1, dtype="bfloat16", device="cuda")
    again, _spec = load_preset(name, seed=1, dtype="bfloat16", device="cuda")
    assert weights["model.embeddings.weight"].device.type == "cuda"
    assert torch.equal(weights["lm_head.weight"], again["lm_head.weight"])
    del weights, again
    _check(_all_logits(name, "bfloat16", scale=1, device="cuda"), torch.bfloat16)
    built = build_engine(name, EngineOptions(device="cuda", dtype="bfloat16", num_pages=64, max_running=2))
    assert built.runner.model.weights["lm_head.weight"].device.type == "cuda"


def test_cuda_is_refused_in_one_line_where_torch_sees_no_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    with pytest.raises(ConfigError, match="CUDA is not available"):
        build_engine("tiny", EngineOptions(device="cuda"))
    with pytest.raises(ConfigError, match="expected cpu, cuda or cuda:N"):
        build_engine("tiny", EngineOptions(device="tpu"))


def test_transformers_shares_the_preset_tensors_and_agrees() -> None:
    pytest.importorskip("transformers")
    from kvferry.model.weights import hf_model

    weights, _spec = load_preset("nemotron-h-1b", seed=2, dtype="float32", scale=16)
    shared = hf_model(weights, share=True)
    copied = hf_model(weights)
    head = shared.get_output_embeddings().weight
    assert head.data_ptr() == weights["lm_head.weight"].data_ptr()  # no copy
    assert copied.get_output_embeddings().weight.data_ptr() != head.data_ptr()
    ids = torch.randint(0, weights.args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(shared(ids).logits, copied(ids).logits, rtol=0, atol=0)
