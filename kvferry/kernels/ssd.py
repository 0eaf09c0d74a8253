"""Mamba2's chunked scan (the SSD form of a prefill chunk) through flash-linear-attention's
``chunk_simple_gla`` on CUDA.

Per head, Mamba2 carries a ``[head_dim, state_size]`` state ``h`` and per token runs
``h = exp(dt * A) * h + (dt * x) (outer) B``, ``y = h . C + D * x``. That is gated linear attention with one
log decay per head and token, in fla's terms ``S = exp(g) * S + k (outer) v``, ``o = scale * q . S``, with
``q = C``, ``k = B``, ``v = dt * x``, ``g = dt * A``, ``scale = 1`` and the state kept value-first
(``state_v_first``: ``[V, K]`` = ``[head_dim, state_size]``, kvferry's slot layout). fla keeps the state in
float32 inside the chunk and between chunks; kvferry's torch form (:func:`kvferry.model.mamba2.ssm_chunk_scan`,
the CPU's float64 oracle) carries it in the inputs' dtype.
"""

from __future__ import annotations

import torch

from kvferry.kernels.fla import fla_ops, fla_runs

__all__ = ["MIN_DIM", "fla_ssd", "fla_ssd_runs"]

#: fla's tiles want head dims and state sizes of at least this many elements
MIN_DIM = 16


def fla_ssd_runs(device: torch.device, dtype: torch.dtype, head_dim: int, state_size: int) -> bool:
    """Whether :func:`fla_ssd` runs for these inputs: CUDA with ``fla.ops.simple_gla``, not float64 (the oracle's
    dtype stays on kvferry's arithmetic), dims of at least :data:`MIN_DIM`."""
    return dtype != torch.float64 and min(head_dim, state_size) >= MIN_DIM and fla_runs("simple_gla", device)


def fla_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor,
    *,
    final: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scan of a chunk from ``state``: ``(y, final_state)`` (``final_state`` None unless ``final``).

    :param x: ``[batch, length, heads, head_dim]``; ``dt`` ``[batch, length, heads]`` discretised (after bias,
        softplus and the floor); ``B``/``C`` ``[batch, length, heads, state_size]`` (groups expanded to heads);
        ``A``, ``D`` ``[heads]``; ``state`` ``[batch, heads, head_dim, state_size]``.
    :return: ``y`` in ``x``'s dtype (D skip included, no gate); the final state in float32.
    """
    ops = fla_ops("simple_gla")  # optional: no stubs, imported only on CUDA
    dtype = x.dtype
    g = (dt.float() * A.float()).contiguous()
    v = (x * dt[..., None].to(dtype)).contiguous()
    o, final_state = ops.chunk_simple_gla(
        C.to(dtype).contiguous(),
        B.to(dtype).contiguous(),
        v,
        g,
        scale=1.0,
        initial_state=state.float().contiguous(),
        output_final_state=final,
        state_v_first=True,
    )
    return o.to(dtype) + D.to(dtype)[:, None] * x, final_state
