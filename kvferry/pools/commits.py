"""Commits: tokens whose KV (and state) a model step wrote, checked as one batch and then recorded.

A commit appends tokens to an ACTIVE request within its capacity; tokens inside the prompt must be the
prompt's. ``num_pending_replay`` of the committed tokens are not in the live slot yet (they sit in the replay
buffers after a verify step), and the slot's position never moves backwards. Recording a commit hashes the
blocks it fills into the prefix index, indexes the draft blocks that became final, and takes a snapshot when the
slot's position lands on a boundary (:mod:`kvferry.pools.prefix`).

Every commit of a batch is checked, against the state the earlier ones leave, before any is recorded: a refusal
changes nothing. This runs for every request every engine step, so the checks are inlined and blocks are
hashed only when they fill up.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kvferry.errors import InvalidTransition
from kvferry.pools.draft_mirror import DraftMirror
from kvferry.pools.lifecycle import CacheState, require_state
from kvferry.pools.prefix import PrefixReuse
from kvferry.pools.rank_pools import RankPools
from kvferry.pools.record import RequestId, RequestRecord, find_record, token_list
from kvferry.wire import INT64_MAX, INT64_MIN

__all__ = ["Commit", "StagedCommit", "check_commits", "record_commits"]

#: ``(request id, token ids, num_pending_replay)``
Commit = tuple[RequestId, Sequence[int] | np.ndarray, int]
#: ``(record, token ids as Python ints, num_pending_replay)``
StagedCommit = tuple[RequestRecord, list[int], int]


def check_commits(
    records: Mapping[RequestId, RequestRecord], commits: Iterable[Commit]
) -> list[StagedCommit]:
    """Check every commit, in order, against the state the earlier ones leave. Changes nothing.

    :raises ~kvferry.errors.InvalidTransition: if a request is not ACTIVE, its tokens exceed its capacity,
        disagree with the prompt, or its slot position would move backwards.
    :raises ~kvferry.errors.UnknownRequest: if a request does not exist.
    :raises ~kvferry.errors.ConfigError: if token ids are not 64-bit integers.
    """
    active = CacheState.ACTIVE
    staged: list[StagedCommit] = []
    # (committed tokens, slot position) of requests committed earlier in this batch
    ahead: dict[RequestId, tuple[int, int]] = {}
    for request_id, token_ids, num_pending_replay in commits:
        record = records.get(request_id)
        if record is None or record.state is not active:
            require_state(request_id, find_record(records, request_id).state, "commit")
        assert record is not None
        if type(token_ids) is list:  # what the engine passes: checked here, without a call
            tokens = token_ids
            for t in tokens:
                if type(t) is not int or not INT64_MIN <= t <= INT64_MAX:
                    tokens = token_list(token_ids)  # converts, or raises ConfigError
                    break
        else:
            tokens = token_list(token_ids)
        state = ahead.get(request_id)
        if state is None:
            start = len(record.tokens)
            position = start - record.pending_replay
        else:
            start, position = state
        total = start + len(tokens)
        if total > record.capacity:
            raise InvalidTransition(
                f"commit of {request_id!r}: {total} tokens exceed capacity {record.capacity}"
            )
        prompt = record.prompt
        if start < len(prompt):
            overlap = min(total, len(prompt)) - start
            if tokens[:overlap] != prompt[start : start + overlap]:
                raise InvalidTransition(f"commit of {request_id!r}: tokens disagree with the prompt")
        if not 0 <= num_pending_replay <= total or total - num_pending_replay < position:
            raise InvalidTransition(
                f"commit of {request_id!r}: num_pending_replay {num_pending_replay} would move the slot "
                f"from {position} to {total - num_pending_replay}"
            )
        staged.append((record, tokens, num_pending_replay))
        ahead[request_id] = (total, total - num_pending_replay)
    return staged


def record_commits(
    staged: Iterable[StagedCommit], pools: RankPools, prefix: PrefixReuse, draft_mirror: DraftMirror
) -> None:
    """Append checked commits and index what they complete. Cannot fail: registering owned pages and taking
    best-effort snapshots never raise."""
    config = pools.config
    tpb = config.tokens_per_block
    draft_tpb = config.draft_tokens_per_block if pools.draft is not None else 0
    snapshots = config.enable_reuse and pools.slots is not None
    for record, tokens, num_pending_replay in staged:
        record.tokens.extend(tokens)
        record.pending_replay = num_pending_replay
        total = len(record.tokens)
        if len(record.block_hashes) < total // tpb:
            prefix.hash_full_blocks(record, total // tpb)
        if draft_tpb and record.draft_valid - len(record.draft_hashes) * draft_tpb >= draft_tpb:
            draft_mirror.hash_blocks(record)
        position = total - num_pending_replay
        if (
            snapshots
            and position > record.last_snapshot
            and position % tpb == 0
            and prefix.is_boundary(record, position)
        ):
            prefix.take_snapshot(record, position)
