"""The fused norms of the decode step against the reference model's arithmetic.

The torch forms run everywhere, the Triton kernels compiled on CUDA and in Triton's interpreter on the CPU
(:mod:`tests.support.triton_modes`).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.kernels.norms import add_rms_norm, gated_group_norm, rms_norm
from tests.support.triton_modes import MODES, run_interpreted


def test_the_triton_kernels_interpreted() -> None:
    run_interpreted(__file__)


def _device(mode: str) -> torch.device:
    if mode != "torch":
        pytest.importorskip("triton")
    return torch.device("cuda" if mode == "cuda" else "cpu")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(mode: str, with_delta: bool) -> None:
    dev = _device(mode)
    gen = torch.Generator().manual_seed(4)
    x, delta = (torch.randn(5, 48, generator=gen).to(dev) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(48, generator=gen)).to(dev)
    total, normed = add_rms_norm(x, delta if with_delta else None, weight, 1e-5, use_triton=mode != "torch")
    expected = x + delta if with_delta else x
    torch.testing.assert_close(total, expected, rtol=0, atol=0)
    torch.testing.assert_close(normed, rms_norm(expected, weight, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_gated_group_norm(mode: str) -> None:
    dev = _device(mode)
    gen = torch.Generator().manual_seed(5)
    rows, width, group = 3, 96, 24
    y = torch.randn(rows, width, generator=gen).to(dev)
    proj = torch.randn(rows, width + 7, generator=gen).to(dev)
    z = proj[:, 3 : 3 + width]  # strided rows, as the in_proj split leaves them
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dev)
    gate = y * F.silu(z)
    groups = gate.view(rows, -1, group)
    expected = weight * (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + 1e-5)).view(rows, width)
    out = gated_group_norm(y, z, weight, group, 1e-5, use_triton=mode != "torch")
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
