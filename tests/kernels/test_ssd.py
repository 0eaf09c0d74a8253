"""Mamba2's chunked scan through flash-linear-attention's ``chunk_simple_gla``: the mapping (q = C, k = B,
v = dt * x, g = dt * A, value-first state) checked on the CPU through a stand-in made of fla's documented
recurrence, and fla's real kernel against kvferry's torch form on CUDA."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.kernels import ssd
from kvferry.model.mamba2 import ssm_chunk_scan

HEADS, HEAD_DIM, STATE, GROUPS = 4, 16, 16, 2
DT_MIN = 1e-4


def _inputs(
    batch: int, length: int, dtype: torch.dtype, device: str, head_dim: int = HEAD_DIM
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(batch * 100 + length)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(
            device=device, dtype=dtype
        )

    return {
        "x": rand(batch, length, HEADS, head_dim),
        "dt": rand(batch, length, HEADS, scale=0.5),
        "A": -torch.rand(HEADS, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype) - 0.2,
        "B": rand(batch, length, GROUPS, STATE, scale=0.3),
        "C": rand(batch, length, GROUPS, STATE, scale=0.3),
        "D": rand(HEADS),
        "dt_bias": rand(HEADS, scale=0.1),
    }


def _scan(
    inputs: dict[str, torch.Tensor], pool: torch.Tensor, slots: torch.Tensor, **kw: object
) -> torch.Tensor:
    return ssm_chunk_scan(
        inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], inputs["D"], inputs["dt_bias"],
        pool, slots, dt_min=DT_MIN, chunk_size=8, **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def _reference_gla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor,
    output_final_state: bool,
    state_v_first: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's ``chunk_simple_gla`` as its docstring defines it, token by token in float64: ``S = exp(g) S +
    k (outer) v`` (``[K, V]``, or ``[V, K]`` value-first), ``o = scale * q . S``; checks what kvferry hands it."""
    assert state_v_first and initial_state.dtype == torch.float32 and g.dtype == torch.float32
    assert all(t.is_contiguous() for t in (q, k, v, g, initial_state))
    assert q.shape == k.shape and q.shape[:3] == v.shape[:3] and g.shape == q.shape[:3]
    state = initial_state.double().transpose(-1, -2)  # [N, H, K, V]
    outs = []
    for t in range(q.shape[1]):
        state = (
            state * g[:, t].double().exp()[..., None, None]
            + k[:, t].double()[..., None] * v[:, t].double()[..., None, :]
        )
        outs.append(scale * (q[:, t].double()[..., None] * state).sum(dim=-2))
    o = torch.stack(outs, dim=1).to(v.dtype)
    return o, state.transpose(-1, -2).float() if output_final_state else None


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    ops = types.ModuleType("fla.ops.simple_gla")
    ops.chunk_simple_gla = _reference_gla  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.simple_gla", ops)
    monkeypatch.setattr(ssd, "fla_runs", lambda ops, device: True)


@pytest.mark.parametrize("length", [1, 7, 30])
@pytest.mark.parametrize("commit", [True, False])
def test_the_mapping_onto_gated_linear_attention_equals_the_torch_form(
    stand_in: None, length: int, commit: bool
) -> None:
    inputs = _inputs(3, length, torch.float32, "cpu")
    pool = torch.randn(5, HEADS, HEAD_DIM, STATE) * 0.1
    ref_pool = pool.clone()
    slots = torch.tensor([4, 0, 2])
    y = _scan(inputs, pool, slots, commit=commit, use_fla=True)
    ref = _scan(inputs, ref_pool, slots, commit=commit, use_fla=False)
    assert y.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pool, ref_pool, rtol=1e-4, atol=1e-4)
    for s in (1, 3):
        assert torch.equal(pool[s], ref_pool[s])
    if not commit:
        assert torch.equal(pool, ref_pool)


def test_fla_is_chosen_only_where_it_runs(stand_in: None) -> None:
    assert ssd.fla_ssd_runs(torch.device("cpu"), torch.float32, HEAD_DIM, STATE)
    assert not ssd.fla_ssd_runs(torch.device("cpu"), torch.float64, HEAD_DIM, STATE)  # the oracle's dtype
    assert not ssd.fla_ssd_runs(torch.device("cpu"), torch.float32, 8, STATE)  # under fla's tiles
    # float64 and narrow heads take the torch form by default, and refuse fla when asked for it
    inputs = _inputs(2, 5, torch.float64, "cpu")
    pool = torch.zeros(3, HEADS, HEAD_DIM, STATE, dtype=torch.float64)
    before = pool.clone()
    with pytest.raises(ConfigError, match="does not run"):
        _scan(inputs, pool, torch.tensor([0, 2]), use_fla=True)
    assert torch.equal(pool, before)
    _scan(inputs, pool, torch.tensor([0, 2]))
    assert not torch.equal(pool, before)


def test_without_fla_nothing_changes_on_the_cpu() -> None:
    assert not ssd.fla_ssd_runs(torch.device("cpu"), torch.float32, HEAD_DIM, STATE)
    inputs = _inputs(1, 4, torch.float32, "cpu")
    with pytest.raises(ConfigError, match="does not run"):
        _scan(inputs, torch.zeros(2, HEADS, HEAD_DIM, STATE), torch.tensor([1]), use_fla=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 9, 150, 700])
def test_fla_equals_the_torch_form_on_cuda(dtype: torch.dtype, length: int) -> None:
    if not ssd.fla_ssd_runs(torch.device("cuda"), dtype, 64, STATE):
        pytest.skip("flash-linear-attention (fla.ops.simple_gla) does not import")
    inputs = _inputs(3, length, dtype, "cuda", head_dim=64)
    pool = (torch.randn(5, HEADS, 64, STATE) * 0.1).to("cuda", dtype)
    ref_pool = pool.clone()
    slots = torch.tensor([4, 0, 2], device="cuda")
    y = _scan(inputs, pool, slots, use_fla=True)
    # the reference in float32: the torch form carries the state in the inputs' dtype
    ref = _scan(
        {k: v.float() for k, v in inputs.items()}, ref_pool32 := ref_pool.float(), slots, use_fla=False
    )
    tol = 5e-2 if dtype == torch.bfloat16 else 2e-3
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(pool.float(), ref_pool32, rtol=tol, atol=tol)
    for s in (1, 3):
        assert torch.equal(pool[s], ref_pool[s])
    before = pool.clone()
    _scan(inputs, pool, slots, commit=False, use_fla=True)
    assert torch.equal(pool, before)
