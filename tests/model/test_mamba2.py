"""Mamba2 conv / SSM / replay kernels against per-token, per-element reference loops."""

from __future__ import annotations

import math

import pytest
import torch

from kvferry.errors import ConfigError
from kvferry.model.mamba2 import causal_conv1d, mamba2_replay, ssm_chunk_scan, ssm_step

H, P, N, G, K = 4, 3, 5, 2, 4
CONV = H * P + 2 * G * N
DT_MIN = 1e-4


def _softplus(v: float) -> float:
    return math.log1p(math.exp(v))


def _ref_conv(
    window: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # window [C, K-1], x [L, C]: per token, per channel sums.
    hist = [window[:, j].clone() for j in range(window.shape[1])]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        hist.append(x[t].clone())
        taps = hist[-K:]
        for c in range(x.shape[1]):
            v = float(b[c]) + sum(float(w[c, j]) * float(taps[j][c]) for j in range(K))
            out[t, c] = v / (1.0 + math.exp(-v))
    return out, torch.stack(hist[-(K - 1) :], dim=1)


def _ref_ssm(state: torch.Tensor, x, dt, A, B, C, D, dt_bias):  # type: ignore[no-untyped-def]
    # state [H,P,N]; x [L,H,P]; dt [L,H]; B/C [L,G,N]: scalar loops.
    state = state.clone()
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for h in range(H):
            g = h // (H // G)
            d = max(_softplus(float(dt[t, h] + dt_bias[h])), DT_MIN)
            da = math.exp(d * float(A[h]))
            for p in range(P):
                acc = 0.0
                for n in range(N):
                    state[h, p, n] = state[h, p, n] * da + d * float(x[t, h, p]) * float(B[t, g, n])
                    acc += float(state[h, p, n]) * float(C[t, g, n])
                y[t, h, p] = acc + float(D[h]) * float(x[t, h, p])
    return y, state


def _params(seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    return (
        torch.randn(CONV, K, generator=g, dtype=f64) * 0.5,  # conv weight
        torch.randn(CONV, generator=g, dtype=f64) * 0.1,  # conv bias
        -torch.rand(H, generator=g, dtype=f64) * 2 - 0.1,  # A
        torch.randn(H, generator=g, dtype=f64),  # D
        torch.randn(H, generator=g, dtype=f64) - 1,  # dt_bias
    )


@pytest.mark.parametrize(("length", "commit"), [(1, True), (2, True), (7, True), (3, False)])
def test_causal_conv1d_continues_from_window(length: int, commit: bool) -> None:
    torch.manual_seed(length)
    w, b, *_ = _params(length)
    states = torch.randn(6, CONV, K - 1, dtype=torch.float64)
    before = states.clone()
    slots = torch.tensor([4, 1])
    x = torch.randn(2, length, CONV, dtype=torch.float64)
    out = causal_conv1d(x, states, slots, w, b, commit=commit)
    for i, s in enumerate(slots.tolist()):
        ref_out, ref_window = _ref_conv(before[s], x[i], w, b)
        torch.testing.assert_close(out[i], ref_out, rtol=0, atol=1e-12)
        expected = ref_window if commit else before[s]
        torch.testing.assert_close(states[s], expected, rtol=0, atol=0)
    untouched = [s for s in range(6) if s not in (4, 1)]
    assert torch.equal(states[untouched], before[untouched])


def _ssm_inputs(seed: int, length: int, batch: int = 2):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    return (
        torch.randn(batch, length, H, P, generator=g, dtype=f64),
        torch.randn(batch, length, H, generator=g, dtype=f64),
        torch.randn(batch, length, G, N, generator=g, dtype=f64),
        torch.randn(batch, length, G, N, generator=g, dtype=f64),
    )


@pytest.mark.parametrize("kernel", ["step", "chunk"])
@pytest.mark.parametrize(("length", "chunk"), [(1, 4), (5, 4), (8, 4), (11, 3)])
def test_ssm_kernels_match_scalar_recurrence(kernel: str, length: int, chunk: int) -> None:
    _, _, A, D, dt_bias = _params(length)
    x, dt, B, C = _ssm_inputs(length + 100, length)
    states = torch.randn(5, H, P, N, dtype=torch.float64)
    before = states.clone()
    slots = torch.tensor([3, 0])
    if kernel == "step":
        y = ssm_step(x, dt, A, B, C, D, dt_bias, states, slots, dt_min=DT_MIN)
    else:
        y = ssm_chunk_scan(x, dt, A, B, C, D, dt_bias, states, slots, dt_min=DT_MIN, chunk_size=chunk)
    for i, s in enumerate(slots.tolist()):
        ref_y, ref_state = _ref_ssm(before[s], x[i], dt[i], A, B[i], C[i], D, dt_bias)
        torch.testing.assert_close(y[i], ref_y, rtol=0, atol=1e-11)
        torch.testing.assert_close(states[s], ref_state, rtol=0, atol=1e-11)
    assert torch.equal(states[[1, 2, 4]], before[[1, 2, 4]])


def test_ssm_without_commit_leaves_slots_alone() -> None:
    _, _, A, D, dt_bias = _params(3)
    x, dt, B, C = _ssm_inputs(3, 4)
    states = torch.randn(3, H, P, N, dtype=torch.float64)
    before = states.clone()
    ssm_step(x, dt, A, B, C, D, dt_bias, states, torch.tensor([0, 2]), dt_min=DT_MIN, commit=False)
    ssm_chunk_scan(
        x, dt, A, B, C, D, dt_bias, states, torch.tensor([0, 2]), dt_min=DT_MIN, chunk_size=2, commit=False
    )
    assert torch.equal(states, before)


def test_duplicate_slots_are_refused() -> None:
    w, b, *_ = _params(0)
    states = torch.zeros(3, CONV, K - 1, dtype=torch.float64)
    with pytest.raises(ConfigError):
        causal_conv1d(torch.zeros(2, 1, CONV, dtype=torch.float64), states, torch.tensor([1, 1]), w, b)


def test_replay_equals_decoding_the_accepted_tokens_one_by_one() -> None:
    w, b, A, D, dt_bias = _params(9)
    slots_n, replay_max = 4, 5
    conv0 = torch.randn(slots_n, CONV, K - 1, dtype=torch.float64)
    ssm0 = torch.randn(slots_n, H, P, N, dtype=torch.float64)
    replay = torch.randn(slots_n, replay_max, CONV + H, dtype=torch.float64)
    slots = torch.tensor([2, 0, 3])
    accepted = torch.tensor([3, 0, 5])
    conv, ssm = conv0.clone(), ssm0.clone()
    mamba2_replay(conv, ssm, replay, slots, accepted, w, b, A, D, dt_bias, dt_min=DT_MIN)
    # plain decode of the same raw inputs, one token per step, through the public kernels
    conv_d, ssm_d = conv0.clone(), ssm0.clone()
    xd = H * P
    for s, n in zip(slots.tolist(), accepted.tolist(), strict=True):
        sl = torch.tensor([s])
        for t in range(n):
            raw = replay[s, t]
            out = causal_conv1d(raw[None, None, :CONV], conv_d, sl, w, b)[0, 0]
            xs, Bs, Cs = out[:xd], out[xd : xd + G * N], out[xd + G * N :]
            ssm_step(
                xs.reshape(1, 1, H, P),
                raw[CONV:].reshape(1, 1, H),
                A,
                Bs.reshape(1, 1, G, N),
                Cs.reshape(1, 1, G, N),
                D,
                dt_bias,
                ssm_d,
                sl,
                dt_min=DT_MIN,
            )
    # The same arithmetic as decode; only vectorised-vs-scalar exp/softplus may round the last ulp apart.
    torch.testing.assert_close(conv, conv_d, rtol=0, atol=1e-14)
    torch.testing.assert_close(ssm, ssm_d, rtol=0, atol=1e-13)
    assert torch.equal(conv[0], conv0[0]) and torch.equal(ssm[0], ssm0[0])  # 0 accepted: untouched
    assert torch.equal(conv[1], conv0[1])  # not named


def test_replay_refuses_counts_past_the_buffer() -> None:
    w, b, A, D, dt_bias = _params(1)
    conv = torch.zeros(2, CONV, K - 1, dtype=torch.float64)
    ssm = torch.zeros(2, H, P, N, dtype=torch.float64)
    replay = torch.zeros(2, 3, CONV + H, dtype=torch.float64)
    with pytest.raises(ConfigError):
        mamba2_replay(
            conv, ssm, replay, torch.tensor([0]), torch.tensor([4]), w, b, A, D, dt_bias, dt_min=0.0
        )
