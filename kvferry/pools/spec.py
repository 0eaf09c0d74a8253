"""Model shape specs: what a hybrid model's cache looks like, whole and per tensor-parallel rank.

A :class:`ModelSpec` names the layer kinds in order (their index is the *global layer id*) and the shape of
each cacheable kind: attention (paged KV: GQA key plus value, or MLA's one latent vector per token), Mamba2 (conv
window ``[x|B|C]`` + SSM matrix), KDA-style gated delta rule (short conv ``[q|k|v]`` + SSM matrix) and an
Eagle-style drafter (its own paged KV).
:meth:`ModelSpec.shard` gives the :class:`RankSpec` of one rank: heads split, kv heads (and Mamba groups)
duplicated when the TP size exceeds them, conv split per section; an MLA latent is one "head" every rank holds.

Nothing here allocates memory; :mod:`kvferry.pools.layout` turns a rank spec into pools.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import attrs
import torch
from attrs import frozen

from kvferry.errors import ConfigError

__all__ = [
    "DRAFT_LAYER_SHIFT",
    "HF_LAYER_KINDS",
    "KIMI_LAYER_KINDS",
    "AttentionSpec",
    "DrafterSpec",
    "HeadShard",
    "KdaSpec",
    "LayerKind",
    "Mamba2Spec",
    "MlaSpec",
    "ModelSpec",
    "RankSpec",
    "dtype_from_name",
    "dtype_name",
    "preset",
    "preset_names",
    "split_heads",
]

#: Draft layers get global ids ``DRAFT_LAYER_SHIFT + i`` so they can never collide with target layers.
DRAFT_LAYER_SHIFT = 1 << 30

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


def dtype_name(dtype: torch.dtype | str) -> str:
    if isinstance(dtype, str):
        dtype_from_name(dtype)
        return dtype
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise ConfigError(f"unsupported dtype {dtype}")


def _itemsize(name: str) -> int:
    return dtype_from_name(name).itemsize


def _positive(_instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive int, got {value!r}")


def _known_dtype(_instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in _DTYPES:
        raise ConfigError(f"{attribute.name}: unknown dtype {value!r}")


class LayerKind(enum.StrEnum):
    """What one block of the model is. Only ATTENTION, MAMBA2 and KDA hold cache."""

    ATTENTION = "attention"
    MAMBA2 = "mamba2"
    KDA = "kda"
    MLP = "mlp"
    MOE = "moe"


#: transformers' NemotronH ``layers_block_type`` / ``layer_types`` entry -> the kind of that block
HF_LAYER_KINDS: Mapping[str, LayerKind] = MappingProxyType(
    {
        "linear_attention": LayerKind.MAMBA2,
        "mamba": LayerKind.MAMBA2,
        "full_attention": LayerKind.ATTENTION,
        "attention": LayerKind.ATTENTION,
        "mlp": LayerKind.MLP,
        "moe": LayerKind.MOE,
    }
)

#: transformers' KimiLinear ``layer_types`` entry -> the kind of that decoder layer's mixer
KIMI_LAYER_KINDS: Mapping[str, LayerKind] = MappingProxyType(
    {"linear_attention": LayerKind.KDA, "full_attention": LayerKind.ATTENTION}
)


@frozen
class HeadShard:
    """Which heads of a dimension one rank holds.

    ``count`` heads starting at ``first``; ``replicas`` ranks hold the same heads (1 when the dimension splits
    evenly, ``tp // total`` when the TP size exceeds the head count and heads are duplicated).
    """

    total: int
    count: int
    first: int
    replicas: int

    @property
    def is_duplicated(self) -> bool:
        return self.replicas > 1

    def is_writer(self, rank: int) -> bool:
        """True on exactly one rank of each group of replicas: the one elected to send duplicated data."""
        return rank % self.replicas == 0


def split_heads(total: int, tp_size: int, rank: int) -> HeadShard:
    """Split ``total`` heads over ``tp_size`` ranks; duplicate them when ``tp_size > total``."""
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank {rank} out of range for tp_size {tp_size}")
    if total >= tp_size:
        if total % tp_size:
            raise ConfigError(f"{total} heads do not split evenly over tp_size {tp_size}")
        count = total // tp_size
        return HeadShard(total=total, count=count, first=rank * count, replicas=1)
    if tp_size % total:
        raise ConfigError(f"tp_size {tp_size} is not a multiple of {total} heads; cannot duplicate them")
    replicas = tp_size // total
    return HeadShard(total=total, count=1, first=rank // replicas, replicas=replicas)


@frozen
class AttentionSpec:
    """GQA attention: query heads, kv heads, head dim, cache dtype."""

    num_query_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    dtype: str = attrs.field(default="float32", validator=_known_dtype)

    def __attrs_post_init__(self) -> None:
        if self.num_query_heads % self.num_kv_heads:
            raise ConfigError("num_query_heads must be a multiple of num_kv_heads")

    def kv_bytes_per_token(self, num_kv_heads: int | None = None) -> int:
        """Bytes of K plus V per token per layer for ``num_kv_heads`` heads (default: all)."""
        heads = self.num_kv_heads if num_kv_heads is None else num_kv_heads
        return 2 * heads * self.head_dim * _itemsize(self.dtype)


@frozen
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2 style, as KimiLinear uses it): the cache keeps one latent vector
    per token, ``[kv_lora_rank | qk_rope_head_dim]``, shared by every head; queries have ``num_heads`` heads of
    ``qk_nope_head_dim + qk_rope_head_dim``, values ``v_head_dim``."""

    num_heads: int = attrs.field(validator=_positive)
    kv_lora_rank: int = attrs.field(validator=_positive)
    qk_rope_head_dim: int = attrs.field(validator=_positive)
    qk_nope_head_dim: int = attrs.field(validator=_positive)
    v_head_dim: int = attrs.field(validator=_positive)
    dtype: str = attrs.field(default="float32", validator=_known_dtype)

    @property
    def latent_dim(self) -> int:
        """Values per token in the cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def latent_bytes_per_token(self) -> int:
        """Bytes of one token's latent per layer (on every rank: the latent is not split)."""
        return self.latent_dim * _itemsize(self.dtype)


@frozen
class Mamba2Spec:
    """Mamba2 mixer: the conv window holds sections ``[x | B | C]``, the SSM state ``[heads, head_dim, state]``."""

    num_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    state_size: int = attrs.field(validator=_positive)
    num_groups: int = attrs.field(validator=_positive)
    conv_kernel: int = attrs.field(validator=_positive)
    conv_dtype: str = attrs.field(default="float32", validator=_known_dtype)
    ssm_dtype: str = attrs.field(default="float32", validator=_known_dtype)

    def __attrs_post_init__(self) -> None:
        if self.num_heads % self.num_groups:
            raise ConfigError("Mamba2 num_heads must be a multiple of num_groups")
        if self.conv_kernel < 2:
            raise ConfigError("Mamba2 conv_kernel must be at least 2")

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_sections(self) -> tuple[int, int, int]:
        """Channels of the conv window sections x, B, C (whole model)."""
        bc = self.num_groups * self.state_size
        return (self.intermediate_size, bc, bc)

    @property
    def conv_dim(self) -> int:
        return sum(self.conv_sections)


@frozen
class KdaSpec:
    """KDA-style gated delta rule: short conv over ``[q | k | v]``, SSM state ``[heads, head_dim, head_dim]``."""

    num_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    conv_kernel: int = attrs.field(validator=_positive)
    conv_dtype: str = attrs.field(default="float32", validator=_known_dtype)
    ssm_dtype: str = attrs.field(default="float32", validator=_known_dtype)

    @property
    def conv_sections(self) -> tuple[int, int, int]:
        width = self.num_heads * self.head_dim
        return (width, width, width)

    @property
    def conv_dim(self) -> int:
        return sum(self.conv_sections)


@frozen
class DrafterSpec:
    """Eagle-style drafter: its own attention layer(s) with its own paged KV and block size."""

    num_layers: int = attrs.field(validator=_positive)
    num_query_heads: int = attrs.field(validator=_positive)
    num_kv_heads: int = attrs.field(validator=_positive)
    head_dim: int = attrs.field(validator=_positive)
    tokens_per_block: int = attrs.field(validator=_positive)
    dtype: str = attrs.field(default="float32", validator=_known_dtype)

    @property
    def attention(self) -> AttentionSpec:
        return AttentionSpec(self.num_query_heads, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def global_layer_ids(self) -> tuple[int, ...]:
        return tuple(DRAFT_LAYER_SHIFT + i for i in range(self.num_layers))


def _layer_kinds(value: Any) -> tuple[LayerKind, ...]:
    return tuple(LayerKind(v) for v in value)


@frozen
class ModelSpec:
    """The whole model: layer kinds in order (index = global layer id) and each cacheable kind's shape.

    ATTENTION layers are GQA (``attention``: key plus value per kv head) or MLA (``mla``: one latent per token);
    a spec has one of the two. A layer kind is the block's mixer: a KimiLinear decoder layer (mixer plus MLP or
    MoE) is one entry, its KDA or MLA mixer.
    """

    name: str
    hidden_size: int = attrs.field(validator=_positive)
    vocab_size: int = attrs.field(validator=_positive)
    layer_kinds: tuple[LayerKind, ...] = attrs.field(converter=_layer_kinds)
    tokens_per_block: int = attrs.field(validator=_positive)
    attention: AttentionSpec | None = None
    mamba2: Mamba2Spec | None = None
    kda: KdaSpec | None = None
    drafter: DrafterSpec | None = None
    mla: MlaSpec | None = None

    def __attrs_post_init__(self) -> None:
        if not self.layer_kinds:
            raise ConfigError("a model needs at least one layer")
        if self.attention is not None and self.mla is not None:
            raise ConfigError("attention layers are GQA or MLA, not both: give attention or mla")
        for kind, field in (
            (LayerKind.ATTENTION, self.attention if self.mla is None else self.mla),
            (LayerKind.MAMBA2, self.mamba2),
            (LayerKind.KDA, self.kda),
        ):
            if kind in self.layer_kinds and field is None:
                raise ConfigError(f"layer kind {kind.value} is used but its spec is missing")
        if self.drafter is not None and self.drafter.num_layers >= DRAFT_LAYER_SHIFT:
            raise ConfigError("too many drafter layers")
        if len(self.layer_kinds) >= DRAFT_LAYER_SHIFT:
            raise ConfigError("too many layers")

    def layer_ids(self, kind: LayerKind) -> tuple[int, ...]:
        """Global ids of the layers of one kind, in model order."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return self.layer_ids(LayerKind.ATTENTION)

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k in (LayerKind.MAMBA2, LayerKind.KDA))

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def with_dtype(self, dtype: str) -> ModelSpec:
        """The same shapes with every cache dtype set to ``dtype``."""
        _known_dtype(None, attrs.fields(AttentionSpec).dtype, dtype)
        return attrs.evolve(
            self,
            attention=None if self.attention is None else attrs.evolve(self.attention, dtype=dtype),
            mamba2=None
            if self.mamba2 is None
            else attrs.evolve(self.mamba2, conv_dtype=dtype, ssm_dtype=dtype),
            kda=None if self.kda is None else attrs.evolve(self.kda, conv_dtype=dtype, ssm_dtype=dtype),
            drafter=None if self.drafter is None else attrs.evolve(self.drafter, dtype=dtype),
            mla=None if self.mla is None else attrs.evolve(self.mla, dtype=dtype),
        )

    def without_drafter(self) -> ModelSpec:
        return attrs.evolve(self, drafter=None)

    def shard(self, tp_size: int, rank: int) -> RankSpec:
        """The cache shapes one rank of a ``tp_size``-way tensor-parallel group holds."""
        if tp_size <= 0:
            raise ConfigError(f"tp_size must be positive, got {tp_size}")
        attention_q = attention_kv = None
        if self.attention is not None:
            attention_q = split_heads(self.attention.num_query_heads, tp_size, rank)
            attention_kv = split_heads(self.attention.num_kv_heads, tp_size, rank)
        elif self.mla is not None:
            attention_q = split_heads(self.mla.num_heads, tp_size, rank)
            # the latent is one vector per token for all heads: every rank keeps all of it
            attention_kv = split_heads(1, tp_size, rank)
        mamba_heads = mamba_groups = None
        if self.mamba2 is not None:
            mamba_heads = split_heads(self.mamba2.num_heads, tp_size, rank)
            mamba_groups = split_heads(self.mamba2.num_groups, tp_size, rank)
            if mamba_heads.is_duplicated:
                raise ConfigError(f"Mamba2 num_heads {self.mamba2.num_heads} < tp_size {tp_size}")
        kda_heads = None
        if self.kda is not None:
            kda_heads = split_heads(self.kda.num_heads, tp_size, rank)
            if kda_heads.is_duplicated:
                raise ConfigError(f"KDA num_heads {self.kda.num_heads} < tp_size {tp_size}")
        draft_q = draft_kv = None
        if self.drafter is not None:
            draft_q = split_heads(self.drafter.num_query_heads, tp_size, rank)
            draft_kv = split_heads(self.drafter.num_kv_heads, tp_size, rank)
        return RankSpec(
            model=self,
            tp_size=tp_size,
            rank=rank,
            attention_query_heads=attention_q,
            attention_kv_heads=attention_kv,
            mamba2_heads=mamba_heads,
            mamba2_groups=mamba_groups,
            kda_heads=kda_heads,
            draft_query_heads=draft_q,
            draft_kv_heads=draft_kv,
        )

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        name: str | None = None,
        tokens_per_block: int = 32,
        dtype: str = "float32",
        drafter: DrafterSpec | None = None,
    ) -> ModelSpec:
        """Build a spec from a transformers ``NemotronHConfig`` or ``KimiLinearConfig`` (or any object with
        their attributes).

        transformers is not imported: the config is read by attribute, so this works on a plain namespace.
        """
        raw = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
        if raw is None:
            raise ConfigError("config has no layers_block_type")
        kimi = str(getattr(config, "model_type", "")) == "kimi_linear"
        names = KIMI_LAYER_KINDS if kimi else HF_LAYER_KINDS
        try:
            kinds = tuple(names[str(k)] for k in raw)
        except KeyError as exc:
            raise ConfigError(f"unknown layer type {exc.args[0]!r} in config") from None
        if kimi:
            return cls._from_kimi_config(config, kinds, name, tokens_per_block, dtype, drafter)
        attention = mamba2 = None
        if LayerKind.ATTENTION in kinds:
            heads = int(config.num_attention_heads)
            head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
            attention = AttentionSpec(heads, int(config.num_key_value_heads), head_dim, dtype)
        if LayerKind.MAMBA2 in kinds:
            mamba2 = Mamba2Spec(
                num_heads=int(config.mamba_num_heads),
                head_dim=int(config.mamba_head_dim),
                state_size=int(config.ssm_state_size),
                num_groups=int(config.n_groups),
                conv_kernel=int(config.conv_kernel),
                conv_dtype=dtype,
                ssm_dtype=dtype,
            )
        return cls(
            name=name or str(getattr(config, "model_type", "nemotron_h")),
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            layer_kinds=kinds,
            tokens_per_block=tokens_per_block,
            attention=attention,
            mamba2=mamba2,
            drafter=drafter,
        )

    @classmethod
    def _from_kimi_config(
        cls,
        config: Any,
        kinds: tuple[LayerKind, ...],
        name: str | None,
        tokens_per_block: int,
        dtype: str,
        drafter: DrafterSpec | None,
    ) -> ModelSpec:
        kda = mla = None
        if LayerKind.KDA in kinds:
            kda = KdaSpec(
                num_heads=int(config.linear_num_heads),
                head_dim=int(config.linear_head_dim),
                conv_kernel=int(config.linear_conv_kernel_dim),
                conv_dtype=dtype,
                ssm_dtype=dtype,
            )
        if LayerKind.ATTENTION in kinds:
            mla = MlaSpec(
                num_heads=int(config.num_attention_heads),
                kv_lora_rank=int(config.kv_lora_rank),
                qk_rope_head_dim=int(config.qk_rope_head_dim),
                qk_nope_head_dim=int(config.qk_nope_head_dim),
                v_head_dim=int(config.v_head_dim),
                dtype=dtype,
            )
        return cls(
            name=name or "kimi_linear",
            hidden_size=int(config.hidden_size),
            vocab_size=int(config.vocab_size),
            layer_kinds=kinds,
            tokens_per_block=tokens_per_block,
            kda=kda,
            mla=mla,
            drafter=drafter,
        )


@frozen
class RankSpec:
    """One rank's share of a model's cache: the head shards of each cacheable kind."""

    model: ModelSpec
    tp_size: int
    rank: int
    attention_query_heads: HeadShard | None
    attention_kv_heads: HeadShard | None
    mamba2_heads: HeadShard | None
    mamba2_groups: HeadShard | None
    kda_heads: HeadShard | None
    draft_query_heads: HeadShard | None
    draft_kv_heads: HeadShard | None

    @property
    def mamba2_conv_sections(self) -> tuple[int, int, int]:
        """Channels of x, B, C this rank holds (B and C duplicated when groups < tp)."""
        spec, heads, groups = self.model.mamba2, self.mamba2_heads, self.mamba2_groups
        if spec is None or heads is None or groups is None:
            return (0, 0, 0)
        bc = groups.count * spec.state_size
        return (heads.count * spec.head_dim, bc, bc)

    @property
    def kda_conv_sections(self) -> tuple[int, int, int]:
        spec, heads = self.model.kda, self.kda_heads
        if spec is None or heads is None:
            return (0, 0, 0)
        width = heads.count * spec.head_dim
        return (width, width, width)


def _tiny_drafter() -> DrafterSpec:
    return DrafterSpec(num_layers=1, num_query_heads=8, num_kv_heads=4, head_dim=16, tokens_per_block=8)


def _tiny() -> ModelSpec:
    # The reference model of the test oracles: a small NemotronH (pattern "M*M-M*-"), byte-level vocabulary.
    return ModelSpec(
        name="tiny",
        hidden_size=64,
        vocab_size=256,
        layer_kinds=(
            LayerKind.MAMBA2,
            LayerKind.ATTENTION,
            LayerKind.MAMBA2,
            LayerKind.MLP,
            LayerKind.MAMBA2,
            LayerKind.ATTENTION,
            LayerKind.MLP,
        ),
        tokens_per_block=4,
        attention=AttentionSpec(num_query_heads=8, num_kv_heads=4, head_dim=16),
        mamba2=Mamba2Spec(num_heads=8, head_dim=16, state_size=16, num_groups=2, conv_kernel=4),
        drafter=_tiny_drafter(),
    )


def _tiny_kimi() -> ModelSpec:
    # The KimiLinear reference model of the test oracles: KDA and MLA layers (mixers of decoder layers whose
    # MLP or MoE the model's args give), byte-level vocabulary, the tiny drafter.
    kda, mla = LayerKind.KDA, LayerKind.ATTENTION
    return ModelSpec(
        name="tiny-kimi",
        hidden_size=64,
        vocab_size=256,
        layer_kinds=(kda, kda, mla, kda, kda, mla),
        tokens_per_block=4,
        kda=KdaSpec(num_heads=4, head_dim=16, conv_kernel=4),
        mla=MlaSpec(num_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
        drafter=_tiny_drafter(),
    )


# Nemotron-H-1B-class layout: 28 blocks, 20 Mamba2, 4 attention, 4 MLP (see kvferry.model.presets).
_NEMOTRON_H_1B_PATTERN = "MMMMM*-" * 4
# Nemotron-H-8B-class layout: 52 blocks, 24 Mamba2, 4 attention, 24 MLP.
_NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
_PATTERN_KINDS = {"M": LayerKind.MAMBA2, "*": LayerKind.ATTENTION, "-": LayerKind.MLP, "E": LayerKind.MOE}


def _nemotron_h(
    name: str, hidden: int, pattern: str, query_heads: int, kv_heads: int, mamba_heads: int
) -> ModelSpec:
    # the NemotronH family's shapes: 128-wide attention heads, 64-wide Mamba2 heads with state 128 in 8 groups,
    # bf16 caches with a float32 SSM state, a one-layer drafter shaped as the target's attention
    return ModelSpec(
        name=name,
        hidden_size=hidden,
        vocab_size=131072,
        layer_kinds=tuple(_PATTERN_KINDS[c] for c in pattern),
        tokens_per_block=32,
        attention=AttentionSpec(
            num_query_heads=query_heads, num_kv_heads=kv_heads, head_dim=128, dtype="bfloat16"
        ),
        mamba2=Mamba2Spec(
            num_heads=mamba_heads,
            head_dim=64,
            state_size=128,
            num_groups=8,
            conv_kernel=4,
            conv_dtype="bfloat16",
            ssm_dtype="float32",
        ),
        drafter=DrafterSpec(
            num_layers=1,
            num_query_heads=query_heads,
            num_kv_heads=kv_heads,
            head_dim=128,
            tokens_per_block=64,
            dtype="bfloat16",
        ),
    )


def _nemotron_h_8b() -> ModelSpec:
    return _nemotron_h("nemotron-h-8b", 4096, _NEMOTRON_H_8B_PATTERN, 32, 8, 128)


def _nemotron_h_1b() -> ModelSpec:
    return _nemotron_h("nemotron-h-1b", 2048, _NEMOTRON_H_1B_PATTERN, 16, 4, 32)


_PRESETS = {
    "tiny": _tiny,
    "tiny-kimi": _tiny_kimi,
    "nemotron-h-1b": _nemotron_h_1b,
    "nemotron-h-8b": _nemotron_h_8b,
}


def preset_names() -> tuple[str, ...]:
    return tuple(_PRESETS)


def preset(name: str) -> ModelSpec:
    """A built-in model spec: ``tiny`` (the reference model), ``tiny-kimi`` (the KimiLinear reference: KDA and
    MLA), ``nemotron-h-1b`` or ``nemotron-h-8b`` (real proportions; :mod:`kvferry.model.presets` gives them
    seeded weights).

    :raises ~kvferry.errors.ConfigError: an unknown name (the message lists the presets).
    """
    try:
        return _PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; expected one of {sorted(_PRESETS)}") from None
