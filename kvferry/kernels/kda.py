"""KDA (Kimi Delta Attention) over slot-first state pools: the torch arithmetic of KimiLinear's linear attention,
and flash-linear-attention's kernels on CUDA.

Per head, KDA keeps a ``[K, V]`` state matrix ``S`` (K = V = head dim) and per token runs the gated delta rule
with a decay per channel of K::

    S = S * exp(g)[:, None]                  g = -exp(A_log) * softplus(f + dt_bias)  (log-space, < 0)
    S = S + beta * k (outer) (v - k . S)     beta = sigmoid(b), q and k l2-normalised (eps 1e-6)
    o = (q / sqrt(K)) . S

State of one sequence lives in one *slot*: per layer a conv window ``conv_states[slot]`` ``[3 * heads * head_dim,
conv_kernel - 1]`` (channel-major, sections ``[q | k | v]``, the raw pre-conv inputs of the last
``conv_kernel - 1`` tokens) and the state ``ssm_states[slot]`` ``[heads, head_dim (K), head_dim (V)]``. Kernels
read the slots named by ``slots`` and, when ``commit`` is true, write the advanced state back in place; with
``commit=False`` (speculative verify) the slots are left exactly as they were. The recurrence runs in float32
(float64 for float64 inputs); states are stored in the pool's dtype.

:func:`kda_scan` takes one of three forms: per token (:func:`kda_recurrent`, decode and verify), chunked
(:func:`kda_chunked`, prefill; equal up to rounding), or on CUDA flash-linear-attention's ``chunk_kda`` /
``fused_recurrent_kda`` (``fla.ops.kda``, whose conventions are those of the torch forms: log-space ``g`` per
channel, post-sigmoid ``beta``, l2norm in kernel, scale ``K ** -0.5``, float32 ``[N, H, K, V]`` states).

:func:`kda_replay` advances slots by the accepted tokens of the last verify step from the raw per-token inputs
in the replay buffer, through the per-token arithmetic a decode step uses.

Kernels import nothing from kvferry.model; the arithmetic is that of transformers' ``KimiLinearDeltaAttention``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvferry.errors import ConfigError
from kvferry.kernels.fla import fla_ops, fla_runs
from kvferry.kernels.mamba_decode import depthwise

__all__ = [
    "L2NORM_EPS",
    "compute_dtype",
    "fla_available",
    "gated_rms_norm",
    "kda_chunked",
    "kda_gate",
    "kda_recurrent",
    "kda_replay",
    "kda_replay_steps",
    "kda_scan",
    "kda_token",
    "l2norm",
    "replay_width",
    "short_conv",
]

#: epsilon of the q/k l2 normalisation (flash-linear-attention's, inside the root)
L2NORM_EPS = 1e-6


def fla_available(device: torch.device) -> bool:
    """Whether flash-linear-attention's KDA kernels can run on ``device`` (a CUDA device where ``fla`` imports)."""
    return fla_runs("kda", device)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the recurrence runs in for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (flash-linear-attention's form: eps inside)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The forget gate in log space: ``-exp(A_log) * softplus(f + dt_bias)`` per channel.

    :param f: ``[..., heads * head_dim]`` the low-rank gate projection (``f_b(f_a(h))``).
    :param A_log: ``heads`` elements (any shape, e.g. transformers' ``[1, 1, heads, 1]``);
        ``dt_bias`` ``[heads * head_dim]``.
    :return: ``[..., heads, head_dim]`` in :func:`compute_dtype` (every entry < 0 up to rounding).
    """
    ct = compute_dtype(f.dtype)
    g = (f.to(ct) + dt_bias.to(ct)).reshape(*f.shape[:-1], -1, head_dim)
    # F.softplus returns x itself above 20, as transformers' form does
    return -torch.exp(A_log.to(ct).reshape(-1, 1)) * F.softplus(g)


def _check_unique(slots: torch.Tensor) -> None:
    if slots.numel() != torch.unique(slots).numel():
        raise ConfigError("a batch names the same state slot twice")


def short_conv(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    *,
    commit: bool = True,
    check: bool = True,
) -> torch.Tensor:
    """Depthwise causal conv (no bias) + SiLU of new tokens, continuing from each slot's conv window.

    :param x: ``[batch, length, channels]`` raw ``[q | k | v]`` inputs (``length`` >= 1).
    :param conv_states: ``[num_slots, channels, kernel - 1]`` pool view; ``slots`` ``[batch]`` int64, distinct.
    :param weight: ``[channels, kernel]``.
    :param commit: write the window of the last ``kernel - 1`` inputs back into the slots (else untouched).
    :param check: refuse a slot named twice (a host sync; a captured graph passes False and distinct slots).
    :return: ``[batch, length, channels]`` activations in ``x``'s dtype.
    """
    if check:
        _check_unique(slots)
    width = conv_states.shape[-1]
    window = conv_states[slots].to(x.dtype)  # gather: a copy
    full = torch.cat((window, x.transpose(1, 2)), dim=-1)  # [batch, channels, width + length]
    out = depthwise(full, weight.to(x.dtype), None)
    if commit:
        conv_states.index_copy_(0, slots, full[:, :, full.shape[-1] - width :].to(conv_states.dtype))
    return F.silu(out).transpose(1, 2)


def kda_token(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule: ``(new_state, o)``.

    :param state: ``[batch, heads, K, V]``; ``q`` (already scaled), ``k`` (normalised) ``[batch, heads, K]``;
        ``v`` ``[batch, heads, V]``; ``g`` ``[batch, heads, K]`` log decay; ``beta`` ``[batch, heads]``. All of
        one dtype.
    """
    state = state * g.exp()[..., None]
    delta = (v - (state * k[..., None]).sum(dim=-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return state, (state * q[..., None]).sum(dim=-2)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ct: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # float casts first: flash-linear-attention normalises in float32
    q, k, v, g, beta = (t.to(ct) for t in (q, k, v, g, beta))
    return l2norm(q) * q.shape[-1] ** -0.5, l2norm(k), v, g, beta


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token KDA from ``state``: ``(o, final_state)``, both in ``state``'s dtype.

    :param q: ``[batch, length, heads, K]`` (raw: l2-normalised and scaled here); ``k`` likewise; ``v``
        ``[batch, length, heads, V]``; ``g`` ``[batch, length, heads, K]`` log decay; ``beta``
        ``[batch, length, heads]``; ``state`` ``[batch, heads, K, V]`` (its dtype is the compute dtype).
    """
    q, k, v, g, beta = _prepare(q, k, v, g, beta, state.dtype)
    outputs = []
    for t in range(q.shape[1]):
        state, o = kda_token(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outputs.append(o)
    return torch.stack(outputs, dim=1), state


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA (the WY form of transformers' ``chunk_kimi_delta_attention``): same arguments and result as
    :func:`kda_recurrent`, equal up to rounding. Inside a chunk of ``chunk_size`` tokens the updates are one
    unit-lower-triangular solve; between chunks the state is carried."""
    if chunk_size <= 0:
        raise ConfigError(f"chunk_size must be positive, got {chunk_size}")
    q, k, v, g, beta = _prepare(q, k, v, g, beta, state.dtype)
    # [batch, heads, length, dim]
    q, k, v, g = (t.transpose(1, 2) for t in (q, k, v, g))
    beta = beta.transpose(1, 2)
    length = q.shape[2]
    c = min(chunk_size, length)
    dev, ct = q.device, q.dtype
    eye = torch.eye(c, dtype=ct, device=dev)
    outputs = []
    for begin in range(0, length, c):
        end = min(begin + c, length)
        n = end - begin
        qc, kc, vc, bc = q[:, :, begin:end], k[:, :, begin:end], v[:, :, begin:end], beta[:, :, begin:end]
        gc = g[:, :, begin:end].cumsum(dim=-2)  # [b, h, n, K], non-increasing along n
        # decay[i, j] = exp(gc[i] - gc[j]) for j <= i, else 0 (masked before exp: no overflow)
        later = torch.ones(n, n, dtype=torch.bool, device=dev).triu(1)
        diff = gc[..., :, None, :] - gc[..., None, :, :]  # [b, h, i, j, K]
        decay = diff.masked_fill(later[..., None], -torch.inf).exp()
        kk = (kc[..., :, None, :] * kc[..., None, :, :] * decay).sum(-1)  # [b, h, i, j]
        earlier = torch.ones(n, n, dtype=torch.bool, device=dev).tril(-1)
        lower = (kk * bc[..., :, None]).masked_fill(~earlier, 0)
        # T = (I + strictly-lower(beta_i k_i . k_j decay))^-1: the WY factors of the chunk's updates
        solve = torch.linalg.solve_triangular(
            eye[:n, :n] + lower, eye[:n, :n].expand_as(lower), upper=False, unitriangular=True
        )
        u = solve @ (vc * bc[..., None])
        w = solve @ (kc * bc[..., None] * gc.exp())
        attn = (qc[..., :, None, :] * kc[..., None, :, :] * decay).sum(-1)  # j <= i only (decay 0 above)
        v_new = u - w @ state
        outputs.append((qc * gc.exp()) @ state + attn @ v_new)
        last = gc[:, :, -1:, :]  # [b, h, 1, K]
        state = state * last.transpose(-1, -2).exp() + (kc * (last - gc).exp()).transpose(-1, -2) @ v_new
    return torch.cat(outputs, dim=2).transpose(1, 2), state


def _fla_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    chunked: bool,
    final: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    # fla's layouts are ours ([B, T, H, K], states [N, H, K, V] float32); g stays float32, beta in q's dtype,
    # as transformers hands them to the same kernels
    ops = fla_ops("kda")  # optional: no stubs, imported only on CUDA
    fn = ops.chunk_kda if chunked else ops.fused_recurrent_kda
    o, final_state = fn(
        q.contiguous(),
        k.contiguous(),
        v.to(q.dtype).contiguous(),
        g.float().contiguous(),
        beta.to(q.dtype).contiguous(),
        initial_state=state.float().contiguous(),
        output_final_state=final,
        use_qk_l2norm_in_kernel=True,
    )
    return o, final_state


def kda_scan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_states: torch.Tensor,
    slots: torch.Tensor,
    *,
    commit: bool = True,
    chunked: bool = False,
    chunk_size: int = 64,
    use_fla: bool | None = None,
    check: bool = True,
) -> torch.Tensor:
    """KDA of new tokens, continuing from each slot's state.

    :param q: ``[batch, length, heads, K]`` raw queries (post conv, before the l2norm); ``k`` likewise; ``v``
        ``[batch, length, heads, V]``; ``g`` ``[batch, length, heads, K]`` log decay (:func:`kda_gate`);
        ``beta`` ``[batch, length, heads]`` post-sigmoid.
    :param ssm_states: ``[num_slots, heads, K, V]`` pool view; ``slots`` ``[batch]`` int64, distinct.
    :param commit: write the state after the last token back into the slots (else they are left untouched).
    :param chunked: the chunked form (prefill) rather than the per-token one (decode, verify).
    :param use_fla: flash-linear-attention's kernels (``chunk_kda`` when ``chunked``, else
        ``fused_recurrent_kda``); None: where :func:`fla_available` and the inputs are not float64.
    :param check: as for :func:`short_conv`.
    :return: ``o`` ``[batch, length, heads, V]`` in ``q``'s dtype.
    :raises ~kvferry.errors.ConfigError: a slot named twice, or ``use_fla`` without fla on CUDA; nothing
        written.
    """
    if check:
        _check_unique(slots)
    if use_fla is None:
        use_fla = fla_available(q.device) and q.dtype != torch.float64
    elif use_fla and not fla_available(q.device):
        raise ConfigError(f"flash-linear-attention's KDA kernels do not run on {q.device}")
    state = ssm_states[slots].to(compute_dtype(q.dtype))  # gather: a copy
    final: torch.Tensor | None
    if use_fla:
        o, final = _fla_scan(q, k, v, g, beta, state, chunked=chunked, final=commit)
    elif chunked:
        o, final = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk_size)
    else:
        o, final = kda_recurrent(q, k, v, g, beta, state)
    if commit:
        assert final is not None
        ssm_states.index_copy_(0, slots, final.to(ssm_states.dtype))
    return o.to(q.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """KimiLinear's output norm: ``weight * x / sqrt(mean(x^2) + eps) * sigmoid(gate)`` over the last dimension
    (one head), computed in float32 (float64 for float64) and returned in ``x``'s dtype."""
    ct = compute_dtype(x.dtype)
    xf = x.to(ct)
    normed = weight.to(ct) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
    return (normed * torch.sigmoid(gate.to(ct))).to(x.dtype)


def replay_width(conv_dim: int, heads: int, head_dim: int) -> int:
    """Width of a KDA replay row: raw pre-conv ``[q | k | v]``, the log gate per channel, beta per head."""
    return conv_dim + heads * head_dim + heads


def kda_replay(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    replay: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor,
    conv_weight: torch.Tensor,
) -> None:
    """Advance each slot's conv window and state by the first ``num_tokens`` tokens of its replay buffer.

    :param replay: ``[num_slots, max_replay_tokens, width]`` pool view (:func:`replay_width`): per token of the
        last verify step the raw pre-conv ``[q | k | v]``, the log gate ``g`` per channel (:func:`kda_gate`) and
        the post-sigmoid ``beta`` per head.
    :param slots: ``[batch]`` int64, distinct; ``num_tokens`` ``[batch]`` int64 in ``[0, max_replay_tokens]``
        (0 leaves the slot untouched).
    :param conv_weight: ``[channels, kernel]``; the conv runs in its dtype, the recurrence in float32.
    The replay buffer and ``num_accepted`` are not modified (the caller clears ``num_accepted`` once every layer
    has replayed).
    :raises ~kvferry.errors.ConfigError: bad counts or shapes; nothing written.
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
    kda_replay_steps(conv_states, ssm_states, replay, slots, num_tokens, steps, conv_weight)


def kda_replay_steps(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    replay: torch.Tensor,
    slots: torch.Tensor,
    num_tokens: torch.Tensor,
    steps: int,
    conv_weight: torch.Tensor,
) -> None:
    """:func:`kda_replay` over ``steps`` tokens, without its checks and host reads: a row replays its first
    ``min(num_tokens, steps)`` tokens (none when ``num_tokens <= 0``), masked token by token, so a captured
    decode graph can hold it."""
    conv_dim = conv_states.shape[1]
    _, heads, head_dim, _ = ssm_states.shape
    section = heads * head_dim
    if conv_dim != 3 * section or replay.shape[2] != replay_width(conv_dim, heads, head_dim):
        raise ConfigError(
            f"replay width {replay.shape[2]} / conv channels {conv_dim} do not fit {heads} heads of {head_dim}"
        )
    dtype = conv_weight.dtype
    ct = compute_dtype(dtype)
    inputs = replay[slots, :steps]  # [b, steps, width]
    window = conv_states[slots].to(dtype)
    state = ssm_states[slots].to(ct)
    width = window.shape[-1]
    batch = slots.numel()
    for t in range(steps):
        active = (num_tokens > t)[:, None, None]
        raw = inputs[:, t, :conv_dim].to(dtype)
        full = torch.cat((window, raw[:, :, None]), dim=-1)
        conv_out = F.silu(depthwise(full, conv_weight, None))[:, :, 0]
        window = torch.where(active, full[:, :, full.shape[-1] - width :], window)
        q, k, v = (x.reshape(batch, 1, heads, head_dim) for x in torch.split(conv_out, section, dim=-1))
        g = inputs[:, t, conv_dim : conv_dim + section].reshape(batch, 1, heads, head_dim)
        beta = inputs[:, t, conv_dim + section :].reshape(batch, 1, heads)
        _, new_state = kda_recurrent(q, k, v, g, beta, state)
        state = torch.where(active[..., None], new_state, state)
    conv_states.index_copy_(0, slots, window.to(conv_states.dtype))
    ssm_states.index_copy_(0, slots, state.to(ssm_states.dtype))
