"""The model as the engine drives it: what one step asks of the drafter (:class:`DraftItem`) and the target
(:class:`ForwardItem`), and the :class:`ModelRunner` protocol that answers (``PagedRunner`` is one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from attrs import frozen

__all__ = ["DraftItem", "ForwardItem", "ModelRunner"]


@frozen
class DraftItem:
    """Ask the drafter for ``k`` proposals following ``pending_token`` (at position ``start``)."""

    request_id: int
    pending_token: int
    start: int
    k: int


@frozen
class ForwardItem:
    """Feed ``token_ids`` at positions ``start ..``; return logits for the last ``num_logits`` positions.

    ``verify`` marks a verify window (pending token + ``num_drafts`` drafts): recurrent layers keep the state of
    the last committed token and record the window's inputs for replay.
    """

    request_id: int
    token_ids: tuple[int, ...]
    start: int
    num_logits: int
    num_drafts: int = 0
    verify: bool = False
    #: the request speculates: the runner keeps the target's hidden states for its drafter
    keep_hidden: bool = False


class ModelRunner(Protocol):
    """The model, its drafter and their caches, as one engine step uses them.

    ``propose`` and ``forward`` run together in one step (maybe in a worker thread); ``record_accepted`` and
    ``release`` run on the event loop between steps.

    Optional: ``forward_decodes(request_ids, tokens, starts) -> logits``, the ``forward`` of a step of plain
    decodes (``ForwardItem(request_ids[i], (tokens[i],), starts[i], 1)`` each) from three lists, no object per
    request; its logits need only stay valid until the next step. The engine uses it for a step of plain decodes
    when a runner has it (``PagedRunner`` keeps those rows on the model's decode path from step to step), and for
    the plain decodes of a mixed step, beside ``forward`` of the rest, when they are at most the runner's
    ``decode_path_rows`` (0 or absent: never).
    """

    @property
    def vocab_size(self) -> int: ...

    def propose(self, items: Sequence[DraftItem]) -> list[tuple[int, ...]]:
        """Draft ``item.k`` tokens for each item."""
        ...

    def forward(self, items: Sequence[ForwardItem]) -> torch.Tensor:
        """One target step over every item: float logits ``[sum of num_logits, vocab]``, item after item (one
        tensor, so the engine reads every greedy choice of the step with one argmax)."""
        ...

    def record_accepted(self, request_id: int, num_accepted: int) -> None:
        """After a verify window: ``num_accepted`` of its tokens (pending + accepted drafts) are committed."""
        ...

    def release(self, request_id: int) -> None:
        """Forget per-request host state (the drafter's hidden state). Idempotent."""
        ...
