"""Choosing tokens from logits, and accepting draft tokens.

Greedy is argmax. Seeded sampling uses the Gumbel-max rule with noise drawn from a generator seeded by
``(seed, output position)`` only: the same request draws the same token at the same position whether it ran
alone or batched, in any chunking, with or without speculative decoding. That makes seeded sampling a test
oracle as strong as greedy decoding.

Draft acceptance by the match rule: the target samples its own token at every verified position (greedy or
seeded) and a draft is accepted while it equals that token. For a deterministic (greedy) drafter this is exact
speculative sampling: a draft ``d`` is accepted with probability ``p(d)`` and on rejection the target's own
sample is kept, which is distributed as ``p`` restricted to tokens other than ``d``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import anyio
import torch

from kvferry.engine.request import Request
from kvferry.engine.scheduler import ItemKind, StepItem

__all__ = [
    "Draw",
    "GreedyReadback",
    "accept_drafts",
    "greedy_rows",
    "sample_many",
    "sample_seeded",
    "sample_tokens",
]

_MIX = 0x9E3779B97F4A7C15  # golden-ratio odd constant: spreads (seed, position) over the 63-bit seed space


def _position_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def sample_tokens(request: Request, logits: torch.Tensor, first_output_index: int) -> list[int]:
    """One token per row of ``logits`` ([n, vocab]); row ``i`` is output position ``first_output_index + i``."""
    if request.sampling.is_greedy:
        return [int(t) for t in torch.argmax(logits, dim=-1).tolist()]
    generator = request.generator
    assert generator is not None and request.sampling.seed is not None
    # drawn on the CPU, where the request's generator lives: the same token on every device
    scaled = logits.to("cpu", torch.float64) / request.sampling.temperature
    tokens: list[int] = []
    for i in range(scaled.shape[0]):
        generator.manual_seed(_position_seed(request.sampling.seed, first_output_index + i))
        uniform = torch.rand(scaled.shape[-1], generator=generator, dtype=torch.float64)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
        tokens.append(int(torch.argmax(scaled[i] + gumbel)))
    return tokens


#: ``(request, first logits row, number of rows, output position of the first row)``: one request's seeded draw
Draw = tuple[Request, int, int, int]


def sample_many(draws: Sequence[Draw], logits: torch.Tensor) -> list[list[int]]:
    """:func:`sample_tokens` for several seeded requests' rows of one step's ``logits``, the same tokens: the rows
    move to the host once (one transfer, in float64), every row's noise comes from its own ``(seed, position)``
    generator as there, and one argmax picks every token."""
    if not draws:
        return []
    index = [first + i for _, first, n, _ in draws for i in range(n)]
    rows = logits.detach()[torch.tensor(index, device=logits.device)].to("cpu", torch.float64)
    vocab = rows.shape[-1]
    noise = torch.empty(len(index), vocab, dtype=torch.float64)
    temperature = torch.empty(len(index), 1, dtype=torch.float64)
    j = 0
    for request, _, n, position in draws:
        generator, seed = request.generator, request.sampling.seed
        assert generator is not None and seed is not None
        for i in range(n):
            generator.manual_seed(_position_seed(seed, position + i))
            torch.rand(vocab, generator=generator, dtype=torch.float64, out=noise[j])
            temperature[j] = request.sampling.temperature
            j += 1
    # the same float64 operations as sample_tokens, row by row: the same tokens
    gumbel = -torch.log(-torch.log(noise.clamp_min(1e-300)))
    tokens: list[int] = (rows / temperature + gumbel).argmax(dim=-1).tolist()
    out, j = [], 0
    for _, _, n, _ in draws:
        out.append(tokens[j : j + n])
        j += n
    return out


def sample_seeded(items: Sequence[StepItem], logits: torch.Tensor) -> dict[int, list[int]]:
    """The tokens of every seeded request's logits rows in a step of ``items``, by item index (one batch, see
    :func:`sample_many`)."""
    draws: list[Draw] = []
    indices: list[int] = []
    offset = 0
    for index, item in enumerate(items):
        request = item.request
        if item.kind is ItemKind.DECODE:
            rows = 1 + item.num_drafts
        else:
            rows = 1 if item.start + len(item.token_ids) == request.num_prompt else 0
        if rows and request.sampling.seed is not None:
            draws.append((request, offset, rows, len(request.output_ids)))
            indices.append(index)
        offset += rows
    return dict(zip(indices, sample_many(draws, logits), strict=True))


def accept_drafts(drafts: Sequence[int], target_tokens: Sequence[int]) -> int:
    """How many leading drafts match the target's own choices (``target_tokens`` has ``len(drafts) + 1``)."""
    n = 0
    for draft, target in zip(drafts, target_tokens, strict=False):
        if draft != target:
            break
        n += 1
    return n


def greedy_rows(logits: torch.Tensor) -> list[int]:
    """Argmax of every row of the step at once (on the CPU numpy's argmax is several times faster than torch's)."""
    if logits.shape[0] == 0:
        return []
    rows = logits.detach()
    if rows.device.type == "cpu":
        if rows.dtype not in (torch.float32, torch.float64):
            rows = rows.to(torch.float32)
        return rows.numpy().argmax(axis=-1).tolist()  # type: ignore[no-any-return]
    return rows.argmax(dim=-1).tolist()


class GreedyReadback:
    """The greedy choice of every row of a step's logits, read back without blocking the host: on CUDA one argmax
    on the device, its result copied to pinned host memory behind the step, and an event that says when it
    arrived (:meth:`wait` polls it from the event loop). Elsewhere the choice is made at once."""

    __slots__ = ("_event", "_host", "_tokens")

    def __init__(self, logits: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        self._tokens: list[int] | None = None
        rows = logits.detach()
        if rows.device.type != "cuda" or rows.shape[0] == 0:
            self._tokens = greedy_rows(rows)
            return
        self._host = torch.empty(rows.shape[0], dtype=torch.int64, pin_memory=True)
        self._host.copy_(rows.argmax(dim=-1), non_blocking=True)
        self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self._event.record(torch.cuda.current_stream(rows.device))  # the device of the logits

    def ready(self) -> bool:
        """Whether the tokens are on the host (the step ended)."""
        return self._event is None or bool(self._event.query())  # type: ignore[no-untyped-call]

    def result(self) -> list[int]:
        """The tokens, one per row (waits for the device when not :meth:`ready`)."""
        if self._tokens is None:
            assert self._event is not None
            self._event.synchronize()
            self._tokens = self._host.tolist()
        return self._tokens

    async def wait(self, spin_seconds: float) -> list[int]:
        """The tokens, yielding to the event loop while the device computes: polled between yields for up to
        ``spin_seconds``, then waited for in a worker thread (a long step does not keep the loop spinning).
        Not cancellable (as a step in a worker thread): the step's device work ends before this returns."""
        with anyio.CancelScope(shield=True):
            deadline = time.perf_counter() + spin_seconds
            while not self.ready():
                if time.perf_counter() > deadline:
                    await anyio.to_thread.run_sync(self.result)
                    break
                await anyio.lowlevel.checkpoint()
        return self.result()
