"""The reference models run through kvferry's pools, NemotronH and KimiLinear: weights, drafter, tokenizer,
tensor parallelism, and the attention, Mamba2, KDA, MLA and MoE maths.

Import direction: batch / attention / mamba2 -> kimi_args -> weights -> tensor_parallel -> nemotron_h -> mla /
moe / kda -> kimi_linear -> family -> drafter; weights -> presets; device and tokenizer stand alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvferry._lazy import lazy_exports

if TYPE_CHECKING:
    from kvferry.model.device import resolve_device as resolve_device
    from kvferry.model.drafter import Drafter as Drafter
    from kvferry.model.drafter import DrafterWeights as DrafterWeights
    from kvferry.model.drafter import DraftInput as DraftInput
    from kvferry.model.drafter import Proposal as Proposal
    from kvferry.model.family import PagedModel as PagedModel
    from kvferry.model.family import build_model as build_model
    from kvferry.model.kimi_args import KimiLinearArgs as KimiLinearArgs
    from kvferry.model.kimi_args import tiny_kimi_args as tiny_kimi_args
    from kvferry.model.kimi_linear import KimiLinearModel as KimiLinearModel
    from kvferry.model.nemotron_h import Model as Model
    from kvferry.model.nemotron_h import SequenceInput as SequenceInput
    from kvferry.model.nemotron_h import StepOutput as StepOutput
    from kvferry.model.presets import load_preset as load_preset
    from kvferry.model.presets import preset_args as preset_args
    from kvferry.model.tensor_parallel import RankWeights as RankWeights
    from kvferry.model.tensor_parallel import shard_weights as shard_weights
    from kvferry.model.tokenizer import ByteTokenizer as ByteTokenizer
    from kvferry.model.tokenizer import HfTokenizer as HfTokenizer
    from kvferry.model.tokenizer import Tokenizer as Tokenizer
    from kvferry.model.tokenizer import load_tokenizer as load_tokenizer
    from kvferry.model.weights import ModelWeights as ModelWeights
    from kvferry.model.weights import NemotronHArgs as NemotronHArgs
    from kvferry.model.weights import tiny_args as tiny_args

#: public name -> module that defines it
_LAZY: dict[str, str] = {
    "Model": "kvferry.model.nemotron_h",
    "KimiLinearModel": "kvferry.model.kimi_linear",
    "KimiLinearArgs": "kvferry.model.kimi_args",
    "tiny_kimi_args": "kvferry.model.kimi_args",
    "PagedModel": "kvferry.model.family",
    "build_model": "kvferry.model.family",
    "SequenceInput": "kvferry.model.nemotron_h",
    "StepOutput": "kvferry.model.nemotron_h",
    "ModelWeights": "kvferry.model.weights",
    "NemotronHArgs": "kvferry.model.weights",
    "tiny_args": "kvferry.model.weights",
    "DraftInput": "kvferry.model.drafter",
    "Drafter": "kvferry.model.drafter",
    "DrafterWeights": "kvferry.model.drafter",
    "Proposal": "kvferry.model.drafter",
    "load_preset": "kvferry.model.presets",
    "preset_args": "kvferry.model.presets",
    "resolve_device": "kvferry.model.device",
    "RankWeights": "kvferry.model.tensor_parallel",
    "shard_weights": "kvferry.model.tensor_parallel",
    "ByteTokenizer": "kvferry.model.tokenizer",
    "HfTokenizer": "kvferry.model.tokenizer",
    "Tokenizer": "kvferry.model.tokenizer",
    "load_tokenizer": "kvferry.model.tokenizer",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
