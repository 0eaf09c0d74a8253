"""Context and generation engines on two "hosts": two network namespaces joined by a veth pair, each engine in a
PID namespace of its own too (tests/support/netns.py), UCX on TCP over the veth alone. Nothing is shared: no
shared memory, no same-host shortcut (the pid proof of the handshake fails across PID namespaces), only the
network.

- ``kvferry serve --role context --listen`` on host A, ``kvferry serve --role generation --context`` on host B,
  HTTP requests sent on host B: the tokens are the aggregated engine's, the bytes crossed the veth, UCX chose
  TCP on the veth device for every protocol and saw the peer as another node;
- the context engine killed mid-transfer: the generation engine's request ends in a typed transfer error (it
  does not hang), the engine keeps serving, and a new context engine on host A serves it again;
- the generation engine killed mid-transfer: the context engine lives on and serves a new generation engine
  (``kvferry serve --role generation``) over HTTP, then exits 0 when told to.

The tests that kill an engine mid-transfer drive the generation engine through tests/support/generation_peer.py
(it says when part of a transfer has landed) and run the context engine as ``python -m kvferry.disagg.serve``
(what ``kvferry serve --role context`` runs, with ``--write-delay`` to make its transfers last).

The whole module skips, with the reason, where the namespaces cannot be created (e.g. not root); each transport
skips where its extra is missing.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import pytest

from kvferry.disagg.serve import _options
from kvferry.engine.runner import EngineOptions, build_engine
from kvferry.transports.registry import available_transports
from tests.support import SUPPORT
from tests.support.netns import (
    HostPair,
    HostProcess,
    NetnsHost,
    host_pair,
    namespaces_unavailable,
    separate_host_env,
    ucx_protocol_transports,
)

pytestmark = pytest.mark.timeout(120)

#: seconds any one wait may take (a process starting, a request, a reply)
DEADLINE = 60.0
SECRET = b"separate-hosts-secret-0123456789abcdef"
DTYPE = "float64"
PROMPTS = [list(f"request number {i} from host b".encode()) for i in range(4)]
MAX_TOKENS = 8
# the driven generation engine (tests/support/generation_peer.py) decodes with 2 draft tokens
SPEC_K = 2
ROUTED = [(7 * i + 3) % 256 for i in range(60)]
LOCAL = [(11 * i + 5) % 256 for i in range(20)]
OPTIONS = _options(1, SPEC_K, 0, DTYPE)
# a context engine whose transfers last, so that a peer can die in the middle of one: chunks of 1 KiB, each
# posted after a pause
PACED = ["--spec-k", str(SPEC_K), "--write-delay", "0.05", "--chunk-bytes", "1024"]


@pytest.fixture(scope="module", autouse=True)
def namespaces() -> None:
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(params=["nixl", "ucx"])
def transport(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    missing = available_transports()[name]
    if missing is not None:
        pytest.skip(f"{name}: {missing}")
    return name


@pytest.fixture
def pair() -> Iterator[HostPair]:
    with host_pair() as made:
        yield made


def environment(host: NetnsHost) -> dict[str, str]:
    env = separate_host_env(host, SECRET)
    env["PYTHONPATH"] = str(SUPPORT.parents[1])
    return env


def aggregated(prompts: list[list[int]], options: EngineOptions, spec_k: int = 0) -> list[list[int]]:
    """The tokens one aggregated engine in this process decodes for ``prompts``."""

    async def run() -> list[list[int]]:
        built = build_engine("tiny", options)
        async with built.engine:
            return [
                await built.engine.generate(p, max_tokens=MAX_TOKENS, spec_k=spec_k).collect()
                for p in prompts
            ]

    return anyio.run(run)


def start_context_role(host: NetnsHost, transport: str) -> tuple[HostProcess, str]:
    """``kvferry serve --role context`` listening on ``host``'s veth address; the process and its address."""
    argv = ["--role", "context", "--listen", f"{host.address}:0", "--transport", transport, "--dtype", DTYPE]
    process = host.start([sys.executable, "-m", "kvferry", "serve", *argv], env=environment(host))
    address = process.wait_stderr(r"context engine listening at (\S+) ", DEADLINE).group(1)
    assert address.startswith(f"{transport}://{host.address}:"), address
    return process, address


def start_generation_role(
    host: NetnsHost, transport: str, context: str, *flags: str
) -> tuple[HostProcess, str]:
    """``kvferry serve --role generation`` fed by ``context``, its HTTP server on ``host``; the process and the
    completions URL."""
    argv = ["--role", "generation", "--context", context, "--transport", transport, "--dtype", DTYPE]
    argv += ["--host", host.address, "--port", "0", *flags]
    process = host.start([sys.executable, "-m", "kvferry", "serve", *argv], env=environment(host))
    url = process.wait_stderr(r"listening on (http://\S+) ", DEADLINE).group(1)
    return process, url + "/v1/completions"


def start_context_process(host: NetnsHost, transport: str, *flags: str) -> HostProcess:
    """A context engine (``python -m kvferry.disagg.serve``, which takes ``--write-delay``) starting on ``host``;
    it serves generation engines until its stdin closes (:func:`context_address` waits for it to listen)."""
    argv = ["--transport", transport, "--host", host.address, "--forever", "--dtype", DTYPE, *flags]
    return host.start(
        [sys.executable, "-m", "kvferry.disagg.serve", *argv], env=environment(host), stdin=True
    )


def context_address(process: HostProcess) -> str:
    """The address of the context engine :func:`start_context_process` started, once it listens."""
    address: str = json.loads(process.read_line("kvferry-context ", DEADLINE))["address"]
    return address


def ask(host: NetnsHost, url: str, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy completions of ``prompts`` (all at once) from ``host``: their token ids."""
    bodies = [
        {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True} for p in prompts
    ]
    answers = host.post_json(url, bodies, timeout=DEADLINE)
    for status, body in answers:
        assert status == 200, body
    return [json.loads(body)["choices"][0]["token_ids"] for _, body in answers]


def namespaces_of(pid: int) -> tuple[int, int]:
    """The network and PID namespaces of process ``pid``."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino, os.stat(f"/proc/{pid}/ns/pid").st_ino


def assert_tcp_over_veth(pair: HostPair, context: HostProcess, generation: HostProcess) -> None:
    """UCX (under either transport) chose TCP on the veth device for every protocol it logged, and placed the
    peer on another node; the context side (the writer) logged some."""
    lanes, placements = ucx_protocol_transports(context.output())
    assert lanes == {f"tcp/{pair.a.device}"}, lanes
    assert placements == {"inter-node"}, placements
    lanes, placements = ucx_protocol_transports(generation.output())
    assert lanes <= {f"tcp/{pair.b.device}"}, lanes
    assert "intra-node" not in placements, placements


def stop(process: HostProcess) -> None:
    """SIGTERM the command: it shuts down, exit 0, no traceback."""
    process.signal_command(signal.SIGTERM)
    assert process.wait(DEADLINE) == 0, process.output()
    assert "Traceback" not in process.output(), process.output()


def test_serve_roles_on_two_hosts(transport: str, pair: HostPair) -> None:
    context, address = start_context_role(pair.a, transport)
    generation, url = start_generation_role(pair.b, transport, address)
    # two hosts as far as the engines can tell: other network and PID namespaces than each other's and ours
    pids = (context.command_pid(), generation.command_pid(), os.getpid())
    for kind in zip(*(namespaces_of(pid) for pid in pids), strict=True):
        assert len(set(kind)) == 3, kind
    sent = pair.a.tx_bytes()
    assert ask(pair.b, url, PROMPTS) == aggregated(PROMPTS, EngineOptions(dtype=DTYPE))
    assert pair.a.tx_bytes() > sent  # the caches went from host A to host B over the veth
    assert_tcp_over_veth(pair, context, generation)
    stop(generation)
    stop(context)


class Driver:
    """tests/support/generation_peer.py on a host: commands out, replies (``@@{...}`` lines) back by id."""

    def __init__(self, host: NetnsHost, transport: str) -> None:
        program = [sys.executable, str(SUPPORT / "generation_peer.py"), transport]
        self.process = host.start(program, env=environment(host), stdin=True)
        self.replies: dict[int, dict[str, Any]] = {}
        self.sent = 0
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> None:
        """Wait for its engine and transport to be up (its first line)."""
        self.ready = json.loads(self.process.read_line("@@", DEADLINE))

    def send(self, op: str, **fields: Any) -> int:
        self.sent += 1
        self.process.send(json.dumps({"id": self.sent, "op": op, **fields}))
        return self.sent

    def reply(self, command: int) -> dict[str, Any]:
        """The reply to ``command``: an AssertionError when none comes within :data:`DEADLINE`."""
        while command not in self.replies:
            reply = json.loads(self.process.read_line("@@", DEADLINE))
            self.replies[reply.pop("id")] = reply
        return self.replies.pop(command)

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        reply = self.reply(self.send(op, **fields))
        assert "error" not in reply or op == "generate", reply
        return reply


def test_context_killed_mid_transfer(transport: str, pair: HostPair) -> None:
    context = start_context_process(pair.a, transport, *PACED)
    driver = Driver(pair.b, transport)
    (expected_routed,) = aggregated([ROUTED], OPTIONS, SPEC_K)  # while they start
    (expected_local,) = aggregated([LOCAL], OPTIONS, SPEC_K)
    driver.wait_ready()
    connected = driver.call("connect", address=context_address(context))
    # the handshake could not prove the peer on this host: no process_vm_writev/readv, no CUDA IPC
    assert connected["same_host"] is False, connected
    assert connected["pid_namespace"] != driver.ready["pid_namespace"], connected
    assert driver.call("generate", prompt=ROUTED, max_tokens=MAX_TOKENS)["tokens"] == expected_routed

    request = driver.send("generate", prompt=ROUTED, max_tokens=MAX_TOKENS)
    driver.call("mid_transfer")  # some chunk has landed, some has not
    context.kill()
    failed = driver.reply(request)  # within DEADLINE: no hang
    # typed, and from the peer's death, not from a stall timer running out
    assert failed.get("typed") and "TransferError" in failed["kinds"], failed
    assert "TransferTimeout" not in failed["kinds"] and "disconnected" in failed["message"], failed
    assert_tcp_over_veth(pair, context, driver.process)

    # the generation engine serves on: alone, then with a new context engine on host A
    assert driver.call("local", prompt=LOCAL, max_tokens=MAX_TOKENS)["tokens"] == expected_local
    idle = driver.call("idle")
    assert idle["links"] == [{"gone": True, "in_flight": 0}] and idle["sessions"] == [0], idle
    context = start_context_process(pair.a, transport, "--spec-k", str(SPEC_K))
    assert driver.call("connect", address=context_address(context))["same_host"] is False
    assert driver.call("generate", prompt=ROUTED, max_tokens=MAX_TOKENS)["tokens"] == expected_routed
    idle = driver.call("idle")
    # the dead engine's link, with nothing left in flight, was forgotten when the next request was routed
    assert idle["links"] == [{"gone": False, "in_flight": 0}] and idle["sessions"] == [0], idle
    assert idle["cma_reads"] == 0, idle  # UCX: no bytes read out of the writer's memory
    driver.send("exit")
    assert driver.process.wait(DEADLINE) == 0, driver.process.output()


def test_generation_killed_mid_transfer(transport: str, pair: HostPair) -> None:
    context = start_context_process(pair.a, transport, *PACED)
    driver = Driver(pair.b, transport)
    expected = aggregated(PROMPTS[:1], OPTIONS, SPEC_K)  # while they start
    address = context_address(context)
    driver.wait_ready()
    assert driver.call("connect", address=address)["same_host"] is False
    driver.send("generate", prompt=ROUTED, max_tokens=MAX_TOKENS)
    driver.call("mid_transfer")
    driver.process.kill()
    # the context engine lives on and serves the next generation engine (whether or not it has seen the
    # dead one go yet: its pushes to it end with the connection, or with a typed error logged in one line)
    assert context.popen.poll() is None, context.output()
    generation, url = start_generation_role(pair.b, transport, address, "--spec-k", str(SPEC_K))
    assert ask(pair.b, url, PROMPTS[:1]) == expected
    assert_tcp_over_veth(pair, context, generation)
    stop(generation)
    assert context.popen.stdin is not None
    context.popen.stdin.close()  # how its parent ends it
    assert context.wait(DEADLINE) == 0, context.output()
    assert "Traceback" not in context.output(), context.output()
