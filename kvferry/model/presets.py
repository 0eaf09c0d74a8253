"""Built-in models with seeded random weights: ``tiny``, ``tiny-kimi`` and two NemotronH models at real
proportions.

- ``tiny``: the reference model of the test oracles (:func:`~kvferry.model.weights.tiny_args`; weights drawn
  in float64 on the CPU, then cast and moved).
- ``tiny-kimi``: the KimiLinear reference model (KDA, MLA, MoE; :func:`~kvferry.model.kimi_args.tiny_kimi_args`),
  drawn the same way.
- ``nemotron-h-1b`` (about 1.05 B parameters): hidden 2048, vocabulary 131072 (untied LM head), 28 blocks in
  the pattern ``MMMMM*-`` x 4: 20 Mamba2 (32 heads of 64 channels, state 128, 8 groups, conv 4), 4 attention
  (16 query / 4 kv heads of 128) and 4 MLP (relu2, intermediate 8192 = 4 x hidden). About half of the
  parameters are the embeddings and the LM head, as in small models of this family.
- ``nemotron-h-8b`` (about 8.1 B parameters): the dims of :func:`kvferry.pools.spec.preset`'s
  ``nemotron-h-8b``: hidden 4096, 52 blocks (24 Mamba2 of 128 heads x 64, state 128, 8 groups; 4 attention of
  32 / 8 heads x 128; 24 MLP of 21504), vocabulary 131072.

The NemotronH presets are drawn by :meth:`ModelWeights.seeded(..., device=...)
<kvferry.model.weights.ModelWeights.seeded>`: right on the target device in the target dtype (an 8B model in
bfloat16 never exists in float32 or on the host), seeded per device. Their cache spec is
``args.model_spec(...)`` with the preset's drafter and every cache dtype the weights' dtype; with ``scale`` 1 it
has exactly the shapes of :func:`kvferry.pools.spec.preset` of the same name.

``scale`` divides the widths (hidden, vocabulary, intermediate, head counts; head dims and the layer pattern
stay) so that the same code path runs on small machines and in tests.
"""

from __future__ import annotations

import torch

from kvferry.errors import ConfigError
from kvferry.model.kimi_args import tiny_kimi_args
from kvferry.model.weights import ModelArgs, ModelWeights, NemotronHArgs, tiny_args
from kvferry.pools.spec import DrafterSpec, LayerKind, ModelSpec, dtype_from_name, preset

__all__ = ["load_preset", "preset_args"]

#: the transformers block type of each layer kind a NemotronH preset uses
_BLOCK_TYPE = {
    LayerKind.MAMBA2: "linear_attention",
    LayerKind.ATTENTION: "full_attention",
    LayerKind.MLP: "mlp",
}
#: MLP intermediate size of each NemotronH preset (the spec does not hold it: MLP blocks keep no cache)
_INTERMEDIATE = {"nemotron-h-1b": 8192, "nemotron-h-8b": 21504}


def _scaled(value: int, scale: int, floor: int = 1) -> int:
    return max(floor, value // scale)


def _args_of(name: str, spec: ModelSpec, intermediate_size: int, scale: int) -> NemotronHArgs:
    attention, mamba = spec.attention, spec.mamba2
    assert attention is not None and mamba is not None, name
    kv = _scaled(attention.num_kv_heads, scale)
    groups = _scaled(mamba.num_groups, scale)
    q = _scaled(attention.num_query_heads, scale, kv)
    return NemotronHArgs(
        hidden_size=_scaled(spec.hidden_size, scale, 16),
        vocab_size=_scaled(spec.vocab_size, scale, 256),
        layers_block_type=tuple(_BLOCK_TYPE[k] for k in spec.layer_kinds),
        num_attention_heads=q - q % kv,
        num_key_value_heads=kv,
        head_dim=attention.head_dim,
        intermediate_size=_scaled(intermediate_size, scale, 16),
        mamba_num_heads=max(groups, _scaled(mamba.num_heads, scale) // groups * groups),
        mamba_head_dim=mamba.head_dim,
        ssm_state_size=mamba.state_size,
        n_groups=groups,
        conv_kernel=mamba.conv_kernel,
    )


def preset_args(name: str, *, scale: int = 1) -> ModelArgs:
    """The hyper-parameters of a preset (NemotronH; KimiLinear for ``tiny-kimi``), widths divided by ``scale``
    (1: the real proportions).

    :raises ~kvferry.errors.ConfigError: an unknown preset (the message lists them) or a bad ``scale``.
    """
    if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1:
        raise ConfigError(f"preset scale must be an int >= 1, got {scale!r}")
    spec = preset(name)  # ConfigError listing the presets for an unknown name
    if name in ("tiny", "tiny-kimi"):
        if scale != 1:
            raise ConfigError(f"the {name} preset cannot be scaled down")
        return tiny_args(spec) if name == "tiny" else tiny_kimi_args(spec)
    return _args_of(name, spec, _INTERMEDIATE[name], scale)


def _drafter(name: str, args: NemotronHArgs, dtype: str) -> DrafterSpec | None:
    drafter = preset(name).drafter
    if drafter is None:
        return None
    return DrafterSpec(
        num_layers=drafter.num_layers,
        num_query_heads=args.num_attention_heads,
        num_kv_heads=args.num_key_value_heads,
        head_dim=drafter.head_dim,
        tokens_per_block=drafter.tokens_per_block,
        dtype=dtype,
    )


def load_preset(
    name: str,
    *,
    seed: int = 0,
    dtype: str = "float32",
    device: torch.device | str = "cpu",
    scale: int = 1,
) -> tuple[ModelWeights, ModelSpec]:
    """A preset's seeded weights on ``device`` in ``dtype`` and its cache spec (every cache dtype ``dtype``).

    Nothing is kept on failure. :raises ~kvferry.errors.ConfigError: an unknown preset, dtype or scale.
    """
    torch_dtype = dtype_from_name(dtype)
    args = preset_args(name, scale=scale)
    if name in ("tiny", "tiny-kimi"):
        spec = preset(name).with_dtype(dtype)
        return ModelWeights.seeded(args, seed, torch_dtype).to(torch_dtype, device), spec
    assert isinstance(args, NemotronHArgs)
    weights = ModelWeights.seeded(args, seed, torch_dtype, device=device)
    spec = args.model_spec(
        name=name if scale == 1 else f"{name}/{scale}",
        tokens_per_block=preset(name).tokens_per_block,
        dtype=dtype,
        drafter=_drafter(name, args, dtype),
    )
    return weights, spec
