"""Mamba2 kernels over slot-first state pools, in plain torch (device-agnostic).

State of one sequence lives in one *slot*: per layer a conv window ``conv_states[slot]`` ``[conv_dim,
conv_kernel - 1]`` (channel-major, sections ``[x | B | C]``) holding the raw pre-conv inputs of the last
``conv_kernel - 1`` tokens, and an SSM matrix ``ssm_states[slot]`` ``[heads, head_dim, state_size]``. Kernels
read the slots named by ``slots`` and, when ``commit`` is true, write the advanced state back in place. With
``commit=False`` (speculative verify) the slots are left exactly as they were.

The discretisation follows Mamba2: ``dt = max(softplus(dt_raw + dt_bias), dt_min)``, ``dA = exp(dt * A)``,
``state = state * dA + dt * x (outer) B``, ``y = state . C + D * x``, B and C shared by the heads of a group
(head ``h`` uses group ``h // (heads // groups)``).

:func:`mamba2_replay` advances slots by the accepted tokens of the last verify step from the raw per-token
inputs stored in the replay buffer, through exactly the per-token arithmetic a plain decode step uses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvferry.errors import ConfigError
from kvferry.kernels.mamba_decode import depthwise, discretize_dt, ssm_token
from kvferry.kernels.ssd import fla_ssd, fla_ssd_runs

__all__ = [
    "causal_conv1d",
    "discretize_dt",
    "mamba2_replay",
    "mamba2_replay_steps",
    "ssm_chunk_scan",
    "ssm_step",
]


def _check_unique(slots: torch.Tensor) -> None:
    if slots.numel() != torch.unique(slots).numel():
        raise ConfigError("a batch names the same state slot twice")


def causal_conv1d(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    *,
    commit: bool = True,
) -> torch.Tensor:
    """Depthwise causal conv + SiLU of new tokens, continuing from each slot's conv window.

    :param x: ``[batch, length, channels]`` raw inputs (``length`` >= 1: a prefill chunk, one decode token or
        the k+1 tokens of a verify step).
    :param conv_states: ``[num_slots, channels, kernel - 1]`` pool view.
    :param slots: ``[batch]`` int64 slot of each sequence (distinct).
    :param weight: ``[channels, kernel]``; ``bias`` ``[channels]`` or None.
    :param commit: write the window of the last ``kernel - 1`` inputs back into the slots.
    :return: ``[batch, length, channels]`` activations.
    """
    _check_unique(slots)
    width = conv_states.shape[-1]
    window = conv_states[slots].to(x.dtype)  # gather: a copy
    full = torch.cat((window, x.transpose(1, 2)), dim=-1)  # [batch, channels, width + length]
    out = depthwise(full, weight.to(x.dtype), bias)  # [batch, channels, length]
    if commit:
        conv_states.index_copy_(0, slots, full[:, :, full.shape[-1] - width :].to(conv_states.dtype))
    return F.silu(out).transpose(1, 2)


def _expand_groups(bc: torch.Tensor, num_heads: int) -> torch.Tensor:
    # [..., groups, n] -> [..., heads, n]
    groups = bc.shape[-2]
    if num_heads % groups:
        raise ConfigError(f"{num_heads} heads are not a multiple of {groups} groups")
    return bc.repeat_interleave(num_heads // groups, dim=-2)


def ssm_step(
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
    commit: bool = True,
) -> torch.Tensor:
    """Token-by-token selective scan (decode and verify), continuing from each slot's state.

    :param x: ``[batch, length, heads, head_dim]``; ``dt`` ``[batch, length, heads]`` raw (before bias and
        softplus); ``B``/``C`` ``[batch, length, groups, state_size]``; ``A``, ``D``, ``dt_bias`` ``[heads]``
        (``A`` negative).
    :param ssm_states: ``[num_slots, heads, head_dim, state_size]`` pool view; ``slots`` ``[batch]``.
    :param commit: write the state after the last token back into the slots.
    :return: ``y`` ``[batch, length, heads, head_dim]`` (D skip included, no gate).
    """
    _check_unique(slots)
    heads = x.shape[2]
    state = ssm_states[slots].to(x.dtype)
    dt_d = discretize_dt(dt, dt_bias, dt_min)
    B_h, C_h = _expand_groups(B, heads), _expand_groups(C, heads)
    ys = []
    for t in range(x.shape[1]):
        state, y = ssm_token(state, x[:, t], dt_d[:, t], A, B_h[:, t], C_h[:, t], D)
        ys.append(y)
    if commit:
        ssm_states.index_copy_(0, slots, state.to(ssm_states.dtype))
    return torch.stack(ys, dim=1)


def ssm_chunk_scan(
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
    chunk_size: int,
    commit: bool = True,
    use_fla: bool | None = None,
) -> torch.Tensor:
    """Chunked selective scan (Mamba2 SSD form) for prefill chunks, continuing from each slot's state.

    Same arguments and result as :func:`ssm_step`; inside each chunk of ``chunk_size`` tokens the scan is a
    masked matrix product, between chunks the state is carried. Equal to :func:`ssm_step` up to rounding.

    :param use_fla: flash-linear-attention's ``chunk_simple_gla`` (:func:`kvferry.kernels.ssd.fla_ssd`, its own
        chunking); None: where :func:`~kvferry.kernels.ssd.fla_ssd_runs` (CUDA, fla installed, not float64).
    :raises ~kvferry.errors.ConfigError: a slot named twice, a chunk size under 1, or ``use_fla`` where fla does
        not run; nothing written.
    """
    _check_unique(slots)
    if chunk_size <= 0:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    length, heads = x.shape[1], x.shape[2]
    runs = fla_ssd_runs(x.device, x.dtype, x.shape[3], B.shape[3])
    if use_fla and not runs:
        raise ConfigError(f"flash-linear-attention's chunked scan does not run here ({x.device}, {x.dtype})")
    dt_d = discretize_dt(dt, dt_bias, dt_min)  # [b,l,h]
    B_h, C_h = _expand_groups(B, heads), _expand_groups(C, heads)
    if runs if use_fla is None else use_fla:
        y, final = fla_ssd(x, dt_d, A, B_h, C_h, D, ssm_states[slots], final=commit)
        if commit:
            assert final is not None
            ssm_states.index_copy_(0, slots, final.to(ssm_states.dtype))
        return y
    state = ssm_states[slots].to(x.dtype)  # [b,h,p,n]
    outputs = []
    for begin in range(0, length, chunk_size):
        end = min(begin + chunk_size, length)
        xc, dtc, Bc, Cc = x[:, begin:end], dt_d[:, begin:end], B_h[:, begin:end], C_h[:, begin:end]
        cum = torch.cumsum(dtc * A, dim=1)  # [b,l,h], non-increasing
        # decay[t, s] = exp(cum[t] - cum[s]) for s <= t, else 0 (masked before exp: no overflow)
        diff = cum[:, :, None, :] - cum[:, None, :, :]  # [b,t,s,h]
        n = end - begin
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp(torch.where(causal[None, :, :, None], diff, -torch.inf))
        scores = torch.einsum("bthn,bshn->btsh", Cc, Bc) * decay
        xdt = xc * dtc[..., None]  # [b,l,h,p]
        y = torch.einsum("btsh,bshp->bthp", scores, xdt)
        y = y + torch.einsum("bthn,bhpn->bthp", Cc, state) * torch.exp(cum)[..., None]
        outputs.append(y + D[:, None] * xc)
        to_end = torch.exp(cum[:, -1:, :] - cum)  # [b,l,h]
        state = state * torch.exp(cum[:, -1, :])[:, :, None, None] + torch.einsum(
            "blhp,blhn->bhpn", xdt * to_end[..., None], Bc
        )
    if commit:
        ssm_states.index_copy_(0, slots, state.to(ssm_states.dtype))
    return torch.cat(outputs, dim=1)


def mamba2_replay(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    replay: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    dt_min: float,
) -> None:
    """Advance each slot's conv window and SSM state by the first ``num_tokens`` tokens of its replay buffer.

    :param replay: ``[num_slots, max_replay_tokens, conv_dim + heads]`` pool view: per token the raw pre-conv
        ``[x | B | C]`` and the raw ``dt`` of the last verify step.
    :param slots: ``[batch]`` int64; :param num_tokens: ``[batch]`` int64 in ``[0, max_replay_tokens]``
        (0 leaves the slot untouched).
    The replay buffer and ``num_accepted`` are not modified (the caller clears ``num_accepted`` once every
    layer has replayed). Each token goes through the same conv and SSM arithmetic as a decode step.
    """
    _check_unique(slots)
    if slots.numel() == 0:
        return
    max_tokens = replay.shape[1]
    if bool(((num_tokens < 0) | (num_tokens > max_tokens)).any()):
        raise ConfigError(f"replay token counts {num_tokens.tolist()} outside [0, {max_tokens}]")
    steps = int(num_tokens.max())
    if steps == 0:
        return
    mamba2_replay_steps(
        conv_states, ssm_states, replay, slots, num_tokens, steps, conv_weight, conv_bias, A, D, dt_bias,
        dt_min=dt_min,
    )  # fmt: skip


def mamba2_replay_steps(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    replay: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor,
    steps: int,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    *,
    dt_min: float,
) -> None:
    """:func:`mamba2_replay` over ``steps`` tokens, without its checks and host reads: a row replays its first
    ``min(num_tokens, steps)`` tokens (none when ``num_tokens <= 0``), masked token by token, so a captured
    decode graph can hold it (the decode path passes ``steps = max_replay_tokens``)."""
    conv_dim = conv_states.shape[1]
    _, heads, head_dim, state_size = ssm_states.shape
    x_dim = heads * head_dim
    groups = (conv_dim - x_dim) // (2 * state_size)
    if replay.shape[2] != conv_dim + heads or x_dim + 2 * groups * state_size != conv_dim:
        raise ConfigError(
            f"replay width {replay.shape[2]} does not match conv_dim {conv_dim} + heads {heads}"
        )
    dtype = conv_weight.dtype
    inputs = replay[slots, :steps].to(dtype)  # [b, steps, width]
    window = conv_states[slots].to(dtype)
    state = ssm_states[slots].to(dtype)
    width = window.shape[-1]
    batch = slots.numel()
    for t in range(steps):
        active = (num_tokens > t)[:, None, None]
        xbc_raw = inputs[:, t, :conv_dim]
        full = torch.cat((window, xbc_raw[:, :, None]), dim=-1)
        conv_out = F.silu(depthwise(full, conv_weight, conv_bias))[:, :, 0]
        window = torch.where(active, full[:, :, full.shape[-1] - width :], window)
        xs, Bs, Cs = torch.split(conv_out, [x_dim, groups * state_size, groups * state_size], dim=-1)
        dt = discretize_dt(inputs[:, t, conv_dim:], dt_bias, dt_min)
        new_state, _ = ssm_token(
            state,
            xs.reshape(batch, heads, head_dim),
            dt,
            A,
            _expand_groups(Bs.reshape(batch, groups, state_size), heads),
            _expand_groups(Cs.reshape(batch, groups, state_size), heads),
            D,
        )
        state = torch.where(active[..., None], new_state, state)
    conv_states.index_copy_(0, slots, window.to(conv_states.dtype))
    ssm_states.index_copy_(0, slots, state.to(ssm_states.dtype))
