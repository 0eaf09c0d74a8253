"""Fused Mamba2 decode kernels (one token per sequence) in Triton, with the plain torch form beside them.

A decode step of a Mamba2 layer does two things per sequence to the state in its slot: it slides the conv
window by the new token's raw ``[x | B | C]`` inputs and convolves (depthwise, then SiLU), and it advances the
SSM state by one token (``state = state * exp(dt * A) + dt * x (outer) B``, ``y = state . C + D * x``). In
torch these are about twenty small kernels with the state gathered and scattered around them; here each is one
kernel that reads the slot in place, computes in float32 and writes the slot back.

The kernels need no host synchronisation and allocate nothing, so a CUDA graph can hold them. Rows are
independent; a row whose slot is the reserved dummy slot 0 may share it with other such rows (padding of a
captured batch), whose result is then unspecified: only real rows' slots must be distinct.

Kernels import nothing from the rest of kvferry. :func:`conv_update` and :func:`ssm_update` take the Triton
path for CUDA tensors where Triton imports (or under ``TRITON_INTERPRET=1`` when asked with
``use_triton=True``), else the torch form, which is the arithmetic of the reference model.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = [
    "conv_update",
    "conv_update_torch",
    "depthwise",
    "discretize_dt",
    "next_power_of_2",
    "ssm_token",
    "ssm_update",
    "ssm_update_torch",
    "triton_available",
]


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device`` (a CUDA device where Triton imports)."""
    return device.type == "cuda" and _triton_imports()


def next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (a Triton block's extent)."""
    return 1 << max(0, (n - 1).bit_length())


# --- the per-token arithmetic, shared with the reference model (kvferry.model.mamba2) ----------------------


def depthwise(full: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Valid depthwise conv of ``full`` ``[batch, channels, length]`` with ``weight`` ``[channels, kernel]``."""
    # A windowed product: F.conv1d builds a oneDNN primitive for every new input shape, which costs far more
    # than the conv itself, and decode batches come in every shape.
    out = (full.unfold(-1, weight.shape[-1], 1) * weight[None, :, None, :]).sum(-1)
    return out if bias is None else out + bias[None, :, None]


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor, dt_min: float) -> torch.Tensor:
    """``max(softplus(dt + dt_bias), dt_min)``: the step size of each token and head."""
    return torch.clamp(F.softplus(dt + dt_bias), min=dt_min)


def ssm_token(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for a batch: ``state`` ``[b,h,p,n]``, ``x`` ``[b,h,p]``, ``dt`` ``[b,h]`` (discretized),
    ``B``/``C`` ``[b,h,n]`` (per head); returns the new state and ``y`` (D skip included). Decode, verify and
    replay all go through it: replaying a token does what decoding it did."""
    dA = torch.exp(dt * A)
    new_state = state * dA[:, :, None, None] + (dt[:, :, None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", new_state, C) + D[:, None] * x
    return new_state, y


# --- the conv window ----------------------------------------------------------------------------------------


def conv_update_torch(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """The torch form of :func:`conv_update` (the reference model's arithmetic, in ``x``'s dtype)."""
    width = conv_states.shape[-1]
    window = conv_states[slots].to(x.dtype)
    full = torch.cat((window, x[:, :, None]), dim=-1)  # [batch, channels, width + 1]
    out = depthwise(full, weight.to(x.dtype), bias)[:, :, 0]
    conv_states.index_copy_(0, slots, full[:, :, 1 : width + 1].to(conv_states.dtype))
    return F.silu(out)


def conv_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Slide each slot's conv window by one token and return the token's depthwise conv + SiLU.

    :param x: ``[batch, channels]`` raw inputs (rows may be strided, channels contiguous).
    :param conv_states: ``[num_slots, channels, kernel - 1]`` pool view (window contiguous per channel).
    :param slots: ``[batch]`` int slot of each row; :param weight: ``[channels, kernel]``; ``bias`` or None.
    :param use_triton: None: Triton where :func:`triton_available`; True/False forces the choice.
    :return: ``[batch, channels]`` in ``x``'s dtype. The window is written back in place.
    """
    if use_triton is None:
        use_triton = triton_available(x.device)
    if not use_triton:
        return conv_update_torch(x, conv_states, slots, weight, bias)
    batch, channels = x.shape
    width = conv_states.shape[-1]
    if x.stride(1) != 1 or conv_states.stride(2) != 1 or not weight.is_contiguous():
        raise ValueError("conv_update needs contiguous channels, windows and weight")
    from kvferry.kernels import decode_triton

    slots = slots.contiguous()  # the kernel reads slot i at slots_ptr + i
    out = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    block = min(256, next_power_of_2(channels))
    grid = (batch, -(-channels // block))
    decode_triton.conv_kernel()[grid](
        x,
        x.stride(0),
        conv_states,
        conv_states.stride(0),
        conv_states.stride(1),
        slots,
        weight,
        bias if bias is not None else weight,
        out,
        out.stride(0),
        channels,
        WIDTH=width,
        HAS_BIAS=bias is not None,
        BLOCK=block,
    )
    return out


# --- the SSM state ------------------------------------------------------------------------------------------


def ssm_update_torch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    *,
    dt_min: float,
) -> torch.Tensor:
    """The torch form of :func:`ssm_update` (the reference model's arithmetic, in ``x``'s dtype)."""
    per_group = x.shape[1] // B.shape[1]
    state, y = ssm_token(
        ssm_states[slots].to(x.dtype),
        x,
        discretize_dt(dt, dt_bias, dt_min),
        A,
        B.repeat_interleave(per_group, dim=1),
        C.repeat_interleave(per_group, dim=1),
        D,
    )
    ssm_states.index_copy_(0, slots, state.to(ssm_states.dtype))
    return y


def ssm_update(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    *,
    dt_min: float,
    use_triton: bool | None = None,
) -> torch.Tensor:
    """Advance each slot's SSM state by one token; return the token's output (D skip included, no gate).

    :param x: ``[batch, heads, head_dim]``; ``dt`` ``[batch, heads]`` raw (before bias and softplus);
        ``B``/``C`` ``[batch, groups, state_size]``; ``A`` (negative), ``D``, ``dt_bias`` ``[heads]``. Rows may
        be strided; within a row everything is contiguous.
    :param ssm_states: ``[num_slots, heads, head_dim, state_size]`` pool view (each slot contiguous).
    :param use_triton: None: Triton where :func:`triton_available`; True/False forces the choice.
    :return: ``y`` ``[batch, heads, head_dim]`` in ``x``'s dtype; the state is written back in place.
    """
    if use_triton is None:
        use_triton = triton_available(x.device)
    if not use_triton:
        return ssm_update_torch(x, dt, A, B, C, D, dt_bias, ssm_states, slots, dt_min=dt_min)
    batch, heads, head_dim = x.shape
    groups, state_size = B.shape[1], B.shape[2]
    contiguous_rows = (
        all(t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] for t in (x, B, C)) and dt.stride(1) == 1
    )
    if not contiguous_rows or not ssm_states[0].is_contiguous():
        raise ValueError("ssm_update needs rows contiguous within and each slot's state contiguous")
    from kvferry.kernels import decode_triton

    slots = slots.contiguous()  # the kernel reads slot i at slots_ptr + i
    y = torch.empty(batch, heads, head_dim, dtype=x.dtype, device=x.device)
    block_n = next_power_of_2(state_size)
    block_p = min(next_power_of_2(head_dim), max(1, 4096 // block_n))
    grid = (batch, heads, -(-head_dim // block_p))
    decode_triton.ssm_kernel()[grid](
        x,
        x.stride(0),
        dt,
        dt.stride(0),
        A,
        B,
        B.stride(0),
        C,
        C.stride(0),
        D,
        dt_bias,
        ssm_states,
        ssm_states.stride(0),
        slots,
        y,
        y.stride(0),
        float(dt_min),
        head_dim,
        state_size,
        heads // groups,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
    )
    return y
