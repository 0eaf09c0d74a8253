"""How one model step groups its batch for batched kernels: sequences of the same token count and mode run
together (:class:`Group`), planned once per step by :func:`plan_groups` and shared by every block of the step
(attention, Mamba2, KDA, the drafter)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from attrs import frozen

__all__ = ["Group", "plan_groups"]


@frozen
class Group:
    """Sequences of one batch that run together: same token count and mode (verify or not)."""

    #: positions in the batch
    index: tuple[int, ...]
    #: ``[b, n]`` rows of the flat token tensor
    rows: torch.Tensor
    #: ``[b, n]`` position of each token
    positions: torch.Tensor
    #: ``[b, max_blocks]`` attention page ids, padded with page 0
    block_tables: torch.Tensor
    #: ``[b]`` int64 state slot of each sequence
    slots: torch.Tensor
    verify: bool


def plan_groups(
    rows: Sequence[tuple[int, int, Sequence[int], int, bool]], device: torch.device
) -> list[Group]:
    """Group a batch's sequences for batched kernels: ``rows`` are ``(num_tokens, start, block_table, slot,
    verify)`` per sequence, in batch (= flat token) order."""
    offsets, total = [], 0
    for n, *_ in rows:
        offsets.append(total)
        total += n
    keyed: dict[tuple[int, bool], list[int]] = {}
    for i, (n, _start, _table, _slot, verify) in enumerate(rows):
        keyed.setdefault((n, verify), []).append(i)
    groups = []
    for (n, verify), index in keyed.items():
        width = max(len(rows[i][2]) for i in index)
        tables = [list(rows[i][2]) + [0] * (width - len(rows[i][2])) for i in index]
        groups.append(
            Group(
                index=tuple(index),
                rows=torch.tensor([[offsets[i] + t for t in range(n)] for i in index], device=device),
                positions=torch.tensor([[rows[i][1] + t for t in range(n)] for i in index], device=device),
                block_tables=torch.tensor(tables, dtype=torch.int64, device=device),
                slots=torch.tensor([rows[i][3] for i in index], dtype=torch.int64, device=device),
                verify=verify,
            )
        )
    return groups
