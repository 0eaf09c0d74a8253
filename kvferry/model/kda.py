"""One rank's share of a KimiLinear KDA (Kimi Delta Attention) block over a batch, and its weight shard.

The block follows transformers' ``KimiLinearDeltaAttention``: ``[q | k | v]`` projections through a causal
depthwise conv (no bias) + SiLU, a per-channel forget gate ``g = -exp(A_log) * softplus(f_b(f_a(h)) + dt_bias)``,
``beta = sigmoid(b_proj(h))``, the gated delta rule over l2-normalised q/k (:mod:`kvferry.kernels.kda`), a
gated RMSNorm per head (``o_norm``, gate ``g_b(g_a(h))``) and ``o_proj``. Tensor parallelism splits it by heads:
a rank holds its heads' q/k/v rows, conv channels, gate rows, ``dt_bias``, ``A_log``, ``b_proj`` rows, ``g_b``
rows and ``o_proj`` columns (:func:`shard_kda_weights`); ``f_a``, ``g_a`` and ``o_norm`` are replicated, and
the caller sums the ranks' outputs.

Cache rules are those of the Mamba2 block (:mod:`kvferry.model.nemotron_h`): ``start == 0`` rows have slots the
caller reset; prefill chunks continue from the slot and decode rows advance it; a verify group does not advance
it but stores its raw per-token inputs in the replay buffer; resumed slots first replay their accepted tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvferry.errors import ConfigError
from kvferry.kernels.kda import (
    gated_rms_norm,
    kda_gate,
    kda_replay,
    kda_replay_steps,
    kda_scan,
    replay_width,
    short_conv,
)
from kvferry.model.batch import Group
from kvferry.pools.spec import HeadShard

__all__ = ["KDA_REPLICATED", "kda_block", "shard_kda_weights"]

#: weights every rank holds whole
KDA_REPLICATED = ("f_a_proj.weight", "g_a_proj.weight", "o_norm.weight")


def _prefix(layer: int) -> str:
    return f"model.layers.{layer}.self_attn."


def shard_kda_weights(
    tensors: Mapping[str, torch.Tensor], layer: int, heads: HeadShard, head_dim: int
) -> dict[str, torch.Tensor]:
    """One rank's slice of KDA block ``layer`` (names ``model.layers.{layer}.self_attn.*``, as in a KimiLinear
    checkpoint: ``f_a_proj``, ``f_b_proj``, ``dt_bias`` and ``A_log`` directly under ``self_attn``).

    :param heads: the rank's KDA heads (``RankSpec.kda_heads``).
    :raises ~kvferry.errors.ConfigError: duplicated heads (KDA heads do not replicate), a missing tensor or a
        shape that does not hold ``heads.total`` heads of ``head_dim``.
    """
    if heads.is_duplicated:
        raise ConfigError(f"KDA heads do not split over {heads.replicas} replicas")
    p, d = _prefix(layer), head_dim
    total = heads.total * d
    h0, hc = heads.first, heads.count
    c0, cc = h0 * d, hc * d

    def get(name: str) -> torch.Tensor:
        try:
            return tensors[p + name]
        except KeyError:
            raise ConfigError(f"layer {layer}: missing {p + name}") from None

    def rows(name: str, first: int, count: int, whole: int) -> torch.Tensor:
        t = get(name)
        if t.shape[0] != whole:
            raise ConfigError(f"layer {layer}: {name} shape {tuple(t.shape)} does not hold {whole} rows")
        return t[first : first + count].contiguous()

    out = {p + name: get(name) for name in KDA_REPLICATED}
    for name in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "f_b_proj.weight", "g_b_proj.weight"):
        out[p + name] = rows(name, c0, cc, total)
    out[p + "dt_bias"] = rows("dt_bias", c0, cc, total)
    out[p + "b_proj.weight"] = rows("b_proj.weight", h0, hc, heads.total)
    conv = get("conv1d.weight")
    if conv.shape[0] != 3 * total:
        raise ConfigError(
            f"layer {layer}: conv1d.weight shape {tuple(conv.shape)} is not [{3 * total}, 1, K]"
        )
    out[p + "conv1d.weight"] = torch.cat([conv[s * total + c0 : s * total + c0 + cc] for s in range(3)])
    o_proj = get("o_proj.weight")
    if o_proj.ndim != 2 or o_proj.shape[1] != total:
        raise ConfigError(
            f"layer {layer}: o_proj.weight shape {tuple(o_proj.shape)} does not take {total} inputs"
        )
    out[p + "o_proj.weight"] = o_proj[:, c0 : c0 + cc].contiguous()
    a_log = get("A_log")
    if a_log.numel() != heads.total:
        raise ConfigError(
            f"layer {layer}: A_log shape {tuple(a_log.shape)} does not hold {heads.total} heads"
        )
    # keep the checkpoint's shape ([1, 1, heads, 1]) with the head dimension cut to this rank's heads
    shape = [hc if size == heads.total else size for size in a_log.shape]
    out[p + "A_log"] = a_log.reshape(-1)[h0 : h0 + hc].reshape(shape).contiguous()
    return out


def _check(
    groups: Sequence[Group],
    conv: torch.Tensor,
    ssm: torch.Tensor,
    replay: torch.Tensor,
    resumed: torch.Tensor,
    replay_counts: torch.Tensor,
    heads: int,
    head_dim: int,
    kernel: int,
    unique: bool,
) -> None:
    conv_dim = 3 * heads * head_dim
    if tuple(conv.shape[1:]) != (conv_dim, kernel - 1):
        raise ConfigError(f"conv shape {tuple(conv.shape)} does not fit {conv_dim} channels, kernel {kernel}")
    if tuple(ssm.shape[1:]) != (heads, head_dim, head_dim):
        raise ConfigError(f"ssm shape {tuple(ssm.shape)} does not fit {heads} heads of {head_dim}")
    width = replay_width(conv_dim, heads, head_dim)
    if replay.ndim != 3 or replay.shape[2] != width:
        raise ConfigError(f"replay shape {tuple(replay.shape)} is not [slots, tokens, {width}]")
    if unique:
        slots = torch.cat([g.slots for g in groups]) if groups else resumed
        if slots.numel() != torch.unique(slots).numel():
            raise ConfigError("a batch names the same state slot twice")
    for g in groups:
        if g.verify and g.rows.shape[1] > replay.shape[1]:
            raise ConfigError(
                f"a verify step of {g.rows.shape[1]} tokens exceeds {replay.shape[1]} replay tokens"
            )
    if resumed.shape != replay_counts.shape:
        raise ConfigError(f"{resumed.numel()} resumed slots with {replay_counts.numel()} replay counts")


def kda_block(
    w: Mapping[str, torch.Tensor],
    prefix: str,
    h: torch.Tensor,
    groups: Sequence[Group],
    conv: torch.Tensor,
    ssm: torch.Tensor,
    replay: torch.Tensor,
    resumed: torch.Tensor,
    replay_counts: torch.Tensor,
    *,
    head_dim: int,
    eps: float,
    use_fla: bool | None = None,
    check: bool = True,
) -> torch.Tensor:
    """One rank's share of a KDA block for the rows ``h`` ``[rows, hidden]`` (the normed residual stream).

    :param w: the rank's weights (:func:`shard_kda_weights`), names ``prefix + ...`` (``q_proj.weight``, ...).
    :param groups: the step's groups (:func:`kvferry.model.batch.plan_groups`); their rows cover ``h``.
    :param conv: ``[num_slots, 3 * heads_rank * head_dim, conv_kernel - 1]``, ``ssm`` ``[num_slots, heads_rank,
        head_dim, head_dim]``, ``replay`` ``[num_slots, max_replay_tokens, width]`` (width per
        :func:`~kvferry.kernels.kda.replay_width`): this layer's views of the rank's cache.
    :param resumed: ``[r]`` int64 slots of the batch's rows with ``start > 0``; ``replay_counts`` ``[r]`` their
        ``num_accepted`` (tokens of their last verify step to replay first; 0: none).
    :param eps: ``o_norm``'s epsilon (the config's ``rms_norm_eps``).
    :param use_fla: see :func:`~kvferry.kernels.kda.kda_scan`.
    :param check: check slots and replay counts on the host (syncs). False (a captured decode graph): slots
        must be distinct and counts in ``[0, max_replay_tokens]``; resumed slots replay masked over
        ``max_replay_tokens`` steps, so nothing is read back; the results are the same.
    :return: ``[rows, hidden]`` the rank's partial output (after its ``o_proj`` columns); the caller sums ranks.

    Reads and writes: the resumed slots' conv window and state advance by their replayed tokens; every group's
    slots are read; non-verify groups' slots advance by their tokens; verify groups write ``replay[slot, :n]`` =
    ``[raw pre-conv q|k|v, log gate g per channel, beta]`` and leave conv and state as they were. No other slot,
    and neither ``num_accepted`` nor the replay rows of resumed slots, is written (the caller clears
    ``num_accepted`` once every layer has replayed; fresh slots must be zeroed by the caller beforehand).

    :raises ~kvferry.errors.ConfigError: on shapes, slots or counts that do not fit, before anything is written.
    An exception from inside the arithmetic (none expected) may leave the named slots partly advanced (some
    groups, or only the replay); slots of other sequences are never touched.
    """
    conv_w = w[prefix + "conv1d.weight"]
    conv_w = conv_w.reshape(conv_w.shape[0], conv_w.shape[-1])  # [channels, kernel]
    heads = w[prefix + "b_proj.weight"].shape[0]
    section = heads * head_dim
    _check(groups, conv, ssm, replay, resumed, replay_counts, heads, head_dim, conv_w.shape[1], check)
    if resumed.numel() and check:
        kda_replay(conv, ssm, replay, resumed, replay_counts, conv_w)
    elif resumed.numel():
        kda_replay_steps(conv, ssm, replay, resumed, replay_counts, replay.shape[1], conv_w)

    qkv = torch.cat(
        (
            h @ w[prefix + "q_proj.weight"].T,
            h @ w[prefix + "k_proj.weight"].T,
            h @ w[prefix + "v_proj.weight"].T,
        ),
        dim=-1,
    )
    f = (h @ w[prefix + "f_a_proj.weight"].T) @ w[prefix + "f_b_proj.weight"].T
    g = kda_gate(f, w[prefix + "A_log"], w[prefix + "dt_bias"], head_dim)  # [rows, heads, head_dim]
    beta = torch.sigmoid(h @ w[prefix + "b_proj.weight"].T)  # [rows, heads]
    out = torch.empty(h.shape[0], heads, head_dim, dtype=h.dtype, device=h.device)
    for grp in groups:
        b, n = grp.rows.shape
        raw = qkv[grp.rows]  # [b, n, 3 * section]
        commit = not grp.verify
        if grp.verify:
            staged = (raw, g[grp.rows].flatten(-2), beta[grp.rows])
            replay[grp.slots, :n] = torch.cat([t.to(replay.dtype) for t in staged], dim=-1)
        x = short_conv(raw, conv, grp.slots, conv_w, commit=commit, check=check)
        q, k, v = (t.reshape(b, n, heads, head_dim) for t in torch.split(x, section, dim=-1))
        o = kda_scan(
            q, k, v, g[grp.rows], beta[grp.rows], ssm, grp.slots,
            commit=commit, chunked=n > 1 and commit, use_fla=use_fla, check=check,
        )  # fmt: skip
        out[grp.rows.reshape(-1)] = o.reshape(b * n, heads, head_dim)
    gate = (h @ w[prefix + "g_a_proj.weight"].T) @ w[prefix + "g_b_proj.weight"].T
    gate = gate.reshape(-1, heads, head_dim)
    normed = gated_rms_norm(out, gate, w[prefix + "o_norm.weight"], eps)
    return normed.reshape(h.shape[0], section) @ w[prefix + "o_proj.weight"].T
