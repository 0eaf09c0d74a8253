"""The fused Mamba2 decode kernels against the reference model's kernels (``causal_conv1d``, ``ssm_step``).

The torch forms run everywhere, the Triton kernels compiled on CUDA and in Triton's interpreter on the CPU
(:mod:`tests.support.triton_modes`).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvferry.kernels import mamba_decode
from kvferry.model.mamba2 import causal_conv1d, ssm_step
from tests.support.triton_modes import CUDA, MODES, run_interpreted


def test_the_triton_kernels_interpreted() -> None:
    run_interpreted(__file__)


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param != "torch":
        pytest.importorskip("triton")
    _clear()
    yield request.param
    _clear()


def _clear() -> None:
    try:
        from kvferry.kernels import decode_triton
    except ImportError:
        return
    decode_triton.conv_kernel.cache_clear()
    decode_triton.ssm_kernel.cache_clear()


def _device(mode: str) -> torch.device:
    return torch.device("cuda" if mode == "cuda" else "cpu")


def _use_triton(mode: str) -> bool:
    return mode != "torch"


@pytest.mark.parametrize("bias", [True, False])
def test_conv_update_matches_the_reference_conv(mode: str, bias: bool) -> None:
    dev = _device(mode)
    gen = torch.Generator().manual_seed(1)
    slots_n, channels, kernel = 7, 40, 4
    states = torch.randn(slots_n, channels, kernel - 1, generator=gen, dtype=torch.float32).to(dev)
    weight = torch.randn(channels, kernel, generator=gen).to(dev)
    b = torch.randn(channels, generator=gen).to(dev) if bias else None
    # rows strided as the in_proj split leaves them
    proj = torch.randn(3, channels + 5, generator=gen).to(dev)
    x = proj[:, 2 : 2 + channels]
    slots = torch.tensor([[5, 0], [1, 0], [3, 0]], device=dev)[:, 0]  # strided, as a packed buffer gives them

    expected_states = states.clone()
    expected = causal_conv1d(x[:, None, :], expected_states, slots, weight, b)[:, 0]
    out = mamba_decode.conv_update(x, states, slots, weight, b, use_triton=_use_triton(mode))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states, rtol=0, atol=0)


def _ssm_inputs(
    dev: torch.device, heads: int = 6, groups: int = 2, head_dim: int = 12, state: int = 20
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    batch, slots_n = 3, 5
    proj = torch.randn(batch, heads * head_dim + 2 * groups * state + heads + 3, generator=gen)
    x = proj[:, : heads * head_dim].reshape(batch, heads, head_dim)
    B = proj[:, heads * head_dim : heads * head_dim + groups * state].reshape(batch, groups, state)
    C = proj[:, heads * head_dim + groups * state : heads * head_dim + 2 * groups * state]
    C = C.reshape(batch, groups, state)
    dt = proj[:, heads * head_dim + 2 * groups * state : heads * head_dim + 2 * groups * state + heads]
    A = -torch.rand(heads, generator=gen) * 2 - 0.1
    D = torch.randn(heads, generator=gen)
    dt_bias = torch.randn(heads, generator=gen)
    dt[0, 0] = 30.0  # past softplus's threshold
    states = torch.randn(slots_n, heads, head_dim, state, generator=gen)
    slots = torch.tensor([[4, 9], [0, 9], [2, 9]])[:, 0]  # strided, as a packed buffer gives them
    return [t.to(dev) for t in (x, dt, A, B, C, D, dt_bias, states, slots)]


def test_ssm_update_matches_the_reference_step(mode: str) -> None:
    x, dt, A, B, C, D, dt_bias, states, slots = _ssm_inputs(_device(mode))
    expected_states = states.clone()
    expected = ssm_step(
        x[:, None], dt[:, None], A, B[:, None], C[:, None], D, dt_bias, expected_states, slots, dt_min=1e-3
    )[:, 0]
    y = mamba_decode.ssm_update(
        x, dt, A, B, C, D, dt_bias, states, slots, dt_min=1e-3, use_triton=_use_triton(mode)
    )
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states, rtol=1e-5, atol=1e-5)


def test_ssm_update_leaves_other_slots_alone(mode: str) -> None:
    x, dt, A, B, C, D, dt_bias, states, slots = _ssm_inputs(_device(mode), head_dim=64, state=128)
    before = states.clone()
    mamba_decode.ssm_update(
        x, dt, A, B, C, D, dt_bias, states, slots, dt_min=1e-3, use_triton=_use_triton(mode)
    )
    untouched = [s for s in range(states.shape[0]) if s not in slots.tolist()]
    assert torch.equal(states[untouched], before[untouched])
    assert not torch.equal(states[slots], before[slots])


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_bfloat16_inputs_with_float32_state_on_cuda() -> None:
    pytest.importorskip("triton")
    x, dt, A, B, C, D, dt_bias, states, slots = _ssm_inputs(torch.device("cuda"), head_dim=64, state=128)
    reference_states = states.clone()
    expected = mamba_decode.ssm_update_torch(
        x.double(), dt.double(), A.double(), B.double(), C.double(), D.double(), dt_bias.double(),
        reference_states.double(), slots, dt_min=1e-3,
    )  # fmt: skip
    y = mamba_decode.ssm_update(
        x.bfloat16(), dt.bfloat16(), A, B.bfloat16(), C.bfloat16(), D, dt_bias, states, slots, dt_min=1e-3
    )
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), expected, rtol=5e-2, atol=5e-2)
