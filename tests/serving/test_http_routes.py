"""``/v1/models``, ``/health`` and ``/metrics`` over real HTTP, and a shutdown that ends the open streams."""

from __future__ import annotations

import anyio
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from kvferry.serving.http import shut_down
from tests.support.http_server import event_payloads, first_event, serving, until

PROMPT = "metrics"


def samples(text: str) -> dict[str, list[Sample]]:
    """Every sample of a scrape, by metric family name (checking that the text parses)."""
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def value(families: dict[str, list[Sample]], family: str, sample: str, **labels: str) -> float:
    return next(s.value for s in families[family] if s.name == sample and s.labels == labels)


@pytest.mark.anyio
async def test_models_and_health() -> None:
    async with serving() as served, served.client() as client:
        models = await client.get("/v1/models")
        health = await client.get("/health")
    assert models.status_code == 200
    body = models.json()
    assert body["object"] == "list" and len(body["data"]) == 1
    (model,) = body["data"]
    assert model["id"] == "tiny" and model["object"] == "model" and isinstance(model["created"], int)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


@pytest.mark.anyio
async def test_metrics_count_requests_tokens_latencies_and_show_the_pools() -> None:
    async with serving() as served, served.client() as client:
        empty = samples((await client.get("/metrics")).text)
        done = await client.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        )
        assert done.status_code == 200
        after = await client.get("/metrics")
        long = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True}
        async with client.stream("POST", "/v1/completions", json=long) as stream:
            await first_event(stream.aiter_lines())
            running = samples((await client.get("/metrics")).text)
    assert after.headers["content-type"].startswith("text/plain")
    families = samples(after.text)
    assert value(empty, "kvferry_requests", "kvferry_requests_total", finish_reason="length") == 0
    assert value(families, "kvferry_requests", "kvferry_requests_total", finish_reason="length") == 1
    for reason in ("stop", "cancelled", "error"):
        assert value(families, "kvferry_requests", "kvferry_requests_total", finish_reason=reason) == 0
    assert value(families, "kvferry_prompt_tokens", "kvferry_prompt_tokens_total") == len(PROMPT)
    assert value(families, "kvferry_generation_tokens", "kvferry_generation_tokens_total") == 6
    ttft = "kvferry_time_to_first_token_seconds"
    assert value(families, ttft, ttft + "_count") == 1
    itl = "kvferry_inter_token_latency_seconds"
    assert value(families, itl, itl + "_count") == 5  # the gaps between 6 tokens
    assert value(families, itl, itl + "_bucket", le="+Inf") == 5
    e2e = "kvferry_e2e_request_latency_seconds"
    assert value(families, e2e, e2e + "_count") == 1
    # pools and queues, read at the scrape: idle after, busy while a request streams
    assert value(families, "kvferry_pages_total", "kvferry_pages_total") == 511
    assert value(families, "kvferry_pages_used", "kvferry_pages_used") == 0
    assert value(families, "kvferry_requests_running", "kvferry_requests_running") == 0
    assert value(running, "kvferry_requests_running", "kvferry_requests_running") == 1
    assert value(running, "kvferry_requests_waiting", "kvferry_requests_waiting") == 0
    assert value(running, "kvferry_pages_used", "kvferry_pages_used") > 0
    assert value(running, "kvferry_slots_used", "kvferry_slots_used") >= 1
    for gauge in ("kvferry_slots_total", "kvferry_draft_pages_used", "kvferry_draft_pages_total"):
        assert gauge in families
    assert value(families, "kvferry_requests_on_host", "kvferry_requests_on_host") == 0
    # the backend's counts: an aggregated engine transfers nothing
    for counter in ("kvferry_kv_transfers", "kvferry_kv_transfer_bytes", "kvferry_kv_transfers_in_doubt"):
        assert value(families, counter, counter + "_total") == 0
    assert value(families, "kvferry_offloads", "kvferry_offloads_total") == 0


@pytest.mark.anyio
async def test_a_shutdown_ends_open_streams_with_an_error_event_and_done() -> None:
    long = {"prompt": PROMPT, "max_tokens": 1000, "temperature": 0}
    answers: list[httpx.Response] = []
    async with serving() as served, served.client() as client, anyio.create_task_group() as tg:

        async def unstreamed() -> None:
            answers.append(await client.post("/v1/completions", json=long))

        tg.start_soon(unstreamed)
        async with client.stream("POST", "/v1/completions", json={**long, "stream": True}) as stream:
            lines = stream.aiter_lines()
            await first_event(lines)
            await until(lambda: served.service.statistics().active == 2)
            shut_down(served.app)
            rest = "".join([line + "\n" async for line in lines])
        await until(lambda: bool(answers))
        health = await client.get("/health")
        refused = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        stats = served.service.statistics()
    payloads = event_payloads(rest.lstrip("\n"))
    assert payloads[-1] == "[DONE]"
    error = payloads[-2]["error"]
    assert error["code"] == "shutting_down" and error["type"] == "server_error"
    assert all("choices" in chunk for chunk in payloads[:-2])  # tokens that came before the shutdown
    assert health.status_code == 503 and health.json() == {"status": "shutting down"}
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    (unstreamed_answer,) = answers
    assert unstreamed_answer.status_code == 503
    assert unstreamed_answer.json()["error"]["code"] == "shutting_down"
    assert stats.finished["cancelled"] == 2 and stats.active == 0
