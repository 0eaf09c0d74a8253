"""Two "hosts" on one machine: two network namespaces joined by a veth pair, for tests of engines on separate
hosts.

:func:`host_pair` creates two uniquely named namespaces (parallel runs do not collide), a veth pair between them
with an address at each end of a /30, loopback up in each, and tears all of it down when the block ends, however
it ends: every process started in either namespace is killed, then the namespaces are deleted (which deletes the
veth pair with them).

:meth:`NetnsHost.start` starts a process inside one namespace *and* in a PID namespace of its own
(``ip netns exec NS unshare --pid --fork --mount-proc --kill-child CMD``): kvferry's transports take their
same-host shortcuts (``process_vm_readv``/``writev``, CUDA IPC) only for a peer that proves its pid in the
handshake, and a peer in another PID namespace cannot, so the two sides talk as two hosts would. Killing the
``unshare`` (:meth:`HostProcess.kill`) kills its whole PID namespace (``--kill-child`` sends SIGKILL to the
namespace's init, and the kernel takes every other process in it along).

:func:`separate_host_env` is the environment that keeps UCX (under UCXX and NIXL alike) off shared memory: TCP
only, over the veth device only, with UCX's protocol choices logged so that a test can read them back
(:func:`ucx_protocol_transports`).
"""

from __future__ import annotations

import functools
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager, suppress
from typing import IO, Any

from attrs import define, field, frozen

__all__ = [
    "HostPair",
    "HostProcess",
    "NamespaceError",
    "NetnsHost",
    "host_pair",
    "namespaces_unavailable",
    "separate_host_env",
    "ucx_protocol_transports",
]

#: seconds each ``ip`` command may take
IP_TIMEOUT = 20.0
#: seconds a killed process has to be reaped
REAP_TIMEOUT = 10.0

# one request per thread, the answers as JSON: [[status, body], ...] (stdlib only: it starts in a blink)
_HTTP_CLIENT = """
import json, sys, threading, urllib.error, urllib.request
url, timeout, bodies = sys.argv[1], float(sys.argv[2]), json.loads(sys.stdin.read())
answers = [None] * len(bodies)
def post(i):
    request = urllib.request.Request(url, json.dumps(bodies[i]).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            answers[i] = [response.status, response.read().decode()]
    except urllib.error.HTTPError as exc:
        answers[i] = [exc.code, exc.read().decode()]
    except OSError as exc:
        answers[i] = [0, repr(exc)]
threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps(answers))
"""


class NamespaceError(RuntimeError):
    """An ``ip`` command failed while setting up the namespaces."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT, check=False)
    if check and done.returncode != 0:
        raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


def _drain(stream: IO[str], sink: list[str], lines: queue.Queue[str] | None) -> None:
    for line in stream:
        sink.append(line)
        if lines is not None:
            lines.put(line)


@define(eq=False)
class HostProcess:
    """A command started by :meth:`NetnsHost.start`. Threads read its stdout and stderr as they come (a full
    pipe would stall it): ``stdout`` and ``stderr`` hold every line so far."""

    popen: subprocess.Popen[str]
    stdout: list[str] = field(factory=list)
    stderr: list[str] = field(factory=list)
    _lines: queue.Queue[str] = field(factory=queue.Queue)
    _threads: list[threading.Thread] = field(factory=list)

    def __attrs_post_init__(self) -> None:
        for stream, sink, lines in (
            (self.popen.stdout, self.stdout, self._lines),
            (self.popen.stderr, self.stderr, None),
        ):
            if stream is not None:
                thread = threading.Thread(target=_drain, args=(stream, sink, lines), daemon=True)
                thread.start()
                self._threads.append(thread)

    def output(self) -> str:
        """Everything it printed on stderr so far."""
        return "".join(self.stderr)

    def read_line(self, prefix: str, timeout: float) -> str:
        """Its next stdout line that starts with ``prefix``, without the prefix.

        :raises AssertionError: it exits first, or ``timeout`` seconds pass.
        """
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self._lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.popen.poll() is not None and self._lines.empty():
                    self.join_output()
                    if self._lines.empty():
                        raise AssertionError(f"exited ({self.popen.returncode}):\n{self.output()}") from None
                continue
            if line.startswith(prefix):
                return line[len(prefix) :].rstrip("\n")
        raise AssertionError(f"no {prefix!r} line within {timeout} s:\n{self.output()}")

    def wait_stderr(self, pattern: str, timeout: float) -> re.Match[str]:
        """The first match of ``pattern`` in its stderr, once it is there.

        :raises AssertionError: it exits first, or ``timeout`` seconds pass.
        """
        deadline = time.monotonic() + timeout
        while (match := re.search(pattern, self.output())) is None:
            if self.popen.poll() is not None:
                self.join_output()
                if (match := re.search(pattern, self.output())) is not None:
                    return match
                raise AssertionError(f"exited ({self.popen.returncode}):\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} within {timeout} s:\n{self.output()}")
            time.sleep(0.05)
        return match

    def send(self, line: str) -> None:
        """Write ``line`` and a newline to its stdin."""
        assert self.popen.stdin is not None
        self.popen.stdin.write(line + "\n")
        self.popen.stdin.flush()

    def command_pid(self) -> int:
        """The pid (in this PID namespace) of the command itself, the ``unshare``'s child."""
        children = f"/proc/{self.popen.pid}/task/{self.popen.pid}/children"
        with open(children) as f:
            return int(f.read().split()[0])

    def signal_command(self, signum: signal.Signals) -> None:
        """Send ``signum`` to the command itself (``kill()`` ends the whole PID namespace at once)."""
        os.kill(self.command_pid(), signum)

    def kill(self) -> None:
        """SIGKILL it, with everything it started."""
        if self.popen.poll() is None:
            self.popen.kill()

    def wait(self, timeout: float) -> int:
        """Its exit status (``subprocess.TimeoutExpired`` after ``timeout`` seconds); its output read to the end."""
        status = self.popen.wait(timeout)
        self.join_output()
        return status

    def join_output(self) -> None:
        for thread in self._threads:
            thread.join(REAP_TIMEOUT)

    def close(self) -> None:
        """Kill it, reap it, close its pipes."""
        self.kill()
        with suppress(subprocess.TimeoutExpired):
            self.popen.wait(REAP_TIMEOUT)
        self.join_output()
        for stream in (self.popen.stdin, self.popen.stdout, self.popen.stderr):
            if stream is not None:
                with suppress(OSError):
                    stream.close()


@define(eq=False)
class NetnsHost:
    """One side: a network namespace with one end of the veth pair (``device``) at ``address``."""

    namespace: str
    device: str
    address: str
    #: every process started here (killed at teardown)
    processes: list[HostProcess] = field(factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in this namespace and in a PID namespace of its own."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespace,
            "unshare",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            *argv,
        ]

    def start(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, stdin: bool = False
    ) -> HostProcess:
        """Start ``argv`` here (see the module docstring), its stdin a pipe when ``stdin`` (else empty)."""
        popen = subprocess.Popen(
            self.command(argv),
            env=dict(os.environ if env is None else env),
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        process = HostProcess(popen)
        self.processes.append(process)
        return process

    def run(self, argv: Sequence[str], *, timeout: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` here to its end (``subprocess.TimeoutExpired`` after ``timeout`` seconds, killed)."""
        return subprocess.run(
            self.command(argv), capture_output=True, text=True, timeout=timeout, check=False, **kwargs
        )

    def post_json(self, url: str, bodies: Sequence[object], *, timeout: float) -> list[tuple[int, str]]:
        """POST each of ``bodies`` (as JSON, all at once) to ``url`` from this namespace: (status, body) each;
        status 0 (body: the error) where no response came."""
        done = self.run(
            [sys.executable, "-c", _HTTP_CLIENT, url, str(timeout)],
            timeout=timeout + 10,
            input=json.dumps(bodies),
        )
        if done.returncode != 0:
            raise AssertionError(f"HTTP client failed ({done.returncode}): {done.stderr}")
        return [(status, body) for status, body in json.loads(done.stdout)]

    def tx_bytes(self) -> int:
        """Bytes sent out of this side's veth device so far."""
        done = _ip("-n", self.namespace, "-s", "-j", "link", "show", "dev", self.device)
        info: list[dict[str, Any]] = json.loads(done.stdout)
        return int(info[0]["stats64"]["tx"]["bytes"])

    def pids(self) -> list[int]:
        """Every process in this network namespace, as this (the outer) PID namespace numbers them."""
        done = _ip("netns", "pids", self.namespace, check=False)
        return [int(pid) for pid in done.stdout.split() if pid.isdigit()]

    def kill_all(self) -> None:
        """SIGKILL everything started here (and anything else still in the namespace), and reap it."""
        for process in self.processes:
            process.kill()
        for pid in self.pids():
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for process in self.processes:
            process.close()


@frozen
class HostPair:
    """Two namespaces joined by a veth pair: ``a`` and ``b`` reach each other at their ``address``."""

    a: NetnsHost
    b: NetnsHost


def _unique() -> tuple[str, int, int]:
    """A tag for names (pid + random: unique among parallel runs) and the second and third octets of a /30."""
    tag = f"{os.getpid() % 100000:05d}{secrets.token_hex(2)}"
    return tag, 64 + secrets.randbelow(128), secrets.randbelow(64) * 4


@contextmanager
def host_pair() -> Iterator[HostPair]:
    """Two namespaces joined by a veth pair (see the module docstring), torn down when the block ends.

    :raises NamespaceError: they cannot be created (then nothing is left behind).
    """
    tag, second, third = _unique()
    # device names: at most 15 characters (IFNAMSIZ)
    a = NetnsHost(f"kvf-{tag}-a", f"kv{tag}a", f"10.{second}.{third}.1")
    b = NetnsHost(f"kvf-{tag}-b", f"kv{tag}b", f"10.{second}.{third}.2")
    with ExitStack() as cleanup:
        for host in (a, b):
            _ip("netns", "add", host.namespace)
            cleanup.callback(_ip, "netns", "delete", host.namespace, check=False)
            cleanup.callback(host.kill_all)  # runs first: nothing may outlive its namespace's deletion
        _ip("link", "add", a.device, "type", "veth", "peer", "name", b.device)
        # while both ends are still here, deleting one deletes the pair; once moved, the namespaces own them
        cleanup.callback(_ip, "link", "delete", a.device, check=False)
        for host in (a, b):
            _ip("link", "set", host.device, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/30", "dev", host.device)
            _ip("-n", host.namespace, "link", "set", host.device, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield HostPair(a, b)


@functools.cache
def namespaces_unavailable() -> str | None:
    """Why two namespaces with processes in them cannot be made here, or None when they can (tried once)."""
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    try:
        with host_pair() as pair:
            done = pair.a.run(["true"], timeout=IP_TIMEOUT)
            if done.returncode != 0:
                return f"cannot start a process in a PID namespace of its own: {done.stderr.strip()}"
    except (NamespaceError, OSError, subprocess.SubprocessError) as exc:
        where = "" if os.geteuid() == 0 else " (not root)"
        return f"cannot create network namespaces joined by a veth pair{where}: {exc}"
    return None


def separate_host_env(
    host: NetnsHost, secret: bytes, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``base`` (default: this process's environment) for a process on ``host``: UCX over TCP on its veth
    device alone (no shared memory, CMA, CUDA IPC or loopback), the shared ``secret`` in ``$KVFERRY_SECRET``,
    UCX's protocol choices logged on stderr (``UCX_PROTO_INFO``) for :func:`ucx_protocol_transports`."""
    env = dict(os.environ if base is None else base)
    env.pop("KVFERRY_SECRET_FILE", None)
    env.update(
        {
            "UCX_TLS": "tcp",
            "UCX_NET_DEVICES": host.device,
            "UCX_PROTO_INFO": "y",
            "UCX_LOG_FILE": "stderr",
            "UCX_WARN_UNUSED_ENV_VARS": "n",
            "UCXPY_PROGRESS_MODE": "blocking",
            "KVFERRY_SECRET": secret.decode(),
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


# a cell of a UCX protocol table naming the transport and device that carry a range of sizes: "| tcp/eth0 |"
_UCX_LANE = re.compile(r"\|\s*([a-z][a-z0-9_]*/[A-Za-z0-9_.:-]+)\s*\|")


def ucx_protocol_transports(log: str) -> tuple[set[str], set[str]]:
    """From the UCX protocol tables in ``log`` (``UCX_PROTO_INFO=y``): the transports they chose
    (``"tcp/DEVICE"``) and how UCX placed the peers (``"inter-node"``, ``"intra-node"``)."""
    lanes = {match.group(1) for match in _UCX_LANE.finditer(log)}
    placements = set(re.findall(r"\b(inter-node|intra-node)\b", log))
    return lanes, placements
