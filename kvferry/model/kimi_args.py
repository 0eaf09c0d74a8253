"""KimiLinear hyper-parameters (KDA + MLA + MoE) and the names of its tensors, as transformers has them.

:class:`KimiLinearArgs` reads a ``config.json`` dict or a transformers ``KimiLinearConfig`` (both spellings of
the aliased fields: ``n_group`` / ``num_expert_group``, ``num_experts`` / ``num_local_experts``, ...), and the
original checkpoint's ``linear_attn_config`` sub-dict. Tensors keep the names of transformers' modules
(``model.layers.{i}.self_attn.forget_gate.A_log``, ``model.layers.{i}.mlp.experts.gate_up_proj``); a checkpoint
as ``save_pretrained`` writes it uses the original layout (``block_sparse_moe``, one tensor per expert, three
conv weights), which :func:`from_checkpoint_names` and :func:`to_checkpoint_names` convert. Nothing here
imports transformers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from attrs import frozen

from kvferry.errors import ConfigError
from kvferry.pools.spec import KIMI_LAYER_KINDS, DrafterSpec, LayerKind, ModelSpec

__all__ = [
    "KimiLinearArgs",
    "from_checkpoint_names",
    "kimi_expected_shapes",
    "tiny_kimi_args",
    "to_checkpoint_names",
]

_MLP_TYPES = ("dense", "sparse")


@frozen
class KimiLinearArgs:
    """The hyper-parameters kvferry needs from a KimiLinear config (names as in transformers' config)."""

    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    intermediate_size: int
    moe_intermediate_size: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int = 4
    q_lora_rank: int | None = None
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.446
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    hidden_act: str = "silu"
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "kimi_linear"

    def __attrs_post_init__(self) -> None:
        unknown = [t for t in self.layer_types if t not in KIMI_LAYER_KINDS]
        if unknown:
            raise ConfigError(f"unknown KimiLinear layer types {unknown}")
        if len(self.mlp_layer_types) != len(self.layer_types):
            raise ConfigError(
                f"{len(self.mlp_layer_types)} mlp_layer_types for {len(self.layer_types)} layer_types"
            )
        bad = [t for t in self.mlp_layer_types if t not in _MLP_TYPES]
        if bad:
            raise ConfigError(f"unknown mlp layer types {bad}; expected {_MLP_TYPES}")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (silu only)")
        if self.attention_bias:
            raise ConfigError("attention_bias is not supported (KimiLinear has none)")
        if "sparse" in self.mlp_layer_types:
            if self.num_experts % self.n_group:
                raise ConfigError(f"{self.num_experts} experts do not split into {self.n_group} groups")
            per_group = self.num_experts // self.n_group
            if per_group < 2:
                raise ConfigError("the router scores each group by its top 2 experts: groups need >= 2")
            if not 1 <= self.topk_group <= self.n_group:
                raise ConfigError(f"topk_group {self.topk_group} outside [1, n_group {self.n_group}]")
            if not 1 <= self.num_experts_per_tok <= self.topk_group * per_group:
                raise ConfigError(
                    f"num_experts_per_tok {self.num_experts_per_tok} exceeds the experts of "
                    f"{self.topk_group} groups"
                )

    # --- the names the family-neutral code reads ------------------------------------------------------------

    @property
    def embeddings_name(self) -> str:
        return "model.embed_tokens.weight"

    @property
    def final_norm_name(self) -> str:
        return "model.norm.weight"

    @property
    def norm_eps(self) -> float:
        return self.rms_norm_eps

    @property
    def float32_suffixes(self) -> tuple[str, ...]:
        """Names of the tensors kept in float32 in a narrower model (transformers' ``_keep_in_fp32_modules_strict``:
        the router's weight and bias, the forget gate's ``dt_bias``)."""
        return (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias", ".forget_gate.dt_bias")

    # --- derived dims --------------------------------------------------------------------------------------

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def num_key_value_heads(self) -> int:
        # MLA expands one latent into every query head's key and value: transformers' attention only works
        # with as many kv heads as query heads
        return self.num_attention_heads

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The mixer of each layer (the cache spec's kinds; the MLP or MoE of a layer is :attr:`moe_layers`)."""
        return tuple(KIMI_LAYER_KINDS[t] for t in self.layer_types)

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return tuple(t == "sparse" for t in self.mlp_layer_types)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def kda_width(self) -> int:
        return self.linear_num_heads * self.linear_head_dim

    @property
    def num_parameters(self) -> int:
        """Parameters of the model (from the tensor shapes; nothing allocated)."""
        return sum(math.prod(shape) for shape in kimi_expected_shapes(self).values())

    @classmethod
    def from_config(cls, config: Any) -> KimiLinearArgs:
        """From a transformers ``KimiLinearConfig``, a ``config.json`` dict, or any object with its attributes.

        :raises ~kvferry.errors.ConfigError: a missing or malformed field.
        """

        def get(*keys: str, default: Any = None) -> Any:
            for key in keys:
                value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
                if value is not None:
                    return value
            return default

        linear = get("linear_attn_config", default={}) or {}
        try:
            layers = int(get("num_hidden_layers", default=0))
            types_ = get("layer_types")
            if types_ is None and "full_attn_layers" in linear and "kda_layers" in linear:
                slots: list[str | None] = [None] * layers
                for i in linear["full_attn_layers"]:
                    slots[int(i) - 1] = "full_attention"  # 1-indexed in the original checkpoints
                for i in linear["kda_layers"]:
                    slots[int(i) - 1] = "linear_attention"
                types_ = slots
            if types_ is None:
                types_ = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(layers)]
            mlp_types = get("mlp_layer_types")
            if mlp_types is None:
                dense = int(get("first_k_dense_replace", default=1))
                mlp_types = ["dense" if i < dense else "sparse" for i in range(len(types_))]
            q_lora = get("q_lora_rank")
            return cls(
                hidden_size=int(get("hidden_size")),
                vocab_size=int(get("vocab_size")),
                layer_types=tuple(str(t) for t in types_),
                mlp_layer_types=tuple(str(t) for t in mlp_types),
                intermediate_size=int(get("intermediate_size")),
                moe_intermediate_size=int(get("moe_intermediate_size")),
                num_attention_heads=int(get("num_attention_heads")),
                kv_lora_rank=int(get("kv_lora_rank")),
                qk_rope_head_dim=int(get("qk_rope_head_dim")),
                qk_nope_head_dim=int(get("qk_nope_head_dim")),
                v_head_dim=int(get("v_head_dim")),
                num_experts=int(get("num_experts", "num_local_experts")),
                num_experts_per_tok=int(get("num_experts_per_tok", "num_experts_per_token")),
                linear_num_heads=int(linear.get("num_heads") or get("linear_num_heads")),
                linear_head_dim=int(linear.get("head_dim") or get("linear_head_dim")),
                linear_conv_kernel_dim=int(
                    linear.get("short_conv_kernel_size") or get("linear_conv_kernel_dim", default=4)
                ),
                q_lora_rank=None if q_lora is None else int(q_lora),
                n_group=int(get("n_group", "num_expert_group", default=1)),
                topk_group=int(get("topk_group", default=1)),
                n_shared_experts=int(get("n_shared_experts", "num_shared_experts", default=1)),
                routed_scaling_factor=float(get("routed_scaling_factor", default=2.446)),
                norm_topk_prob=bool(get("norm_topk_prob", "moe_renormalize", default=True)),
                rms_norm_eps=float(get("rms_norm_eps", default=1e-5)),
                hidden_act=str(get("hidden_act", default="silu")),
                attention_bias=bool(get("attention_bias", default=False)),
                tie_word_embeddings=bool(get("tie_word_embeddings", default=False)),
                model_type=str(get("model_type", default="kimi_linear")),
            )
        except (TypeError, ValueError, IndexError) as exc:
            raise ConfigError(f"config is missing or has a bad KimiLinear field: {exc}") from None
        except KeyError as exc:
            raise ConfigError(f"config is missing the KimiLinear field {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` body transformers reads back as the same ``KimiLinearConfig``."""
        out = attrs.asdict(self)
        out["layer_types"] = list(self.layer_types)
        out["mlp_layer_types"] = list(self.mlp_layer_types)
        out["num_hidden_layers"] = self.num_hidden_layers
        out["num_key_value_heads"] = self.num_key_value_heads
        out["architectures"] = ["KimiLinearForCausalLM"]
        out["pad_token_id"] = 0
        out["bos_token_id"] = None
        out["eos_token_id"] = None
        return out

    def model_spec(
        self,
        *,
        name: str | None = None,
        tokens_per_block: int = 32,
        dtype: str = "float32",
        drafter: DrafterSpec | None = None,
    ) -> ModelSpec:
        """The cache shapes of this model (``ModelSpec.from_hf_config`` reads the same attribute names)."""
        return ModelSpec.from_hf_config(
            self, name=name, tokens_per_block=tokens_per_block, dtype=dtype, drafter=drafter
        )


def tiny_kimi_args(spec: ModelSpec) -> KimiLinearArgs:
    """The KimiLinear hyper-parameters whose caches have the shapes of ``spec`` (the ``tiny-kimi`` preset),
    with its model-side dims: MLP intermediate 128; MoE of 8 experts of 32 in 2 groups, 2 chosen from the best
    group, one shared expert, routed scaling 2.446; the first layer's MLP dense, the others MoE.

    :raises ~kvferry.errors.ConfigError: a spec whose layers are not KDA / MLA.
    """
    mla, kda = spec.mla, spec.kda
    if mla is None or not set(spec.layer_kinds) <= {LayerKind.ATTENTION, LayerKind.KDA}:
        raise ConfigError("tiny_kimi_args needs a spec of MLA (and KDA) layers")
    types_ = {LayerKind.ATTENTION: "full_attention", LayerKind.KDA: "linear_attention"}
    return KimiLinearArgs(
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        layer_types=tuple(types_[k] for k in spec.layer_kinds),
        mlp_layer_types=tuple("dense" if i < 1 else "sparse" for i in range(spec.num_layers)),
        intermediate_size=128,
        moe_intermediate_size=32,
        num_attention_heads=mla.num_heads,
        kv_lora_rank=mla.kv_lora_rank,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        v_head_dim=mla.v_head_dim,
        num_experts=8,
        num_experts_per_tok=2,
        linear_num_heads=kda.num_heads if kda is not None else 4,
        linear_head_dim=kda.head_dim if kda is not None else 16,
        linear_conv_kernel_dim=kda.conv_kernel if kda is not None else 4,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.446,
        norm_topk_prob=True,
        rms_norm_eps=1e-5,
    )


def kimi_expected_shapes(args: KimiLinearArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model by transformers' module name, with its shape (embeddings first)."""
    h = args.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (args.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    heads = args.num_attention_heads
    for i, kind in enumerate(args.layer_kinds):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        a = p + "self_attn."
        if kind == LayerKind.ATTENTION:
            if args.q_lora_rank is None:
                shapes[a + "q_proj.weight"] = (heads * args.qk_head_dim, h)
            else:
                shapes[a + "q_a_proj.weight"] = (args.q_lora_rank, h)
                shapes[a + "q_a_layernorm.weight"] = (args.q_lora_rank,)
                shapes[a + "q_b_proj.weight"] = (heads * args.qk_head_dim, args.q_lora_rank)
            shapes[a + "kv_a_proj_with_mqa.weight"] = (args.latent_dim, h)
            shapes[a + "kv_a_layernorm.weight"] = (args.kv_lora_rank,)
            shapes[a + "kv_b_proj.weight"] = (
                heads * (args.qk_nope_head_dim + args.v_head_dim),
                args.kv_lora_rank,
            )
            shapes[a + "o_proj.weight"] = (h, heads * args.v_head_dim)
        else:
            width, d = args.kda_width, args.linear_head_dim
            for leaf in ("q_proj", "k_proj", "v_proj"):
                shapes[a + leaf + ".weight"] = (width, h)
            shapes[a + "conv1d.weight"] = (3 * width, 1, args.linear_conv_kernel_dim)
            shapes[a + "forget_gate.dt_bias"] = (width,)
            shapes[a + "forget_gate.A_log"] = (1, 1, args.linear_num_heads, 1)
            shapes[a + "forget_gate.f_a_proj.weight"] = (d, h)
            shapes[a + "forget_gate.f_b_proj.weight"] = (width, d)
            shapes[a + "b_proj.weight"] = (args.linear_num_heads, h)
            shapes[a + "g_a_proj.weight"] = (d, h)
            shapes[a + "g_b_proj.weight"] = (width, d)
            shapes[a + "o_norm.weight"] = (d,)
            shapes[a + "o_proj.weight"] = (h, width)
        m = p + "mlp."
        if args.moe_layers[i]:
            e, inter = args.num_experts, args.moe_intermediate_size
            shapes[m + "gate.weight"] = (e, h)
            shapes[m + "gate.e_score_correction_bias"] = (e,)
            shapes[m + "experts.gate_up_proj"] = (e, 2 * inter, h)
            shapes[m + "experts.down_proj"] = (e, h, inter)
            shared = inter * args.n_shared_experts
            shapes[m + "shared_experts.gate_proj.weight"] = (shared, h)
            shapes[m + "shared_experts.up_proj.weight"] = (shared, h)
            shapes[m + "shared_experts.down_proj.weight"] = (h, shared)
        else:
            shapes[m + "gate_proj.weight"] = (args.intermediate_size, h)
            shapes[m + "up_proj.weight"] = (args.intermediate_size, h)
            shapes[m + "down_proj.weight"] = (h, args.intermediate_size)
    return shapes


# --- the checkpoint layout (what save_pretrained writes) -----------------------------------------------------

_FORGET_GATE = re.compile(r"\.self_attn\.(f_a_proj\.|f_b_proj\.|dt_bias$|A_log$)")
_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w[123])\.weight$")
_CONV = re.compile(r"^(.*\.self_attn)\.([qkv])_conv1d\.weight$")


def from_checkpoint_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors under transformers' module names: ``block_sparse_moe`` -> ``mlp``, the forget
    gate's tensors under ``forget_gate``, per-expert ``w1``/``w3`` stacked into ``gate_up_proj`` ``[E, 2I, H]``
    and ``w2`` into ``down_proj`` ``[E, H, I]``, the ``q``/``k``/``v`` conv weights concatenated. Tensors
    already under the module names pass through.

    :raises ~kvferry.errors.ConfigError: an expert or conv tensor without its siblings.
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    convs: dict[str, dict[str, torch.Tensor]] = {}
    for raw, tensor in state.items():
        name = raw.replace(".block_sparse_moe.", ".mlp.")
        name = _FORGET_GATE.sub(lambda m: ".self_attn.forget_gate." + m.group(1), name)
        if match := _EXPERT.match(name):
            experts.setdefault(match.group(1), {}).setdefault(match.group(3), {})[int(match.group(2))] = (
                tensor
            )
        elif match := _CONV.match(name):
            convs.setdefault(match.group(1), {})[match.group(2)] = tensor
        else:
            out[name] = tensor
    for prefix, by_leaf in experts.items():
        counts = {leaf: sorted(t) for leaf, t in by_leaf.items()}
        ids = counts.get("w1", [])
        if (
            set(by_leaf) != {"w1", "w2", "w3"}
            or any(c != ids for c in counts.values())
            or ids != list(range(len(ids)))
        ):
            raise ConfigError(f"{prefix}: experts' w1/w2/w3 tensors are incomplete")
        out[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat((by_leaf["w1"][e], by_leaf["w3"][e])) for e in ids]
        )
        out[prefix + ".down_proj"] = torch.stack([by_leaf["w2"][e] for e in ids])
    for prefix, parts in convs.items():
        if set(parts) != {"q", "k", "v"}:
            raise ConfigError(f"{prefix}: q/k/v conv weights are incomplete")
        out[prefix + ".conv1d.weight"] = torch.cat((parts["q"], parts["k"], parts["v"]))
    return out


def to_checkpoint_names(args: KimiLinearArgs, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`from_checkpoint_names`: the layout ``save_pretrained`` writes and
    ``from_pretrained`` converts back."""
    out: dict[str, torch.Tensor] = {}
    inter = args.moe_intermediate_size
    width = args.kda_width
    for name, tensor in tensors.items():
        saved = name.replace(".mlp.", ".block_sparse_moe.").replace(".self_attn.forget_gate.", ".self_attn.")
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = saved.removesuffix(".gate_up_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.w1.weight"] = tensor[e, :inter]
                out[f"{base}.{e}.w3.weight"] = tensor[e, inter:]
        elif name.endswith(".mlp.experts.down_proj"):
            base = saved.removesuffix(".down_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}.{e}.w2.weight"] = tensor[e]
        elif name.endswith(".self_attn.conv1d.weight"):
            base = saved.removesuffix(".conv1d.weight")
            for i, leaf in enumerate("qkv"):
                out[f"{base}.{leaf}_conv1d.weight"] = tensor[i * width : (i + 1) * width]
        else:
            out[saved] = tensor
    return out
