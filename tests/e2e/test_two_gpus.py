"""The context engine on one GPU and the generation engine on another (``kvferry demo --ctx-device cuda:0
--device cuda:1``), in two processes over NIXL and UCX, TP mismatch included: every request identical to
aggregated serving. Skips where torch sees fewer than two GPUs or the transport is not installed."""

from __future__ import annotations

import pytest
import torch

from kvferry.transports.registry import available_transports
from tests.disagg.test_demo import run_demo

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
    ),
]


@pytest.mark.parametrize(("transport", "ctx_tp", "gen_tp"), [("nixl", 1, 1), ("nixl", 2, 1), ("ucx", 1, 2)])
def test_context_and_generation_engines_on_their_own_gpus_give_aggregated_tokens(
    transport: str, ctx_tp: int, gen_tp: int
) -> None:
    if transport not in available_transports():
        pytest.skip(f"{transport} is not installed")
    result = run_demo(
        "--dtype",
        "float32",
        "--transport",
        transport,
        "--ctx-tp",
        str(ctx_tp),
        "--gen-tp",
        str(gen_tp),
        "--ctx-device",
        "cuda:0",
        "--device",
        "cuda:1",
    )
    assert result["identical"] is True and result["mismatched_requests"] == []
