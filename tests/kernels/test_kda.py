"""KDA kernels: the chunked form against the per-token one, both against transformers' KimiLinear functions,
slot reads and writes, replay, and flash-linear-attention against the torch form on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvferry.errors import ConfigError
from kvferry.kernels.kda import (
    compute_dtype,
    fla_available,
    gated_rms_norm,
    kda_chunked,
    kda_gate,
    kda_recurrent,
    kda_replay,
    kda_scan,
    l2norm,
    replay_width,
    short_conv,
)

H, D, KERNEL = 3, 8, 4
CONV = 3 * H * D
F64 = torch.float64


def _inputs(
    b: int,
    n: int,
    seed: int,
    dtype: torch.dtype = F64,
    device: str = "cpu",
    heads: int = H,
    head_dim: int = D,
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    q, k, v = (rand(b, n, heads, head_dim) for _ in range(3))
    g = -torch.rand(b, n, heads, head_dim, generator=gen, dtype=F64) * 0.7  # log decay
    beta = torch.rand(b, n, heads, generator=gen, dtype=F64)
    return tuple(t.to(device=device, dtype=dtype) for t in (q, k, v, g, beta))


@pytest.mark.parametrize(("length", "chunk"), [(1, 64), (5, 2), (13, 4), (37, 16), (70, 64)])
def test_chunked_equals_recurrent(length: int, chunk: int) -> None:
    q, k, v, g, beta = _inputs(2, length, length)
    state = torch.randn(2, H, D, D, dtype=F64)
    o1, s1 = kda_recurrent(q, k, v, g, beta, state)
    o2, s2 = kda_chunked(q, k, v, g, beta, state, chunk_size=chunk)
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-12)
    torch.testing.assert_close(s2, s1, rtol=0, atol=1e-12)
    assert o1.shape == (2, length, H, D) and s1.shape == (2, H, D, D)


def test_chunked_survives_strong_decay() -> None:
    # cumulated decays far below exp's range inside one chunk: no inf/nan, still equal to the per-token form
    q, k, v, g, beta = _inputs(1, 40, 3)
    g = g * 200
    state = torch.randn(1, H, D, D, dtype=F64)
    o1, s1 = kda_recurrent(q, k, v, g, beta, state)
    o2, s2 = kda_chunked(q, k, v, g, beta, state, chunk_size=40)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    torch.testing.assert_close(o2, o1, rtol=0, atol=1e-12)
    torch.testing.assert_close(s2, s1, rtol=0, atol=1e-12)


def test_equal_to_transformers_functions() -> None:
    pytest.importorskip("transformers")
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    q, k, v, g, beta = _inputs(2, 11, 7, torch.float32)
    state = torch.randn(2, H, D, D)
    ref_o, ref_s = hf.chunk_kimi_delta_attention(
        q,
        k,
        v,
        g,
        beta,
        chunk_size=4,
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    for fn in (kda_recurrent, kda_chunked):
        o, s = fn(q, k, v, g, beta, state)
        torch.testing.assert_close(o, ref_o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, ref_s, rtol=1e-5, atol=1e-5)
    ref_o1, ref_s1 = hf.recurrent_kimi_delta_attention(
        q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state, True, use_qk_l2norm_in_kernel=True
    )
    o1, s1 = kda_recurrent(q[:, :1], k[:, :1], v[:, :1], g[:, :1], beta[:, :1], state)
    torch.testing.assert_close(o1, ref_o1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s1, ref_s1, rtol=1e-6, atol=1e-6)
    x = torch.randn(5, D, dtype=F64)
    torch.testing.assert_close(l2norm(x), hf.l2norm(x, eps=1e-6), rtol=0, atol=1e-15)


def test_gate_and_norm_equal_transformers_modules() -> None:
    pytest.importorskip("transformers")
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    config = KimiLinearConfig(hidden_size=32, linear_num_heads=H, linear_head_dim=D, rms_norm_eps=1e-5)
    gate = hf.KimiLinearForgetGate(config)
    torch.manual_seed(0)
    for p in gate.parameters():
        torch.nn.init.normal_(p, std=0.5)
    with torch.no_grad():
        gate.dt_bias[:3] = torch.tensor([25.0, -30.0, 0.0])  # both sides of softplus' linear threshold
    h = torch.randn(2, 5, 32)
    with torch.no_grad():
        ref = gate(h)
        f = gate.f_b_proj(gate.f_a_proj(h))
    ours = kda_gate(f, gate.A_log, gate.dt_bias, D)
    assert ours.dtype == torch.float32 and ours.shape == (2, 5, H, D)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert kda_gate(f.double(), gate.A_log, gate.dt_bias, D).dtype == F64

    norm = hf.KimiLinearRMSNormGated(D, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_()
    x, z = torch.randn(4, H, D, dtype=torch.bfloat16), torch.randn(4, H, D, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(gated_rms_norm(x, z, norm.weight, 1e-5), norm(x, z), rtol=0, atol=0)


def _ref_conv(window: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # window [C, K-1], x [L, C]: the whole history through F.conv1d, then the last K-1 raw inputs
    full = torch.cat((window, x.T), dim=-1)
    out = F.conv1d(full[None], w[:, None, :], groups=w.shape[0])[0]
    return F.silu(out).T, full[:, -(KERNEL - 1) :]


@pytest.mark.parametrize(("length", "commit"), [(1, True), (6, True), (3, False)])
def test_short_conv_continues_from_window(length: int, commit: bool) -> None:
    torch.manual_seed(length)
    w = torch.randn(CONV, KERNEL, dtype=F64)
    states = torch.randn(6, CONV, KERNEL - 1, dtype=F64)
    before = states.clone()
    slots = torch.tensor([4, 1])
    x = torch.randn(2, length, CONV, dtype=F64)
    out = short_conv(x, states, slots, w, commit=commit)
    for i, s in enumerate(slots.tolist()):
        ref_out, ref_window = _ref_conv(before[s], x[i], w)
        torch.testing.assert_close(out[i], ref_out, rtol=0, atol=1e-12)
        torch.testing.assert_close(states[s], ref_window if commit else before[s], rtol=0, atol=0)
    for s in (0, 2, 3, 5):
        assert torch.equal(states[s], before[s])


@pytest.mark.parametrize(("chunked", "commit"), [(False, True), (True, True), (False, False)])
def test_scan_reads_and_writes_only_its_slots(chunked: bool, commit: bool) -> None:
    q, k, v, g, beta = _inputs(2, 6, 11)
    pool = torch.randn(5, H, D, D, dtype=torch.float32)
    before = pool.clone()
    slots = torch.tensor([3, 0])
    o = kda_scan(q, k, v, g, beta, pool, slots, commit=commit, chunked=chunked, chunk_size=4, use_fla=False)
    ref_o, ref_s = kda_recurrent(q, k, v, g, beta, before[slots].double())
    assert o.dtype == F64
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-12)
    want = ref_s.float() if commit else before[slots]
    torch.testing.assert_close(pool[slots], want, rtol=0, atol=0)
    for s in (1, 2, 4):
        assert torch.equal(pool[s], before[s])


def test_scan_refuses_a_slot_named_twice_and_fla_off_cuda() -> None:
    q, k, v, g, beta = _inputs(2, 1, 1)
    pool = torch.zeros(4, H, D, D)
    with pytest.raises(ConfigError, match="twice"):
        kda_scan(q, k, v, g, beta, pool, torch.tensor([1, 1]))
    with pytest.raises(ConfigError, match="flash-linear-attention"):
        kda_scan(q, k, v, g, beta, pool, torch.tensor([1, 2]), use_fla=True)
    assert not pool.any()


def _replay_rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(n, CONV, generator=gen, dtype=F64)
    g = -torch.rand(n, H * D, generator=gen, dtype=F64)
    beta = torch.rand(n, H, generator=gen, dtype=F64)
    return raw, g, beta


def test_replay_equals_running_the_accepted_tokens() -> None:
    torch.manual_seed(5)
    w = torch.randn(CONV, KERNEL, dtype=F64) * 0.5
    slots, counts, max_tokens = torch.tensor([4, 0, 2]), torch.tensor([3, 0, 5]), 5
    conv = torch.randn(6, CONV, KERNEL - 1, dtype=F64)
    ssm = torch.randn(6, H, D, D, dtype=F64)
    replay = torch.randn(6, max_tokens, replay_width(CONV, H, D), dtype=F64)
    rows = {}
    for s in slots.tolist():
        rows[s] = _replay_rows(max_tokens, s)
        replay[s] = torch.cat(rows[s], dim=-1)
    conv_ref, ssm_ref, replay_before = conv.clone(), ssm.clone(), replay.clone()
    kda_replay(conv, ssm, replay, slots, counts, w)
    for s, n in zip(slots.tolist(), counts.tolist(), strict=True):
        if n == 0:
            assert torch.equal(conv[s], conv_ref[s]) and torch.equal(ssm[s], ssm_ref[s])
            continue
        raw, g, beta = (t[:n][None] for t in rows[s])
        one = torch.tensor([s])
        x = short_conv(raw, conv_ref, one, w)
        q, k, v = (t.reshape(1, n, H, D) for t in torch.split(x, H * D, dim=-1))
        kda_scan(q, k, v, g.reshape(1, n, H, D), beta, ssm_ref, one)
        torch.testing.assert_close(conv[s], conv_ref[s], rtol=0, atol=0)
        torch.testing.assert_close(ssm[s], ssm_ref[s], rtol=0, atol=1e-12)
    for s in (1, 3, 5):
        assert torch.equal(conv[s], conv_ref[s]) and torch.equal(ssm[s], ssm_ref[s])
    assert torch.equal(replay, replay_before)


def test_replay_refuses_bad_counts_and_widths_writing_nothing() -> None:
    w = torch.randn(CONV, KERNEL, dtype=F64)
    conv, ssm = torch.randn(3, CONV, KERNEL - 1, dtype=F64), torch.randn(3, H, D, D, dtype=F64)
    replay = torch.randn(3, 4, replay_width(CONV, H, D), dtype=F64)
    conv0, ssm0 = conv.clone(), ssm.clone()
    with pytest.raises(ConfigError, match="outside"):
        kda_replay(conv, ssm, replay, torch.tensor([1]), torch.tensor([5]), w)
    with pytest.raises(ConfigError, match="replay width"):
        kda_replay(conv, ssm, replay[..., :-1], torch.tensor([1]), torch.tensor([2]), w)
    assert torch.equal(conv, conv0) and torch.equal(ssm, ssm0)


def test_compute_dtype() -> None:
    assert compute_dtype(torch.bfloat16) == torch.float32
    assert compute_dtype(torch.float32) == torch.float32
    assert compute_dtype(F64) == F64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("length", "chunked"), [(1, False), (4, False), (9, True), (150, True)])
def test_fla_equals_torch_form(dtype: torch.dtype, length: int, chunked: bool) -> None:
    if not fla_available(torch.device("cuda")):
        pytest.skip("flash-linear-attention (fla.ops.kda) does not import")
    # fla's tiles want head dims of at least 16 (KimiLinear's is 128)
    heads, head_dim = 4, 64
    q, k, v, g, beta = _inputs(3, length, length, dtype, "cuda", heads, head_dim)
    g = g.float()
    pool = torch.randn(5, heads, head_dim, head_dim, device="cuda") * 0.1
    ref_pool = pool.clone()
    slots = torch.tensor([4, 0, 2], device="cuda")
    o = kda_scan(q, k, v, g, beta, pool, slots, chunked=chunked, use_fla=True)
    ref = kda_scan(q, k, v, g, beta, ref_pool, slots, chunked=chunked, use_fla=False)
    tol = 5e-2 if dtype == torch.bfloat16 else 5e-3  # fla's dots may run in tf32
    assert o.dtype == dtype
    torch.testing.assert_close(o.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(pool, ref_pool, rtol=tol, atol=tol)
    for s in (1, 3):
        assert torch.equal(pool[s], ref_pool[s])
    # verify: fla's path leaves the slots alone too
    before = pool.clone()
    kda_scan(q, k, v, g, beta, pool, slots, commit=False, chunked=chunked, use_fla=True)
    assert torch.equal(pool, before)


def test_fla_call_convention_through_transformers_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers hands its KDA functions' arguments to fla's kernels unchanged (its hub kernels); a stand-in
    ``fla.ops.kda`` made of those reference functions checks the layouts, dtypes and state plumbing of the fla
    path without CUDA."""
    pytest.importorskip("transformers")
    import inspect
    import sys
    import types

    from transformers.models.kimi_linear import modeling_kimi_linear as hf

    from kvferry.kernels import kda

    calls: list[str] = []

    def checked(name: str, fn: object) -> object:
        def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 **kw: object) -> object:  # fmt: skip
            state = kw["initial_state"]
            assert isinstance(state, torch.Tensor) and state.dtype == torch.float32 and state.is_contiguous()
            assert (
                g.dtype == torch.float32 and beta.dtype == q.dtype and kw["use_qk_l2norm_in_kernel"] is True
            )
            assert all(t.is_contiguous() for t in (q, k, v, g, beta))
            calls.append(name)
            return fn(q, k, v, g, beta, **kw)  # type: ignore[operator]

        return call

    # transformers' torch forms: where fla is installed, its decorators hand the call to fla's kernels instead
    chunk, recurrent = map(inspect.unwrap, (hf.chunk_kimi_delta_attention, hf.recurrent_kimi_delta_attention))
    ops = types.ModuleType("fla.ops.kda")
    ops.chunk_kda = checked("chunk", chunk)  # type: ignore[attr-defined]
    ops.fused_recurrent_kda = checked("recurrent", recurrent)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.kda", ops)
    monkeypatch.setattr(kda, "fla_available", lambda device: True)

    q, k, v, g, beta = _inputs(2, 9, 4, torch.float32)
    pool = torch.randn(4, H, D, D, dtype=F64)  # a float64 cache: the state goes in and out as float32
    ref_pool = pool.clone()
    slots = torch.tensor([3, 1])
    for chunked in (True, False):
        o = kda_scan(q, k, v, g, beta, pool, slots, chunked=chunked)
        ref = kda_scan(q, k, v, g, beta, ref_pool, slots, chunked=chunked, use_fla=False)
        torch.testing.assert_close(o, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool, ref_pool, rtol=1e-5, atol=1e-5)
    before = pool.clone()
    kda_scan(q, k, v, g, beta, pool, slots, commit=False)
    assert torch.equal(pool, before)
    assert calls == ["chunk", "recurrent", "recurrent"]
