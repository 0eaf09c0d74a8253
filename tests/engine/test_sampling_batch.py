"""sample_many: one step's seeded draws of several requests in one batch are sample_tokens' draws, token for token
(float32 and float64 logits, several temperatures, rows of one request at consecutive output positions)."""

from __future__ import annotations

import pytest
import torch

from kvferry.engine.request import Request, SamplingParams
from kvferry.engine.sampling import Draw, sample_many, sample_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_batch_of_draws_is_each_requests_own_draws(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    logits = (torch.randn(12, 97) * 2).to(dtype)
    requests = [
        Request(i, [1], max_tokens=20, sampling=SamplingParams(seed=s, temperature=t))
        for i, (s, t) in enumerate([(3, 1.0), (3, 0.5), (11, 2.0), (0, 0.7)])
    ]
    # (request, first row, rows, first output position): a prefill's row, verify windows, a decode
    draws: list[Draw] = [
        (requests[0], 0, 1, 0),
        (requests[1], 1, 4, 5),
        (requests[2], 5, 3, 2),
        (requests[3], 9, 1, 17),
    ]
    expected = [sample_tokens(r, logits[first : first + n], position) for r, first, n, position in draws]
    assert sample_many(draws, logits) == expected
    assert sample_many([], logits) == []
    # the draws spread: not the argmax of the rows
    assert [t for tokens in expected for t in tokens] != logits[:10].argmax(dim=-1).tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_logits_are_drawn_on_the_host_with_the_same_tokens() -> None:
    torch.manual_seed(2)
    logits = torch.randn(5, 64)
    request = Request(1, [1], max_tokens=20, sampling=SamplingParams(seed=9))
    expected = sample_tokens(request, logits, 4)
    assert sample_many([(request, 0, 5, 4)], logits.cuda()) == [expected]
