"""TLS on the control channel: both sides present certificates of one CA; the secret is still checked inside."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch

from kvferry.errors import ConfigError, PeerDisconnected, PeerIncompatible
from kvferry.transports import get_transport
from kvferry.transports.handshake import TlsConfig, new_secret

trustme = pytest.importorskip("trustme")
pytestmark = pytest.mark.anyio
SECRET = new_secret()


def tls_files(ca: object, directory: Path, name: str) -> TlsConfig:
    cert = ca.issue_cert("127.0.0.1", "localhost")  # type: ignore[attr-defined]
    chain, ca_file = directory / f"{name}.pem", directory / f"{name}-ca.pem"
    cert.private_key_and_cert_chain_pem.write_to_path(str(chain))
    ca.cert_pem.write_to_path(str(ca_file))  # type: ignore[attr-defined]
    return TlsConfig.from_files(str(chain), str(chain), str(ca_file))


@pytest.mark.parametrize("name", ["nixl", "ucx", "local"])
async def test_peers_talk_and_write_over_tls(name: str, tmp_path: Path) -> None:
    ca = trustme.CA()
    a_tls, b_tls = tls_files(ca, tmp_path, "a"), tls_files(ca, tmp_path, "b")
    factory = get_transport(name)
    with anyio.fail_after(30):
        async with factory(secret=SECRET, tls=a_tls) as a, factory(secret=SECRET, tls=b_tls) as b:
            pa = await a.connect(b.address)
            pb = await b.accept()
            src, dst = torch.arange(4096, dtype=torch.uint8), torch.zeros(4096, dtype=torch.uint8)
            await a.register(src)
            await b.grant(pb, await b.register(dst))
            await b.send_message(pb, b"over tls")
            assert await a.receive_message(pa) == b"over tls"
            await a.write(pa, [[src.data_ptr(), 4096]], [[dst.data_ptr(), 4096]], b"done")
            assert await b.receive_notification(pb) == b"done"
            assert torch.equal(src, dst)


async def test_a_peer_without_tls_or_with_another_ca_is_refused(tmp_path: Path) -> None:
    ca, other = trustme.CA(), trustme.CA()
    factory = get_transport("local")
    with anyio.fail_after(30):
        async with factory(secret=SECRET, tls=tls_files(ca, tmp_path, "server")) as server:
            async with factory(secret=SECRET) as plain:
                with pytest.raises((PeerDisconnected, PeerIncompatible)):
                    await plain.connect(server.address, timeout=5)
            async with factory(secret=SECRET, tls=tls_files(other, tmp_path, "stranger")) as stranger:
                with pytest.raises(PeerDisconnected):
                    await stranger.connect(server.address, timeout=5)
            assert server.statistics().peers == 0
            assert server.statistics().refused_connections >= 2


def test_tls_files_that_do_not_exist_are_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot set up TLS"):
        TlsConfig.from_files(str(tmp_path / "no.pem"), str(tmp_path / "no.key"), str(tmp_path / "ca.pem"))
