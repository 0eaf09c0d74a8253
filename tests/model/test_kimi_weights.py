"""KimiLinear hyper-parameters and weights: configs in both spellings, transformers' names and shapes,
checkpoints as ``save_pretrained`` writes them, and the MLA / MoE blocks against transformers' modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.model.batch import plan_groups
from kvferry.model.kimi_args import KimiLinearArgs, from_checkpoint_names, to_checkpoint_names
from kvferry.model.mla import mla_block
from kvferry.model.moe import gated_mlp, moe_block
from kvferry.model.weights import ModelWeights, exact_float64, hf_model

transformers = pytest.importorskip("transformers")

ARGS = KimiLinearArgs(
    hidden_size=48,
    vocab_size=200,
    layer_types=("full_attention", "linear_attention", "full_attention"),
    mlp_layer_types=("dense", "sparse", "sparse"),
    intermediate_size=80,
    moe_intermediate_size=24,
    num_attention_heads=4,
    kv_lora_rank=20,
    qk_rope_head_dim=6,
    qk_nope_head_dim=10,
    v_head_dim=12,
    num_experts=8,
    num_experts_per_tok=3,
    linear_num_heads=2,
    linear_head_dim=8,
    n_group=4,
    topk_group=2,
    n_shared_experts=2,
    routed_scaling_factor=1.7,
)


@pytest.fixture(scope="module")
def weights() -> ModelWeights:
    return ModelWeights.seeded(ARGS, 5, torch.float64)


def test_seeded_weights_have_transformers_names_and_shapes(weights: ModelWeights) -> None:
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**_body(ARGS)))
    state = model.state_dict()
    assert set(state) == set(weights.tensors)
    assert all(tuple(state[k].shape) == tuple(weights[k].shape) for k in state)
    assert weights.embeddings is weights["model.embed_tokens.weight"]
    assert weights.final_norm is weights["model.norm.weight"]
    assert weights.lm_head is weights["lm_head.weight"]
    assert ARGS.num_parameters == sum(t.numel() for t in state.values())
    # the same seed gives the same weights, another seed others
    again = ModelWeights.seeded(ARGS, 5, torch.float32)
    assert all(torch.equal(again[k], weights[k].float()) for k in weights.tensors)
    other = ModelWeights.seeded(ARGS, 6, torch.float64)
    assert not torch.equal(
        other["model.layers.1.mlp.experts.gate_up_proj"], weights["model.layers.1.mlp.experts.gate_up_proj"]
    )


def _body(args: KimiLinearArgs) -> dict[str, object]:
    body = args.to_dict()
    body.pop("architectures")
    body.pop("model_type")
    return body


def test_config_json_written_by_transformers_reads_back_to_the_same_args(tmp_path: Path) -> None:
    config = transformers.KimiLinearConfig(**_body(ARGS))
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    # transformers writes the aliased names (num_expert_group, num_experts_per_token, moe_renormalize, ...)
    assert "num_expert_group" in saved and "n_group" not in saved
    assert KimiLinearArgs.from_config(saved) == ARGS
    assert KimiLinearArgs.from_config(config) == ARGS
    assert KimiLinearArgs.from_config(ARGS.to_dict()) == ARGS


def test_original_checkpoint_config_layout_is_read() -> None:
    body = {
        "model_type": "kimi_linear",
        "hidden_size": 48,
        "vocab_size": 200,
        "num_hidden_layers": 4,
        "intermediate_size": 80,
        "moe_intermediate_size": 24,
        "num_attention_heads": 4,
        "kv_lora_rank": 20,
        "qk_rope_head_dim": 6,
        "qk_nope_head_dim": 10,
        "v_head_dim": 12,
        "num_experts": 8,
        "num_experts_per_token": 2,
        "num_expert_group": 2,
        "first_k_dense_replace": 2,
        "linear_attn_config": {"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 3,
                               "kda_layers": [1, 2, 3], "full_attn_layers": [4]},
    }  # fmt: skip
    args = KimiLinearArgs.from_config(body)
    assert args.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert args.mlp_layer_types == ("dense", "dense", "sparse", "sparse")
    assert (args.linear_head_dim, args.linear_num_heads, args.linear_conv_kernel_dim) == (8, 2, 3)
    assert (args.n_group, args.num_experts_per_tok) == (2, 2)
    reference = transformers.KimiLinearConfig(**{k: v for k, v in body.items() if k != "model_type"})
    assert list(reference.layer_types) == list(args.layer_types)
    assert list(reference.mlp_layer_types) == list(args.mlp_layer_types)


@pytest.mark.parametrize(
    "change",
    [
        {"layer_types": ["full_attention", "mamba", "full_attention"]},
        {"mlp_layer_types": ["dense", "sparse"]},
        {"mlp_layer_types": ["dense", "moe", "sparse"]},
        {"hidden_act": "gelu"},
        {"num_experts": 6, "n_group": 4},
        {"topk_group": 5},
        {"num_experts_per_tok": 5},
        {"hidden_size": None},
        {"kv_lora_rank": "many"},
    ],
)
def test_bad_configs_are_typed_errors(change: dict[str, object]) -> None:
    body = {**ARGS.to_dict(), **change}
    with pytest.raises(ConfigError):
        KimiLinearArgs.from_config(body)


def test_checkpoint_written_by_save_pretrained_loads_to_the_same_weights(
    weights: ModelWeights, tmp_path: Path
) -> None:
    hf_model(weights).save_pretrained(tmp_path)
    loaded = ModelWeights.from_checkpoint(tmp_path)
    assert loaded.args == ARGS
    assert loaded.tensors.keys() == weights.tensors.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights.tensors)


def test_our_checkpoint_loads_in_transformers_and_back(weights: ModelWeights, tmp_path: Path) -> None:
    weights.save_checkpoint(tmp_path)
    model = transformers.KimiLinearForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    state = model.state_dict()
    assert set(state) == set(weights.tensors)
    for name, tensor in weights.tensors.items():
        # transformers keeps the router (gate.weight, e_score_correction_bias) and dt_bias in float32
        assert torch.equal(state[name], tensor.to(state[name].dtype)), name
    again = ModelWeights.from_checkpoint(tmp_path, torch.float32)
    assert again.dtype == torch.float32 and again.args == ARGS


def test_checkpoint_names_round_trip(weights: ModelWeights) -> None:
    saved = to_checkpoint_names(ARGS, weights.tensors)
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in saved
    assert "model.layers.1.self_attn.q_conv1d.weight" in saved
    assert "model.layers.1.self_attn.A_log" in saved
    back = from_checkpoint_names(saved)
    assert back.keys() == weights.tensors.keys()
    assert all(torch.equal(back[k], weights[k]) for k in back)
    incomplete = {k: v for k, v in saved.items() if not k.endswith("experts.3.w2.weight")}
    with pytest.raises(ConfigError, match="incomplete"):
        from_checkpoint_names(incomplete)


def test_a_checkpoint_of_another_family_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="model_type"):
        ModelWeights.from_checkpoint(tmp_path)


# --- the blocks against transformers' modules ---------------------------------------------------------------


def test_mla_moe_and_mlp_blocks_equal_transformers_modules(weights: ModelWeights) -> None:
    model = hf_model(weights)
    rows = 11
    h = torch.randn(
        1, rows, ARGS.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    mask = torch.full((rows, rows), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    with exact_float64(), torch.no_grad():
        attention, _ = model.model.layers[2].self_attn(h, attention_mask=mask)
        moe = model.model.layers[2].mlp(h)
        mlp = model.model.layers[0].mlp(h)
    # pages full of NaN: only what the step writes may be read; chunks cross the 4-token pages
    cache = torch.full((10, 4, ARGS.latent_dim), float("nan"), dtype=torch.float64)
    table = [7, 2, 5]
    outs = []
    for begin, end in ((0, 3), (3, 4), (4, 11)):
        groups = plan_groups([(end - begin, begin, table, 1, False)], torch.device("cpu"))
        outs.append(
            mla_block(weights.tensors, "model.layers.2.self_attn.", h[0, begin:end], cache, groups, ARGS)
        )
    torch.testing.assert_close(torch.cat(outs), attention[0], rtol=0, atol=1e-12)
    routed = moe_block(
        weights.tensors,
        "model.layers.2.mlp.",
        h[0],
        top_k=ARGS.num_experts_per_tok,
        n_group=ARGS.n_group,
        topk_group=ARGS.topk_group,
        norm_topk_prob=ARGS.norm_topk_prob,
        scaling=ARGS.routed_scaling_factor,
    )
    torch.testing.assert_close(routed, moe[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(
        gated_mlp(weights.tensors, "model.layers.0.mlp.", h[0]), mlp[0], rtol=0, atol=1e-12
    )


def test_a_narrower_dtype_keeps_the_router_and_dt_bias_in_float32(
    weights: ModelWeights, tmp_path: Path
) -> None:
    # as transformers' from_pretrained does (_keep_in_fp32_modules_strict)
    kept = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "forget_gate.dt_bias")
    for narrow in (weights.to(torch.bfloat16), ModelWeights.seeded(ARGS, 5, torch.float16)):
        assert narrow.dtype in (torch.bfloat16, torch.float16)
        for name, tensor in narrow.tensors.items():
            assert (tensor.dtype == torch.float32) == name.endswith(kept), name
    assert all(t.dtype == torch.float64 for t in weights.to(torch.float64).tensors.values())
    hf_model(weights).save_pretrained(tmp_path)
    loaded = ModelWeights.from_checkpoint(tmp_path, torch.bfloat16)
    reference = transformers.KimiLinearForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16
    ).state_dict()
    assert all(loaded[k].dtype == reference[k].dtype for k in loaded.tensors)
