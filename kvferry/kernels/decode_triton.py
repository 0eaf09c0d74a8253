"""The Triton kernels of a decode step (imported only where Triton is used; the callers and the torch forms are
in :mod:`~kvferry.kernels.mamba_decode` and :mod:`~kvferry.kernels.paged_decode`).

Each kernel is built on first use (``functools.cache``): Triton decides at build time whether its interpreter
runs it (``TRITON_INTERPRET=1``), and the interpreter looks ``triton.language`` up in this module's globals.
No annotations but constexpr: Triton resolves a jitted function's annotations as globals.
"""

from __future__ import annotations

import functools
from typing import Any

import triton
import triton.language as tl

__all__ = [
    "add_rms_norm_kernel",
    "conv_kernel",
    "gated_group_norm_kernel",
    "paged_decode_kernel",
    "ssm_kernel",
]


@functools.cache
def conv_kernel() -> Any:
    @triton.jit  # type: ignore[untyped-decorator]
    def conv_update_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        x_row_stride,
        states_ptr,
        state_slot_stride,
        state_channel_stride,
        slots_ptr,
        weight_ptr,
        bias_ptr,
        out_ptr,
        out_row_stride,
        channels,
        WIDTH: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0)
        channel = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = channel < channels
        slot = tl.load(slots_ptr + row).to(tl.int64)
        window = states_ptr + slot * state_slot_stride + channel * state_channel_stride
        x = tl.load(x_ptr + row * x_row_stride + channel, mask=mask, other=0.0).to(tl.float32)
        # out = sum_j window[j] * w[j] + x * w[WIDTH]; the window then drops its oldest input and takes x
        acc = x * tl.load(weight_ptr + channel * (WIDTH + 1) + WIDTH, mask=mask, other=0.0).to(tl.float32)
        previous = tl.load(window, mask=mask, other=0.0)
        for j in tl.static_range(WIDTH):
            w = tl.load(weight_ptr + channel * (WIDTH + 1) + j, mask=mask, other=0.0).to(tl.float32)
            acc += previous.to(tl.float32) * w
            if j + 1 < WIDTH:
                following = tl.load(window + j + 1, mask=mask, other=0.0)
                tl.store(window + j, following, mask=mask)
                previous = following
        tl.store(window + WIDTH - 1, x.to(states_ptr.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + channel, mask=mask, other=0.0).to(tl.float32)
        out = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + row * out_row_stride + channel, out.to(out_ptr.dtype.element_ty), mask=mask)

    return conv_update_kernel


@functools.cache
def ssm_kernel() -> Any:
    @triton.jit  # type: ignore[untyped-decorator]
    def ssm_update_kernel(  # type: ignore[no-untyped-def]
        x_ptr,
        x_row_stride,
        dt_ptr,
        dt_row_stride,
        a_ptr,
        b_ptr,
        b_row_stride,
        c_ptr,
        c_row_stride,
        d_ptr,
        dt_bias_ptr,
        states_ptr,
        state_slot_stride,
        slots_ptr,
        y_ptr,
        y_row_stride,
        dt_min,
        head_dim,
        state_size,
        heads_per_group,
        BLOCK_P: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        p_mask = p < head_dim
        n_mask = n < state_size
        group = head // heads_per_group
        slot = tl.load(slots_ptr + row).to(tl.int64)

        raw = tl.load(dt_ptr + row * dt_row_stride + head).to(tl.float32)
        raw += tl.load(dt_bias_ptr + head).to(tl.float32)
        # softplus as torch computes it (threshold 20), then the floor
        dt = tl.where(raw > 20.0, raw, tl.log(1.0 + tl.exp(tl.minimum(raw, 20.0))))
        dt = tl.maximum(dt, dt_min)
        decay = tl.exp(dt * tl.load(a_ptr + head).to(tl.float32))

        x = tl.load(x_ptr + row * x_row_stride + head * head_dim + p, mask=p_mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * b_row_stride + group * state_size + n, mask=n_mask, other=0.0).to(
            tl.float32
        )
        c = tl.load(c_ptr + row * c_row_stride + group * state_size + n, mask=n_mask, other=0.0).to(
            tl.float32
        )
        cell = (
            states_ptr + slot * state_slot_stride + (head * head_dim + p[:, None]) * state_size + n[None, :]
        )
        mask = p_mask[:, None] & n_mask[None, :]
        state = tl.load(cell, mask=mask, other=0.0).to(tl.float32)
        state = state * decay + (dt * x)[:, None] * b[None, :]
        tl.store(cell, state.to(states_ptr.dtype.element_ty), mask=mask)
        y = tl.sum(state * c[None, :], axis=1) + tl.load(d_ptr + head).to(tl.float32) * x
        tl.store(y_ptr + row * y_row_stride + head * head_dim + p, y.to(y_ptr.dtype.element_ty), mask=p_mask)

    return ssm_update_kernel


@functools.cache
def paged_decode_kernel() -> Any:
    @triton.jit  # type: ignore[untyped-decorator]
    def paged_decode_attention_kernel(  # type: ignore[no-untyped-def]
        q_ptr,
        q_row_stride,
        k_ptr,
        v_ptr,
        k_page_stride,
        k_head_stride,
        k_token_stride,
        v_page_stride,
        v_head_stride,
        v_token_stride,
        tables_ptr,
        table_row_stride,
        lengths_ptr,
        out_ptr,
        out_row_stride,
        scale,
        group,
        head_dim,
        TOKENS_PER_BLOCK: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        # one program per (sequence, kv head): the query heads of its group against the sequence's pages, read
        # in place, with a running (online) softmax
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        t = tl.arange(0, BLOCK_T)
        g_mask = g < group
        d_mask = d < head_dim
        q_heads = kv_head * group + g
        q = tl.load(
            q_ptr + row * q_row_stride + q_heads[:, None] * head_dim + d[None, :],
            mask=g_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        length = tl.load(lengths_ptr + row)
        best = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        for block in range(0, tl.cdiv(length, TOKENS_PER_BLOCK)):
            page = tl.load(tables_ptr + row * table_row_stride + block).to(tl.int64)
            visible = (t < TOKENS_PER_BLOCK) & (block * TOKENS_PER_BLOCK + t < length)
            k_cell = page * k_page_stride + kv_head * k_head_stride + t[:, None] * k_token_stride + d[None, :]
            v_cell = page * v_page_stride + kv_head * v_head_stride + t[:, None] * v_token_stride + d[None, :]
            kv_mask = visible[:, None] & d_mask[None, :]
            # positions a query may not see are never loaded: garbage (NaN, inf) in them stays out
            k = tl.load(k_ptr + k_cell, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + v_cell, mask=kv_mask, other=0.0).to(q.dtype)
            scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            scores = tl.where(visible[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            rescale = tl.exp(best - new_best)
            weights = tl.exp(scores - new_best[:, None])
            total = total * rescale + tl.sum(weights, axis=1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
            best = new_best
        out = acc / total[:, None]
        tl.store(
            out_ptr + row * out_row_stride + q_heads[:, None] * head_dim + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=g_mask[:, None] & d_mask[None, :],
        )

    return paged_decode_attention_kernel


@functools.cache
def add_rms_norm_kernel() -> Any:
    @triton.jit  # type: ignore[untyped-decorator]
    def add_rms_norm(  # type: ignore[no-untyped-def]
        x_ptr,
        delta_ptr,
        weight_ptr,
        sum_ptr,
        normed_ptr,
        width,
        eps,
        HAS_DELTA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # one program per row: sum = x + delta (the residual stream), normed = weight * sum / rms(sum)
        row = tl.program_id(0).to(tl.int64)
        column = tl.arange(0, BLOCK)
        mask = column < width
        x = tl.load(x_ptr + row * width + column, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            x += tl.load(delta_ptr + row * width + column, mask=mask, other=0.0).to(tl.float32)
            tl.store(sum_ptr + row * width + column, x.to(sum_ptr.dtype.element_ty), mask=mask)
        inverse = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
        weight = tl.load(weight_ptr + column, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            normed_ptr + row * width + column,
            (x * inverse * weight).to(normed_ptr.dtype.element_ty),
            mask=mask,
        )

    return add_rms_norm


@functools.cache
def gated_group_norm_kernel() -> Any:
    @triton.jit  # type: ignore[untyped-decorator]
    def gated_group_norm(  # type: ignore[no-untyped-def]
        y_ptr,
        z_ptr,
        z_row_stride,
        weight_ptr,
        out_ptr,
        width,
        group_size,
        eps,
        BLOCK: tl.constexpr,
    ):
        # one program per (row, group of channels): gate = y * silu(z), out = weight * gate / rms over the group
        row = tl.program_id(0).to(tl.int64)
        column = tl.program_id(1) * group_size + tl.arange(0, BLOCK)
        mask = tl.arange(0, BLOCK) < group_size
        y = tl.load(y_ptr + row * width + column, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * z_row_stride + column, mask=mask, other=0.0).to(tl.float32)
        gate = y * z / (1.0 + tl.exp(-z))
        inverse = 1.0 / tl.sqrt(tl.sum(gate * gate, axis=0) / group_size + eps)
        weight = tl.load(weight_ptr + column, mask=mask, other=0.0).to(tl.float32)
        tl.store(
            out_ptr + row * width + column, (gate * inverse * weight).to(out_ptr.dtype.element_ty), mask=mask
        )

    return gated_group_norm
