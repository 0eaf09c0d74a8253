"""The decode path (fused kernels, CUDA graphs per batch bucket) gives the tokens of the reference step.

On the CPU the path runs eagerly with the torch forms of its kernels, in float64, so these tests prove its
logic token for token: packing, padding rows on the reserved slot and page, decode rows split from prefill and
verify rows of the same step, masked replay after speculative verify steps, tensor parallelism, preemption. On
CUDA the same engines run captured graphs; float32 tokens equal the CPU float64 oracle's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from kvferry.engine.runner import EngineOptions, build_engine
from kvferry.errors import ConfigError
from tests.support.triton_modes import INTERPRETED, run_interpreted

CUDA = torch.cuda.is_available() and not INTERPRETED
pytestmark = pytest.mark.anyio


def _prompts(count: int, *, vocab: int = 200) -> list[list[int]]:
    return [[(7 * i + 3 * j) % (vocab - 1) + 1 for j in range(4 + 5 * i % 23)] for i in range(count)]


async def _serve(
    options: EngineOptions,
    prompts: list[list[int]],
    *,
    spec_k: int = 0,
    triton: bool = False,
    model: str | Path = "tiny",
) -> tuple[list[list[int]], Any]:
    built = build_engine(model, options)
    if triton:  # the Triton kernels on the CPU (in the interpreter), eagerly
        built.runner.model.enable_decode_graphs(options.max_running, capture=False, use_triton=True)
    out: dict[int, list[int]] = {}
    async with built.engine as engine:

        async def one(i: int, prompt: list[int]) -> None:
            await anyio.sleep(0.002 * (i % 5))  # arrivals spread over steps: prefill and decode rows mix
            sampling: dict[str, Any] = {"seed": 100 + i, "temperature": 0.9} if i % 3 == 1 else {}
            k = spec_k if i % 2 == 0 else 0
            out[i] = await engine.generate(prompt, max_tokens=10 + i % 7, spec_k=k, **sampling).collect()

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                for i, prompt in enumerate(prompts):
                    tg.start_soon(one, i, prompt)
    return [out[i] for i in range(len(prompts))], built.runner.model.statistics()


@pytest.mark.parametrize(
    "extra",
    [
        pytest.param({}, id="plain"),
        pytest.param({"max_spec_k": 3}, id="speculative"),
        pytest.param({"tp": 2}, id="tp2"),
        pytest.param({"num_pages": 24, "max_running": 8}, id="preemption"),
    ],
)
async def test_decode_path_gives_the_reference_tokens_on_cpu(extra: dict[str, Any]) -> None:
    prompts = _prompts(20)
    spec_k = int(extra.get("max_spec_k", 0))
    reference, _ = await _serve(EngineOptions(dtype="float64", **extra), prompts, spec_k=spec_k)
    fast, stats = await _serve(
        EngineOptions(dtype="float64", decode_graphs=True, **extra), prompts, spec_k=spec_k
    )
    assert fast == reference
    decode = stats["decode_graphs"]
    assert decode["eager_steps"] > 0 and decode["rows"] > 0
    assert decode["padded_rows"] > 0  # batches between buckets ran padded
    assert decode["captured"] == []  # no CUDA graphs on the CPU


async def test_inputs_widen_for_longer_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvferry.model import decode_graph

    monkeypatch.setattr(decode_graph, "INITIAL_TABLE_BLOCKS", 2)  # 8 tokens of tiny's 4-token pages
    prompts = _prompts(8)
    reference, _ = await _serve(EngineOptions(dtype="float64"), prompts)
    fast, stats = await _serve(EngineOptions(dtype="float64", decode_graphs=True), prompts)
    assert fast == reference
    decode = stats["decode_graphs"]
    assert decode["widened"] >= 2 and decode["table_blocks"] > 2


def test_decode_buckets() -> None:
    from kvferry.model.decode_graph import decode_buckets

    assert decode_buckets(1) == (1,)
    assert decode_buckets(16) == (1, 2, 4, 8, 16)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 32)
    assert decode_buckets(100) == (1, 2, 4, 8, 16, 32, 64, 96, 128)


def test_the_reference_path_stays_the_default_on_cpu() -> None:
    built = build_engine("tiny", EngineOptions(dtype="float64"))
    assert built.runner.model.decode_graphs is None


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("extra", [{}, {"max_spec_k": 3}, {"tp": 2}], ids=["plain", "speculative", "tp2"])
async def test_cuda_graph_tokens_equal_the_cpu_float64_oracle(extra: dict[str, Any]) -> None:
    prompts = _prompts(20)
    spec_k = int(extra.get("max_spec_k", 0))
    oracle, _ = await _serve(EngineOptions(dtype="float64", **extra), prompts, spec_k=spec_k)
    cuda, stats = await _serve(EngineOptions(device="cuda", dtype="float32", **extra), prompts, spec_k=spec_k)
    assert cuda == oracle
    decode = stats["decode_graphs"]
    assert decode["captured"] and decode["replays"] > 0 and decode["eager_steps"] == 0


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
async def test_a_saved_checkpoint_on_cuda_gives_the_cpu_float64_tokens(tmp_path: Path) -> None:
    from kvferry.model.weights import ModelWeights, tiny_args
    from kvferry.pools.spec import preset

    # another seed than the tiny preset's, through the checkpoint loader
    ModelWeights.seeded(tiny_args(preset("tiny")), 11).save_checkpoint(tmp_path)
    prompts = _prompts(10)
    oracle, _ = await _serve(EngineOptions(dtype="float64"), prompts, model=tmp_path)
    cuda, stats = await _serve(EngineOptions(device="cuda", dtype="float32"), prompts, model=tmp_path)
    assert cuda == oracle and stats["decode_graphs"]["replays"] > 0


def test_a_float64_model_resolves_to_the_torch_kernels() -> None:
    model = build_engine("tiny", EngineOptions(dtype="float64")).runner.model
    model.enable_decode_graphs(4, capture=False)
    assert model.decode_graphs is not None and model.decode_graphs.use_triton is False


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
async def test_a_float64_model_on_cuda_runs_the_graphs_with_the_torch_kernels() -> None:
    # the demo's default: float64 on the GPU (the Triton kernels would mix float32 and float64)
    prompts = _prompts(10)
    oracle, _ = await _serve(EngineOptions(dtype="float64"), prompts)
    cuda, stats = await _serve(EngineOptions(device="cuda", dtype="float64"), prompts)
    assert cuda == oracle and stats["decode_graphs"]["replays"] > 0
    model = build_engine("tiny", EngineOptions(device="cuda", dtype="float64")).runner.model
    with pytest.raises(ConfigError, match="float64 model runs their torch forms"):
        model.enable_decode_graphs(4, use_triton=True)


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
async def test_cuda_graphs_off_gives_the_same_tokens() -> None:
    prompts = _prompts(12)
    on, _ = await _serve(EngineOptions(device="cuda", dtype="float32"), prompts)
    off, stats = await _serve(EngineOptions(device="cuda", dtype="float32", decode_graphs=False), prompts)
    assert on == off and stats["decode_graphs"] is None


@pytest.mark.timeout(400)
def test_the_triton_decode_path_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreted process")
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_interpreted_triton_kernels_give_the_reference_tokens() -> None:
    # The Triton kernels of the decode path, run by Triton's interpreter on the CPU, inside the engine, with
    # speculation (decode rows after verify steps replay on the device) and plain decode rows side by side.
    prompts = _prompts(3)
    extra: dict[str, Any] = {"dtype": "float64", "max_running": 4, "max_spec_k": 2}
    reference, _ = await _serve(EngineOptions(**extra), prompts, spec_k=2)
    fast, stats = await _serve(EngineOptions(decode_graphs=False, **extra), prompts, spec_k=2, triton=True)
    assert fast == reference
    assert stats["decode_graphs"]["rows"] > 0


#: bfloat16 logits of the tiny model stay within this fraction of the float32 logits' range (greedy decode of the
#: same tokens through the decode graphs, every step compared)
BF16_LOGIT_TOLERANCE = 0.05


def _logits_of(dtype: str, feed: list[int] | None) -> tuple[torch.Tensor, list[int]]:
    # a prompt's prefill and 12 decode steps through the decode graphs; the tokens fed are ``feed`` (None: greedy)
    from kvferry.model.nemotron_h import SequenceInput

    model = build_engine("tiny", EngineOptions(device="cuda", dtype=dtype, max_running=4)).runner.model
    prompt, table = _prompts(6)[5], tuple(range(1, 17))
    steps = [model.step([SequenceInput(prompt, 0, table, 1)]).logits[0]]
    tokens = [int(steps[0].argmax())]
    for i in range(12):
        token = tokens[i] if feed is None else feed[i]
        steps.append(model.step([SequenceInput([token], len(prompt) + i, table, 1)]).logits[0])
        tokens.append(int(steps[-1].argmax()))
    assert model.decode_graphs is not None and model.decode_graphs.statistics()["replays"] == 12
    return torch.cat(steps).float(), tokens


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_bfloat16_logits_stay_near_float32_on_cuda() -> None:
    reference, tokens = _logits_of("float32", None)
    bf16, _ = _logits_of("bfloat16", tokens)
    error = float((bf16 - reference).abs().max())
    scale = float(reference.max() - reference.min())
    print(f"bfloat16 logits: max error {error:.4f} of a range {scale:.4f} ({error / scale:.4f})")
    assert error <= BF16_LOGIT_TOLERANCE * scale, (error, scale)
