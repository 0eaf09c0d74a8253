"""RMS norms of a decode step as single kernels (Triton), with their torch forms.

- :func:`add_rms_norm`: the residual add of one block and the RMSNorm in front of the next, in one pass.
- :func:`gated_group_norm`: Mamba2's gated RMSNorm (``y * silu(z)``, normalised over groups of channels).

Both compute in float32 and allocate only their outputs (a CUDA graph can hold them). The torch forms are the
reference model's arithmetic (``weight * (x * rsqrt(mean(x^2) + eps))``). Kernels import nothing from the rest
of kvferry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvferry.kernels.mamba_decode import next_power_of_2, triton_available

__all__ = ["add_rms_norm", "gated_group_norm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension (the reference form)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + delta, rms_norm(x + delta))`` for ``[rows, width]`` contiguous tensors (``delta`` None: no add,
    and ``x`` itself is returned as the sum)."""
    if use_triton is None:
        use_triton = triton_available(x.device)
    if not use_triton:
        total = x if delta is None else x + delta
        return total, rms_norm(total, weight, eps)
    if not x.is_contiguous() or (delta is not None and not delta.is_contiguous()):
        raise ValueError("add_rms_norm needs contiguous rows")
    from kvferry.kernels import decode_triton

    rows, width = x.shape
    total = x if delta is None else torch.empty_like(x)
    normed = torch.empty_like(x)
    decode_triton.add_rms_norm_kernel()[(rows,)](
        x,
        delta if delta is not None else x,
        weight,
        total,
        normed,
        width,
        float(eps),
        HAS_DELTA=delta is not None,
        BLOCK=next_power_of_2(width),
    )
    return total, normed


def gated_group_norm(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    group_size: int,
    eps: float,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """``weight * g / rms(g)`` with ``g = y * silu(z)``, the rms over each group of ``group_size`` consecutive
    channels. ``y`` ``[rows, width]`` contiguous; ``z`` alike, rows may be strided."""
    if use_triton is None:
        use_triton = triton_available(y.device)
    rows, width = y.shape
    if not use_triton:
        gate = (y * F.silu(z)).view(rows, width // group_size, group_size)
        normed = gate * torch.rsqrt(gate.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.view(rows, width)
    if not y.is_contiguous() or z.stride(1) != 1 or width % group_size:
        raise ValueError("gated_group_norm needs contiguous channels and whole groups")
    from kvferry.kernels import decode_triton

    out = torch.empty_like(y)
    decode_triton.gated_group_norm_kernel()[(rows, width // group_size)](
        y, z, z.stride(0), weight, out, width, group_size, float(eps), BLOCK=next_power_of_2(group_size)
    )
    return out
