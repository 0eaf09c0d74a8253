"""Model weights: the architecture's hyper-parameters, seeded tiny weights, checkpoints, a transformers twin.

One :class:`ModelWeights` serves both families: NemotronH (:class:`NemotronHArgs`) and KimiLinear
(:class:`~kvferry.model.kimi_args.KimiLinearArgs`); the family-neutral accessors (:attr:`ModelWeights.embeddings`,
:attr:`ModelWeights.final_norm`, :attr:`ModelWeights.lm_head`, ``args.norm_eps``) hide their tensor names.
Tensors keep transformers' state-dict names (``model.layers.3.mixer.in_proj.weight``), so a state dict moves
between kvferry and ``NemotronHForCausalLM`` / ``KimiLinearForCausalLM`` unchanged. Checkpoints are read from a
local directory
(``config.json`` + ``*.safetensors`` as ``save_pretrained`` writes them) by a small safetensors reader here:
no hub, no transformers. transformers is imported only by :func:`tiny_hf_config`, :func:`hf_model` and
:func:`hf_generate`, the oracle side of the tests.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import struct
import types
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from attrs import frozen

from kvferry.errors import ConfigError, MissingExtraError
from kvferry.model.kimi_args import (
    KimiLinearArgs,
    from_checkpoint_names,
    kimi_expected_shapes,
    to_checkpoint_names,
)
from kvferry.pools.spec import HF_LAYER_KINDS, DrafterSpec, LayerKind, ModelSpec

__all__ = [
    "ModelArgs",
    "ModelWeights",
    "NemotronHArgs",
    "exact_float64",
    "hf_generate",
    "hf_model",
    "load_safetensors",
    "save_safetensors",
    "tiny_args",
    "tiny_hf_config",
]

_TYPE_OF_KIND = {
    LayerKind.MAMBA2: "linear_attention",
    LayerKind.ATTENTION: "full_attention",
    LayerKind.MLP: "mlp",
    LayerKind.MOE: "moe",
}


@frozen
class NemotronHArgs:
    """The hyper-parameters kvferry needs from a NemotronH config (names as in transformers' config)."""

    hidden_size: int
    vocab_size: int
    layers_block_type: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int = 128
    layer_norm_epsilon: float = 1e-5
    #: dt floor applied to every token (transformers clamps prefill dt at ``time_step_min``).
    time_step_min: float = 0.001
    mlp_hidden_act: str = "relu2"
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    model_type: str = "nemotron_h"

    def __attrs_post_init__(self) -> None:
        unknown = [t for t in self.layers_block_type if t not in HF_LAYER_KINDS]
        if unknown:
            raise ConfigError(f"unknown layer types {unknown}")
        if LayerKind.MOE in self.layer_kinds:
            raise ConfigError("MoE blocks are not supported by kvferry's NemotronH model yet")
        if self.mlp_hidden_act != "relu2":
            raise ConfigError(f"mlp_hidden_act {self.mlp_hidden_act!r} is not supported (relu2 only)")
        if self.use_bias or self.mlp_bias or self.attention_bias:
            raise ConfigError("biases on projections are not supported (NemotronH has none)")

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(HF_LAYER_KINDS[t] for t in self.layers_block_type)

    @property
    def embeddings_name(self) -> str:
        return "model.embeddings.weight"

    @property
    def final_norm_name(self) -> str:
        return "model.norm_f.weight"

    @property
    def norm_eps(self) -> float:
        return self.layer_norm_epsilon

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def num_parameters(self) -> int:
        """Parameters of the model (from the tensor shapes; nothing allocated)."""
        return sum(math.prod(shape) for shape in _expected_shapes(self).values())

    @classmethod
    def from_config(cls, config: Any) -> NemotronHArgs:
        """From a transformers ``NemotronHConfig``, a ``config.json`` dict, or any object with its attributes."""

        def get(key: str, default: Any = None) -> Any:
            if isinstance(config, Mapping):
                return config.get(key, default)
            return getattr(config, key, default)

        types_ = get("layers_block_type") or get("layer_types")
        if types_ is None and get("hybrid_override_pattern"):
            pattern = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
            types_ = [pattern[c] for c in str(get("hybrid_override_pattern"))]
        if types_ is None:
            raise ConfigError("config has no layers_block_type")
        try:
            heads = int(get("num_attention_heads", 1))
            return cls(
                hidden_size=int(get("hidden_size")),
                vocab_size=int(get("vocab_size")),
                layers_block_type=tuple(str(t) for t in types_),
                num_attention_heads=heads,
                num_key_value_heads=int(get("num_key_value_heads") or heads),
                head_dim=int(get("head_dim") or int(get("hidden_size")) // heads),
                intermediate_size=int(get("intermediate_size")),
                mamba_num_heads=int(get("mamba_num_heads")),
                mamba_head_dim=int(get("mamba_head_dim")),
                ssm_state_size=int(get("ssm_state_size")),
                n_groups=int(get("n_groups", None) or get("mamba_n_groups", 1)),
                conv_kernel=int(get("conv_kernel", None) or get("mamba_d_conv", 4)),
                chunk_size=int(get("chunk_size", None) or get("mamba_chunk_size", 128)),
                layer_norm_epsilon=float(get("layer_norm_epsilon", 1e-5)),
                time_step_min=float(get("time_step_min", None) or get("mamba_dt_min", 0.001)),
                mlp_hidden_act=str(get("mlp_hidden_act", "relu2")),
                use_conv_bias=bool(get("use_conv_bias", True)),
                use_bias=bool(get("use_bias", False)),
                mlp_bias=bool(get("mlp_bias", False)),
                attention_bias=bool(get("attention_bias", False)),
                tie_word_embeddings=bool(get("tie_word_embeddings", False)),
                model_type=str(get("model_type", "nemotron_h")),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"config is missing or has a bad NemotronH field: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """A ``config.json`` body transformers reads back as the same ``NemotronHConfig``."""
        out = attrs.asdict(self)
        out["layers_block_type"] = list(self.layers_block_type)
        out["architectures"] = ["NemotronHForCausalLM"]
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


def tiny_args(spec: ModelSpec, *, intermediate_size: int = 128, chunk_size: int = 8) -> NemotronHArgs:
    """The NemotronH hyper-parameters whose caches have the shapes of ``spec`` (the ``tiny`` preset).

    ``chunk_size`` (Mamba2 scan chunk) is small so that prompts in tests cross chunk boundaries;
    ``time_step_min`` is tiny so the dt floor never binds (transformers applies it on prefill only).
    """
    if spec.attention is None or spec.mamba2 is None:
        raise ConfigError("tiny_args needs a spec with attention and Mamba2 layers")
    if LayerKind.KDA in spec.layer_kinds:
        raise ConfigError("NemotronH has no KDA layers")
    return NemotronHArgs(
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        layers_block_type=tuple(_TYPE_OF_KIND[k] for k in spec.layer_kinds),
        num_attention_heads=spec.attention.num_query_heads,
        num_key_value_heads=spec.attention.num_kv_heads,
        head_dim=spec.attention.head_dim,
        intermediate_size=intermediate_size,
        mamba_num_heads=spec.mamba2.num_heads,
        mamba_head_dim=spec.mamba2.head_dim,
        ssm_state_size=spec.mamba2.state_size,
        n_groups=spec.mamba2.num_groups,
        conv_kernel=spec.mamba2.conv_kernel,
        chunk_size=chunk_size,
        time_step_min=1e-6,
    )


def tiny_hf_config(spec: ModelSpec, **kwargs: Any) -> Any:
    """A transformers ``NemotronHConfig`` matching ``spec`` (imports transformers)."""
    return _hf_config(tiny_args(spec, **kwargs))


def _transformers() -> types.ModuleType:
    try:
        import transformers
    except ImportError:
        raise MissingExtraError("transformers", "model") from None
    return transformers


def _hf_config(args: ModelArgs) -> Any:
    transformers = _transformers()
    body = args.to_dict()
    body.pop("architectures")
    body.pop("model_type")
    if isinstance(args, KimiLinearArgs):
        return transformers.KimiLinearConfig(**body)
    body["layers_block_type"] = list(args.layers_block_type)
    return transformers.NemotronHConfig(**body)


#: The hyper-parameters of either family.
ModelArgs = NemotronHArgs | KimiLinearArgs


def args_from_config(config: Any) -> ModelArgs:
    """The family's args from a ``config.json`` dict or a transformers config, by its ``model_type``.

    :raises ~kvferry.errors.ConfigError: an unsupported ``model_type`` or a bad field.
    """
    model_type = (
        config.get("model_type") if isinstance(config, Mapping) else getattr(config, "model_type", None)
    )
    if model_type == "kimi_linear":
        return KimiLinearArgs.from_config(config)
    if model_type in (None, "nemotron_h"):
        return NemotronHArgs.from_config(config)
    raise ConfigError(f"model_type {model_type!r} is not supported (nemotron_h, kimi_linear)")


# --- tensors ---------------------------------------------------------------------------------------------


def _expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    if isinstance(args, KimiLinearArgs):
        return kimi_expected_shapes(args)
    h = args.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embeddings.weight": (args.vocab_size, h),
        "model.norm_f.weight": (h,),
    }
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    for i, kind in enumerate(args.layer_kinds):
        p = f"model.layers.{i}."
        shapes[p + "norm.weight"] = (h,)
        m = p + "mixer."
        if kind == LayerKind.MAMBA2:
            heads, inter = args.mamba_num_heads, args.mamba_intermediate
            shapes[m + "in_proj.weight"] = (inter + args.conv_dim + heads, h)
            shapes[m + "conv1d.weight"] = (args.conv_dim, 1, args.conv_kernel)
            if args.use_conv_bias:
                shapes[m + "conv1d.bias"] = (args.conv_dim,)
            for name in ("dt_bias", "A_log", "D"):
                shapes[m + name] = (heads,)
            shapes[m + "norm.weight"] = (inter,)
            shapes[m + "out_proj.weight"] = (h, inter)
        elif kind == LayerKind.ATTENTION:
            q, kv, d = args.num_attention_heads, args.num_key_value_heads, args.head_dim
            shapes[m + "q_proj.weight"] = (q * d, h)
            shapes[m + "k_proj.weight"] = (kv * d, h)
            shapes[m + "v_proj.weight"] = (kv * d, h)
            shapes[m + "o_proj.weight"] = (h, q * d)
        elif kind == LayerKind.MLP:
            shapes[m + "up_proj.weight"] = (args.intermediate_size, h)
            shapes[m + "down_proj.weight"] = (h, args.intermediate_size)
    return shapes


def _cast_dtype(args: ModelArgs, name: str, dtype: torch.dtype) -> torch.dtype:
    # transformers keeps some tensors in float32 whatever the model's dtype (_keep_in_fp32_modules_strict)
    if dtype.itemsize < 4 and isinstance(args, KimiLinearArgs) and name.endswith(args.float32_suffixes):
        return torch.float32
    return dtype


@frozen
class ModelWeights:
    """A model's tensors by transformers state-dict name, validated against ``args`` (either family)."""

    args: ModelArgs
    tensors: Mapping[str, torch.Tensor] = attrs.field(repr=lambda t: f"<{len(t)} tensors>")

    def __attrs_post_init__(self) -> None:
        expected = _expected_shapes(self.args)
        missing = sorted(set(expected) - set(self.tensors))
        if missing:
            raise ConfigError(f"weights are missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        for name, shape in expected.items():
            if tuple(self.tensors[name].shape) != shape:
                raise ConfigError(f"{name} has shape {tuple(self.tensors[name].shape)}, expected {shape}")

    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.device

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def embeddings(self) -> torch.Tensor:
        """The token embedding ``[vocab, hidden]`` (NemotronH ``model.embeddings``, KimiLinear
        ``model.embed_tokens``)."""
        return self.tensors[self.args.embeddings_name]

    @property
    def final_norm(self) -> torch.Tensor:
        """The final RMSNorm's weight ``[hidden]`` (``model.norm_f`` / ``model.norm``)."""
        return self.tensors[self.args.final_norm_name]

    @property
    def lm_head(self) -> torch.Tensor:
        return self.embeddings if self.args.tie_word_embeddings else self.tensors["lm_head.weight"]

    def to(self, dtype: torch.dtype, device: torch.device | str | None = None) -> ModelWeights:
        """The same weights cast to ``dtype`` (and moved to ``device``); the tensors the family keeps in float32
        (KimiLinear's router and ``dt_bias``, as transformers does) stay float32 under a narrower ``dtype``."""
        return ModelWeights(
            self.args,
            {k: v.to(dtype=_cast_dtype(self.args, k, dtype), device=device) for k, v in self.tensors.items()},
        )

    @classmethod
    def from_state_dict(
        cls,
        args: ModelArgs | Any,
        state_dict: Mapping[str, torch.Tensor],
        dtype: torch.dtype | None = None,
    ) -> ModelWeights:
        """From a transformers state dict (extra keys such as ``mtp.*`` are ignored).

        :param args: a :class:`NemotronHArgs` / :class:`KimiLinearArgs` or a config :func:`args_from_config`
            reads.
        :raises ~kvferry.errors.ConfigError: when a tensor is missing or has the wrong shape.
        """
        if not isinstance(args, NemotronHArgs | KimiLinearArgs):
            args = args_from_config(args)
        wanted = _expected_shapes(args)
        tensors = {k: v.detach() for k, v in state_dict.items() if k in wanted}
        if dtype is not None:
            tensors = {k: v.to(_cast_dtype(args, k, dtype)) for k, v in tensors.items()}
        return cls(args, tensors)

    @classmethod
    def seeded(
        cls,
        args: ModelArgs,
        seed: int,
        dtype: torch.dtype = torch.float32,
        *,
        residual_scale: float = 0.7,
        bigram: float = 1.5,
        device: torch.device | str | None = None,
    ) -> ModelWeights:
        """Seeded random weights, independent of transformers.

        Without ``device`` every tensor is drawn in float64 on the CPU, then cast: the same weights whatever
        ``dtype`` (the test oracles rely on it). With ``device`` the matrices are drawn right there, in
        ``dtype``, by a generator of that device (no float64 or host copy of a large model ever exists; the
        same seed gives the same weights on the same kind of device, not across devices or dtypes); the
        per-channel vectors are drawn in float32 there and cast.

        A purely random model's greedy continuation is unpredictable, so no untrained drafter could ever be
        accepted. Two knobs give it some structure while the context still decides many tokens:
        ``bigram`` leans the LM head towards a fixed successor of the current token, ``residual_scale``
        scales what each block adds to the residual stream. The defaults make the derived drafter
        (:meth:`kvferry.model.drafter.DrafterWeights.derived`) right often enough to exercise acceptance and
        wrong often enough to exercise rejection. Every block is pre-normed and adds ``residual_scale`` of a
        unit-variance update, so the residual stream stays within a few units over any depth (finite in
        bfloat16).
        """
        if device is None:
            gen = torch.Generator().manual_seed(seed)
            big = small = torch.float64
            where = torch.device("cpu")
        else:
            where = torch.device(device)
            gen = torch.Generator(device=where).manual_seed(seed)
            big, small = dtype, torch.float32

        def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
            out = torch.randn(*shape, generator=gen, dtype=big if len(shape) > 1 else small, device=where)
            return out.mul_(std) if std != 1.0 else out

        def near_one(n: int) -> torch.Tensor:
            return randn(n, std=0.1).add_(1.0)

        t: dict[str, torch.Tensor] = {}
        for name, shape in _expected_shapes(args).items():
            leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                t[name] = near_one(shape[0])
            elif name == args.embeddings_name:
                t[name] = randn(*shape)
            elif name.endswith("conv1d.weight"):
                t[name] = randn(*shape, std=0.5)
            elif name.endswith("conv1d.bias"):
                t[name] = randn(*shape, std=0.1)
            elif name.endswith("dt_bias"):
                u = torch.rand(shape, generator=gen, dtype=small, device=where)
                dt = torch.exp(u * (math.log(0.5) - math.log(0.01)) + math.log(0.01))
                t[name] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
            elif name.endswith("A_log"):  # NemotronH [heads], KimiLinear [1, 1, heads, 1]
                heads = math.prod(shape)
                t[name] = torch.log(torch.arange(1, heads + 1, dtype=small, device=where)).reshape(shape)
            elif name.endswith("e_score_correction_bias"):  # a router bias that changes some choices
                t[name] = randn(*shape, std=0.1)
            elif name.endswith(".D"):
                t[name] = near_one(shape[0])
            elif leaf == "lm_head":
                # bigram > 0 leans the head towards "token t is followed by perm(t)": the row of perm(t) is
                # (partly) t's embedding, so a residual stream still close to t's embedding picks perm(t).
                perm = torch.randperm(shape[0], generator=gen, device=where)
                predecessor = torch.empty_like(perm)
                predecessor[perm] = torch.arange(shape[0], device=where)
                head = randn(*shape).add_(bigram * t[args.embeddings_name][predecessor])
                t[name] = head.mul_(2.0 / math.sqrt(shape[1]) / math.sqrt(1.0 + bigram**2))
            elif leaf in ("out_proj", "o_proj", "down_proj"):  # what each block adds to the residual stream
                t[name] = randn(*shape, std=residual_scale / math.sqrt(shape[-1]))
            else:  # projections: fan-in scaled
                t[name] = randn(*shape, std=1.0 / math.sqrt(shape[-1]))
        return cls(args, {k: v.to(_cast_dtype(args, k, dtype)) for k, v in t.items()})

    @classmethod
    def from_checkpoint(cls, directory: str | Path, dtype: torch.dtype | None = None) -> ModelWeights:
        """From a local directory: ``config.json`` plus one or more ``*.safetensors`` files, of the family its
        ``model_type`` names (``nemotron_h``, ``kimi_linear``).

        :raises ~kvferry.errors.ConfigError: when the directory, config or a tensor is missing or malformed.
        """
        path = Path(directory)
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read {path / 'config.json'}: {exc}") from None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"no *.safetensors files in {path}")
        args = args_from_config(config)
        state: dict[str, torch.Tensor] = {}
        for file in files:
            for name, tensor in load_safetensors(file).items():
                # NemotronH checkpoints (and save_pretrained) name the trunk "backbone."; the module is "model."
                state["model." + name.removeprefix("backbone.") if name.startswith("backbone.") else name] = (
                    tensor
                )
        if isinstance(args, KimiLinearArgs):
            state = from_checkpoint_names(state)
        return cls.from_state_dict(args, state, dtype)

    def save_checkpoint(self, directory: str | Path) -> None:
        """Write ``config.json`` and ``model.safetensors`` (what ``from_pretrained`` reads)."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        body = self.args.to_dict()
        body["torch_dtype"] = str(self.dtype).removeprefix("torch.")
        (path / "config.json").write_text(json.dumps(body, indent=2))
        if isinstance(self.args, KimiLinearArgs):
            renamed = to_checkpoint_names(self.args, self.tensors)
        else:
            renamed = {
                ("backbone." + k.removeprefix("model.")) if k.startswith("model.") else k: v
                for k, v in self.tensors.items()
            }
        save_safetensors(path / "model.safetensors", renamed)


# --- safetensors ---------------------------------------------------------------------------------------------

_ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def load_safetensors(file: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of one ``.safetensors`` file (the format: u64 header size, JSON header, raw bytes)."""
    data = Path(file).read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        body = memoryview(data)[8 + size :]
        out: dict[str, torch.Tensor] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            dtype = _ST_DTYPES[info["dtype"]]
            shape = [int(s) for s in info["shape"]]
            if not 0 <= begin <= end <= len(body):
                raise ValueError(f"{name}: data offsets out of range")
            raw = torch.frombuffer(bytearray(body[begin:end]), dtype=torch.uint8)
            out[name] = raw.view(dtype).reshape(shape)
        return out
    except (struct.error, KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"{file}: not a valid safetensors file ({exc})") from None


def save_safetensors(file: str | Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write tensors in the safetensors format (little-endian, contiguous, sorted by name)."""
    names = {v: k for k, v in _ST_DTYPES.items()}
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        blob = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {
            "dtype": names[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        blobs.append(blob)
        offset += len(blob)
    raw_header = json.dumps(header, separators=(",", ":")).encode()
    raw_header += b" " * (-len(raw_header) % 8)
    Path(file).write_bytes(struct.pack("<Q", len(raw_header)) + raw_header + b"".join(blobs))


# --- the transformers twin (test oracle) -------------------------------------------------------------------


def hf_model(weights: ModelWeights, *, share: bool = False) -> Any:
    """A transformers ``NemotronHForCausalLM`` / ``KimiLinearForCausalLM`` holding exactly ``weights`` (in their
    dtype), in eval mode. KimiLinear runs transformers' eager attention and eager experts (the forms that
    compute in float64 on the CPU).

    :param share: the model's parameters are ``weights``' own tensors, on their device (the model is built
        on the meta device: no copy and no initialisation of a large model); else it holds CPU copies.
    """
    transformers = _transformers()
    config = _hf_config(weights.args)
    if isinstance(weights.args, KimiLinearArgs):
        config._attn_implementation = "eager"
        config._experts_implementation = "eager"
        model_class = transformers.KimiLinearForCausalLM
    else:
        model_class = transformers.NemotronHForCausalLM
    if share:
        with torch.device("meta"):
            model = model_class(config).to(weights.dtype).eval()
    else:
        model = model_class(config).to(weights.dtype).eval()
    missing, unexpected = model.load_state_dict(dict(weights.tensors), strict=False, assign=share)
    if share:
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise ConfigError(f"transformers' model keeps tensors that weights do not hold: {left[:5]}")
    if unexpected or [
        m for m in missing if not m.startswith("lm_head") or not weights.args.tie_word_embeddings
    ]:
        raise ConfigError(f"state dict does not fit transformers' model: {missing} {unexpected}")
    return model


class _Float32IsFloat64:
    # Stands in for the torch module inside transformers' NemotronH file: every other name passes through.
    def __init__(self, real: types.ModuleType) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        if name == "float32":
            return torch.float64
        return getattr(self._real, name)


#: transformers' modelling files whose float32 casts :func:`exact_float64` keeps in float64
_FLOAT32_MODULES = ("nemotron_h.modeling_nemotron_h", "kimi_linear.modeling_kimi_linear")


@contextlib.contextmanager
def exact_float64() -> Iterator[None]:
    """Make transformers' NemotronH and KimiLinear compute in float64 end to end while the context is open.

    Their norms, their Mamba2 / KDA scans, KimiLinear's router and their logits cast to float32 internally (``.to(torch.float32)``,
    ``.float()``), which caps agreement near 1e-7 whatever dtype the weights have. Inside this context those
    casts keep float64, so a float64 model is compared with float64 arithmetic. Only for the oracle side of
    tests; not thread-safe (it patches ``torch.Tensor.float`` for the duration).
    """
    modules: list[Any] = [importlib.import_module(f"transformers.models.{m}") for m in _FLOAT32_MODULES]

    real_float = torch.Tensor.float

    def keep_float64(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.dtype == torch.float64:
            return self
        return real_float(self, *args, **kwargs)

    real_torch = [module.torch for module in modules]
    for module, real in zip(modules, real_torch, strict=True):
        module.torch = _Float32IsFloat64(real)
    torch.Tensor.float = keep_float64  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        torch.Tensor.float = real_float  # type: ignore[method-assign]
        for module, real in zip(modules, real_torch, strict=True):
            module.torch = real


def hf_generate(
    model: Any, prompt: Sequence[int], max_new_tokens: int, *, exact: bool = True
) -> tuple[list[int], torch.Tensor]:
    """Greedy ``generate()`` through transformers: the new tokens, and the logits that chose them.

    ``generate()`` hands its logits over in float32, so the returned logits ``[max_new_tokens, vocab]`` come
    from one more forward pass over ``prompt + tokens`` in the model's own dtype (teacher forcing: the same
    numbers a cached decode computes, through transformers' prefill path).

    :param exact: run under :func:`exact_float64` (for float64 weights).
    """
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    context = exact_float64() if exact else contextlib.nullcontext()
    with context, torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 is the pad id: never let it be masked as padding
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        tokens = [int(t) for t in out[0, len(prompt) :].tolist()]
        full = torch.tensor([list(prompt) + tokens[:-1]], dtype=torch.long)
        logits = model(full, logits_to_keep=0).logits[0, len(prompt) - 1 :]
    return tokens, logits
