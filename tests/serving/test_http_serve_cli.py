"""``kvferry serve`` as a real process: it says where it listens, SIGTERM ends open streams with an error event
and ``[DONE]`` and exits 0, and ``--disagg --transport local`` gives the aggregated engine's tokens."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvferry.cli import main
from kvferry.engine.runner import EngineOptions, build_engine
from tests.support.http_server import DTYPE, event_payloads, first_event

REPO = Path(__file__).resolve().parents[2]
#: seconds the process has to start listening (imports, engine build) and to exit once signalled
START_DEADLINE = 120.0
EXIT_DEADLINE = 30.0
LISTENING = re.compile(rb"kvferry serve: listening on (http://\S+) \(model tiny, (\w+)")


class Serve:
    """A running ``kvferry serve`` and what it wrote on stderr."""

    def __init__(self, process: anyio.abc.Process) -> None:
        self.process = process
        self.stderr = b""
        self.url = ""
        self.mode = ""

    async def read_until_listening(self) -> None:
        assert self.process.stderr is not None
        with anyio.fail_after(START_DEADLINE):
            while (match := LISTENING.search(self.stderr)) is None:
                try:
                    self.stderr += await self.process.stderr.receive()
                except anyio.EndOfStream:
                    raise AssertionError(f"serve exited before listening:\n{self.stderr.decode()}") from None
        self.url, self.mode = match.group(1).decode(), match.group(2).decode()

    async def exit_status(self) -> int:
        """Wait for the exit (reading the rest of stderr)."""
        assert self.process.stderr is not None
        with anyio.fail_after(EXIT_DEADLINE):
            async for data in self.process.stderr:
                self.stderr += data
            return await self.process.wait()


@asynccontextmanager
async def serve(*flags: str) -> AsyncIterator[Serve]:
    argv = [sys.executable, "-m", "kvferry", "serve", "--port", "0", "--dtype", DTYPE, *flags]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    process = await anyio.open_process(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env)
    try:
        running = Serve(process)
        await running.read_until_listening()
        yield running
    finally:
        if process.returncode is None:
            process.kill()
            with anyio.CancelScope(shield=True), anyio.move_on_after(EXIT_DEADLINE):
                await process.wait()
        await process.aclose()


@pytest.mark.anyio
async def test_sigterm_ends_open_streams_with_an_error_event_and_exits_0() -> None:
    request = {"prompt": "a long one", "max_tokens": 1900, "temperature": 0, "stream": True}
    async with (
        serve("--num-pages", "1024") as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as client,
    ):
        assert server.mode == "aggregated"
        async with client.stream("POST", "/v1/completions", json=request) as stream:
            lines = stream.aiter_lines()
            await first_event(lines)
            server.process.send_signal(signal.SIGTERM)
            with anyio.fail_after(EXIT_DEADLINE):
                rest = "".join([line + "\n" async for line in lines])
        status = await server.exit_status()
    payloads = event_payloads(rest.lstrip("\n"))
    assert payloads[-2]["error"]["code"] == "shutting_down"
    assert status == 0, server.stderr.decode()
    stderr = server.stderr.decode()
    assert "SIGTERM: shutting down" in stderr and "Traceback" not in stderr, stderr


@pytest.mark.anyio
async def test_disaggregated_over_local_gives_the_aggregated_tokens() -> None:
    prompt = list(b"disaggregated, then decoded")
    built = build_engine("tiny", EngineOptions(dtype=DTYPE, step_in_thread=False))
    async with built.engine:
        expected = await built.engine.generate(prompt, max_tokens=16).collect()
    request = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "return_token_ids": True}
    async with (
        serve("--disagg", "--transport", "local") as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as client,
    ):
        assert server.mode == "disaggregated"
        whole = await client.post("/v1/completions", json=request)
        streamed = await client.post("/v1/completions", json={**request, "stream": True})
        metrics = (await client.get("/metrics")).text
        server.process.send_signal(signal.SIGINT)
        status = await server.exit_status()
    assert whole.status_code == 200 and whole.json()["choices"][0]["token_ids"] == expected
    chunks = event_payloads(streamed.text)[:-1]
    assert [t for chunk in chunks for t in chunk["choices"][0]["token_ids"]] == expected
    transfers = next(f for f in text_string_to_metric_families(metrics) if f.name == "kvferry_kv_transfers")
    assert transfers.samples[0].value == 2  # each request's cache crossed over
    assert status == 0, server.stderr.decode()


def test_contradictory_flags_and_a_busy_port_are_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--disagg", "--tp", "2"]) == 2
    assert "with --disagg give --gen-tp" in capsys.readouterr().err
    assert main(["serve", "--ctx-tp", "2", "--transport", "local"]) == 2
    assert "--transport, --ctx-tp only apply with --disagg" in capsys.readouterr().err
    assert main(["serve", "--ctx-device", "cpu"]) == 2
    assert "--ctx-device only apply with --disagg" in capsys.readouterr().err
    assert main(["serve", "--disagg", "--ctx-device", "tpu"]) == 2
    assert "--ctx-device 'tpu': expected cpu, cuda or cuda:N" in capsys.readouterr().err
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        assert main(["serve", "--port", str(port), "--dtype", DTYPE]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and err.count("\n") == 1, err
