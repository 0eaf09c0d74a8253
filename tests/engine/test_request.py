from __future__ import annotations

import itertools

import pytest
import torch

from kvferry.engine.request import TRANSITIONS, Request, RequestState, SamplingParams, check_transition
from kvferry.engine.sampling import accept_drafts, sample_tokens
from kvferry.errors import ConfigError, InvalidTransition

S = RequestState


def test_transition_table_is_total_and_terminal_states_are_final() -> None:
    assert set(TRANSITIONS) == set(RequestState)
    for state in (S.FINISHED, S.CANCELLED, S.FAILED):
        assert state.is_terminal
        assert TRANSITIONS[state] == frozenset()
    for state in set(RequestState) - {S.FINISHED, S.CANCELLED, S.FAILED}:
        # every live state can be cancelled or failed
        assert {S.CANCELLED, S.FAILED} <= TRANSITIONS[state]


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(RequestState, RequestState)))
def test_every_pair_is_allowed_exactly_when_the_table_says(src: RequestState, dst: RequestState) -> None:
    request = Request(1, [1, 2, 3], max_tokens=4, state=src)
    if dst in TRANSITIONS[src]:
        request.transition(dst)
        assert request.state is dst
    else:
        with pytest.raises(InvalidTransition):
            request.transition(dst)
        assert request.state is src  # a refused transition changes nothing


def test_normal_lives() -> None:
    check_transition(S.WAITING, S.PREFILLING)
    check_transition(S.PREFILLING, S.DECODING)
    check_transition(S.DECODING, S.PREEMPTED)
    check_transition(S.PREEMPTED, S.DECODING)
    check_transition(S.DECODING, S.FINISHED)
    with pytest.raises(InvalidTransition, match="WAITING -> DECODING"):
        check_transition(S.WAITING, S.DECODING)
    with pytest.raises(InvalidTransition):
        check_transition(S.FINISHED, S.DECODING)


def test_request_validation() -> None:
    with pytest.raises(ConfigError):
        Request(1, [], max_tokens=1)
    with pytest.raises(ConfigError):
        Request(1, [1], max_tokens=0)
    with pytest.raises(ConfigError):
        Request(1, [1], max_tokens=1, spec_k=-1)
    with pytest.raises(ConfigError):
        SamplingParams(seed=-1)
    with pytest.raises(ConfigError):
        SamplingParams(seed=1, temperature=0.0)


def test_append_tokens_stops_on_stop_id_and_on_length() -> None:
    request = Request(1, [5], max_tokens=10, stop_ids=[7])
    assert request.append_tokens([1, 7, 9]) == [1, 7]
    assert request.finish_reason == "stop"
    assert request.output_ids == [1, 7]
    request = Request(2, [5], max_tokens=3)
    assert request.append_tokens([1, 2]) == [1, 2]
    assert request.finish_reason is None
    assert request.effective_spec_k() == 0
    assert request.append_tokens([3, 4]) == [3]
    assert request.finish_reason == "length"


def test_effective_spec_k_leaves_room_for_the_bonus_token() -> None:
    request = Request(1, [5], max_tokens=4, spec_k=4)
    assert request.effective_spec_k() == 3
    request.append_tokens([1, 2])
    assert request.effective_spec_k() == 1


def test_acceptance_statistics_and_repr() -> None:
    request = Request(3, [1, 2], max_tokens=8, spec_k=2)
    request.record_draft([4, 5], 1)
    request.record_draft([6, 7], 2)
    assert request.draft_history == [(4, 5), (6, 7)]
    assert request.acceptance_rate == 0.75
    assert "accepted=3/4" in repr(request)


def test_greedy_sampling_is_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    assert sample_tokens(Request(1, [1], max_tokens=2), logits, 0) == [1, 0]


def test_seeded_sampling_depends_only_on_seed_and_position() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    request = Request(1, [1], max_tokens=8, sampling=SamplingParams(seed=42))
    together = sample_tokens(request, logits, 3)
    one_by_one = [sample_tokens(request, logits[i : i + 1], 3 + i)[0] for i in range(6)]
    assert together == one_by_one
    other = Request(2, [1], max_tokens=8, sampling=SamplingParams(seed=43))
    assert sample_tokens(other, logits, 3) != together
    # not simply greedy: with flat logits the draws spread over the vocabulary
    flat = torch.zeros(32, 50)
    assert len(set(sample_tokens(request, flat, 0))) > 10


def test_accept_drafts_counts_the_matching_prefix() -> None:
    assert accept_drafts([1, 2, 3], [1, 2, 3, 4]) == 3
    assert accept_drafts([1, 2, 3], [1, 9, 3, 4]) == 1
    assert accept_drafts([1, 2, 3], [0, 2, 3, 4]) == 0
    assert accept_drafts([], [5]) == 0
