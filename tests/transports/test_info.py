"""``kvferry info``: UCX's protocol tables parsed in both formats (UCX 1.21 of ucxx, 1.23 of nixl), and the whole
report on this machine: versions, which transports load, what each uses for host memory, no silent TCP."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvferry.tools.probe import SAME_HOST_PATHS, parse_proto_info

# excerpts of UCX_PROTO_INFO=y output, as the probe processes print it (ucxx's UCX 1.21, then NIXL's 1.23)
UCX_121 = """\
[1796196471.497016] [vm:31742:0]   | ucp_context_0 intra-node cfg#0 | remote memory write by ucp_put* from host memory to host    |
[1796196471.497021] [vm:31742:0]   |                         0..inf | zero-copy                                          | tcp/lo |
[1796196471.497630] [vm:31742:0]   | ucp_context_0 intra-node cfg#0 | tagged message by ucp_tag_send* from host memory         |
[1796196471.497636] [vm:31742:0]   |                          0..92 | eager short                                | sysv/memory |
[1796196471.497638] [vm:31742:0]   |                       93..8191 | eager copy-in copy-out                     | sysv/memory |
[1796196471.497641] [vm:31742:0]   |                        8K..inf | (?) rendezvous fragmented copy-in copy-out | sysv/memory |
"""
UCX_123 = """\
[1796196484.557131] [vm:31778:0]   | nixl-vm-31778-1cfd7bea3995 self cfg#0                    |
[1796196484.557131] [vm:31778:0]   | remote memory write by ucp_put* from host memory to host |
[1796196484.557131] [vm:31778:0]   |   Range   | Description |             Config             |
[1796196484.557131] [vm:31778:0]   |   0..5804 | short       | self/memory                    |
[1796196484.557131] [vm:31778:0]   | 5805..inf | zero-copy   | cma/memory                     |
[1796196484.557891] [vm:31778:0]   | nixl-vm-31778-1cfd7bea3995 intra-node cfg#1                |
[1796196484.557891] [vm:31778:0]   | remote memory write by ucp_put* from host memory to host |
[1796196484.557891] [vm:31778:0]   |   Range   | Description |             Config             |
[1796196484.557891] [vm:31778:0]   |    0..inf | zero-copy   | cma/memory                     |
"""


def test_parse_proto_info_reads_both_formats() -> None:
    rows = parse_proto_info(UCX_121)
    assert [(r["scope"], r["range"], r["protocol"], r["transport"]) for r in rows] == [
        ("intra-node", "0..inf", "zero-copy", "tcp/lo"),
        ("intra-node", "0..92", "eager short", "sysv/memory"),
        ("intra-node", "93..8191", "eager copy-in copy-out", "sysv/memory"),
        ("intra-node", "8K..inf", "(?) rendezvous fragmented copy-in copy-out", "sysv/memory"),
    ]
    assert rows[1]["operation"].startswith("tagged message by ucp_tag_send*")
    rows = parse_proto_info(UCX_123)
    assert [(r["scope"], r["range"], r["transport"]) for r in rows] == [
        ("self", "0..5804", "self/memory"),
        ("self", "5805..inf", "cma/memory"),
        ("intra-node", "0..inf", "cma/memory"),
    ]
    assert all(r["operation"].startswith("remote memory write by ucp_put*") for r in rows)
    assert parse_proto_info("no tables here\n| a | b |\n") == []


@pytest.mark.timeout(300)
def test_kvferry_info_reports_the_transports_of_this_machine() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvferry", "info", "--json", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["versions"]["kvferry"] and info["versions"]["torch"]
    for name in ("nixl", "ucx", "local"):
        assert info["transports"][name]["loads"], info["transports"][name]
    for name in ("nixl", "ucx"):
        probe = info["transports"][name]["memory"]["cpu"]
        assert probe["ok"], probe
        assert probe["operations"], probe  # the protocols UCX chose for the data path
        assert probe["same_host"] == SAME_HOST_PATHS[(name, "cpu")]
        assert probe["ucx_version"]
        # loopback only (the tests' UCX_NET_DEVICES=lo): a data path through TCP would be a silent fallback
        data = next(iter(probe["operations"].values()))
        assert not any(entry["transport"].startswith("tcp") for entry in data), probe
