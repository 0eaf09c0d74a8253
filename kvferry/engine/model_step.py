"""What one engine step asks of the :class:`~kvferry.engine.model_runner.ModelRunner`, for a plan of the scheduler.

:func:`run_model` runs the drafter and the target over a plan and reads the greedy choice of every logits row;
:func:`launch_model` launches a step of plain decodes and returns the wait for its choices instead, for a device
that computes asynchronously (``EngineConfig.launch_on_loop``). A step of plain decodes (:func:`plain_decodes`)
reaches the runner through its ``forward_decodes`` when it has one: three lists, no object per request; so do
the plain decodes of a mixed step, beside the rest of it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable

import torch

from kvferry.engine.model_runner import DraftItem, ForwardItem, ModelRunner
from kvferry.engine.sampling import GreedyReadback, greedy_rows
from kvferry.engine.scheduler import ItemKind, StepItem, StepPlan

__all__ = ["forward_item", "launch_model", "launch_ready", "plain_decodes", "run_model"]

#: a step's drafts by request id, and its logits
Launched = tuple[dict[int, tuple[int, ...]], torch.Tensor]


def plain_decodes(plan: StepPlan) -> bool:
    """Whether every item of ``plan`` is a plain decode: one token, no drafts, not speculating."""
    decode = ItemKind.DECODE
    return all(i.kind is decode and not i.num_drafts and not i.request.spec_k for i in plan.items)


def launch_ready(runner: ModelRunner, plan: StepPlan) -> bool:
    """Whether the plain decodes of ``plan`` launch at once on the runner (its ``decode_path_ready``; a runner
    without it: they do). A step that would not (a first graph capture, a step that reads values back) goes to
    the worker thread even with ``launch_on_loop``, so that it does not hold the event loop."""
    ready = getattr(runner, "decode_path_ready", None)
    return ready is None or bool(ready(len(plan.items)))


def forward_item(item: StepItem, drafts: tuple[int, ...]) -> ForwardItem:
    """The target's share of ``item``, with the drafts proposed for it."""
    request = item.request
    keep = request.spec_k > 0
    if item.kind is ItemKind.PREFILL:
        return ForwardItem(
            request.request_id, item.token_ids, item.start, int(item.wants_logits), keep_hidden=keep
        )
    tokens = item.token_ids + drafts
    return ForwardItem(
        request.request_id, tokens, item.start, len(tokens), len(drafts), verify=keep, keep_hidden=keep
    )


def forward_plain(runner: ModelRunner, plan: StepPlan) -> torch.Tensor:
    """The target step of a plan of plain decodes: the runner's ``forward_decodes`` when it has one."""
    items = plan.items
    fast = getattr(runner, "forward_decodes", None)
    if fast is None:
        return runner.forward([forward_item(item, ()) for item in items])
    return fast(  # type: ignore[no-any-return]
        [i.request.request_id for i in items], [i.token_ids[0] for i in items], [i.start for i in items]
    )


def run_model(
    runner: ModelRunner, plan: StepPlan, plain: bool = False
) -> tuple[dict[int, tuple[int, ...]], torch.Tensor, list[int]]:
    """Drafter and target step, and the greedy choice of every logits row (reading it waits for an accelerator
    to finish the step, so it belongs to the model's time, not the host's). ``plain``: the plan is
    :func:`plain_decodes`."""
    if plain:
        logits = forward_plain(runner, plan)
        return {}, logits, greedy_rows(logits)
    speculative = [item for item in plan.items if item.kind is ItemKind.DECODE and item.num_drafts]
    drafts: dict[int, tuple[int, ...]] = {}
    if speculative:
        proposals = runner.propose(
            [DraftItem(i.request.request_id, i.token_ids[0], i.start, i.num_drafts) for i in speculative]
        )
        for item, proposal in zip(speculative, proposals, strict=True):
            drafts[item.request.request_id] = tuple(proposal)
    forward = [forward_item(item, drafts.get(item.request.request_id, ())) for item in plan.items]
    decode = ItemKind.DECODE
    plain_items = [
        i
        for i, item in enumerate(plan.items)
        if item.kind is decode and not item.num_drafts and not item.request.spec_k
    ]
    # apart only where they take a path of their own (else one step of the general path over all of them)
    apart = 0 < len(plain_items) <= getattr(runner, "decode_path_rows", 0)
    logits = _forward_split(runner, forward, plain_items) if apart else runner.forward(forward)
    return drafts, logits, greedy_rows(logits)


def _forward_split(runner: ModelRunner, forward: list[ForwardItem], plain: list[int]) -> torch.Tensor:
    # A mixed step: its plain decodes through the runner's forward_decodes, the rest (prompt chunks, verify
    # windows) through forward, first (a one-token chunk among them may run the decode path, whose outputs the
    # plain decodes' logits are), then the logits in item order again
    is_plain = [False] * len(forward)
    for i in plain:
        is_plain[i] = True
    rest = [item for item, fast in zip(forward, is_plain, strict=True) if not fast]
    rest_logits = runner.forward(rest)
    plain_logits = runner.forward_decodes(  # type: ignore[attr-defined]
        [forward[i].request_id for i in plain],
        [forward[i].token_ids[0] for i in plain],
        [forward[i].start for i in plain],
    )
    order: list[int] = []
    rest_row, plain_row = 0, rest_logits.shape[0]
    for item, fast in zip(forward, is_plain, strict=True):
        if fast:
            order.append(plain_row)
            plain_row += 1
        else:
            order.extend(range(rest_row, rest_row + item.num_logits))
            rest_row += item.num_logits
    both = torch.cat((rest_logits, plain_logits))
    return both[torch.tensor(order, device=both.device)]


def launch_model(
    runner: ModelRunner, plan: StepPlan, spin_seconds: float
) -> tuple[Launched, Callable[[], Awaitable[list[int]]]]:
    """A step of plain decodes launched (on the event loop): no drafts, its logits, and the wait for their greedy
    choices (:meth:`GreedyReadback.wait <kvferry.engine.sampling.GreedyReadback.wait>`, polled from the loop for
    up to ``spin_seconds`` while the device computes)."""
    logits = forward_plain(runner, plan)
    readback = GreedyReadback(logits)
    return ({}, logits), functools.partial(readback.wait, spin_seconds)
