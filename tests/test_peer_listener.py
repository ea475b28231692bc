"""The peer listener: a token first, then only LOOKUP/GET/PUT/PING, local tiers only."""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trustme

from kvtier import Client, State, wire
from kvtier.config import load_config
from kvtier.core.propagation import RemoteSpec, WritePolicy
from kvtier.daemon import Daemon
from kvtier.errors import ConfigError, DaemonUnavailableError, ErrorCode, ForbiddenError
from kvtier.tiers.memory import MemoryRemoteTier
from kvtier.wire import Op
from tests.helpers import running_daemon, wait_until

TOKEN = "peer-secret-1"


@pytest.fixture
async def daemon(sock_dir: Path) -> AsyncIterator[Daemon]:
    async with running_daemon(
        sock_dir, peer={"listen": "127.0.0.1:0", "token": TOKEN}, disk={"enabled": False}
    ) as d:
        yield d


async def peer(d: Daemon, token: bytes = TOKEN.encode(), **kw: object) -> Client:
    assert d.peer_port is not None
    return await Client.connect_tcp("127.0.0.1", d.peer_port, token=token, **kw)  # type: ignore[arg-type]


def refused(d: Daemon, reason: str) -> float:
    assert d.peer_server is not None
    return d.peer_server.counters.connections_refused.value(reason)


async def test_a_peer_with_the_token_may_lookup_get_put_and_ping(daemon: Daemon) -> None:
    async with await peer(daemon) as c:
        assert c.server is not None and c.server.node_id == daemon.node_id
        assert await c.ping(b"x") == b"x"
        await c.put(b"k", b"v" * 100)
        assert bytes(await c.get(b"k") or b"") == b"v" * 100
        assert (await c.lookup([b"k", b"nope"])).states == [State.HIT, State.MISS]
        for call in (
            c.stats(),
            c.reserve([b"a"], [10]),
            c.release(b"tag"),
            c.abort([b"a"]),
            c.delete(b"k"),
        ):
            with pytest.raises(ForbiddenError, match="not allowed on the peer port"):
                await call
        assert await c.ping() == b""  # still connected after the refusals
    assert daemon.ram.contains(b"k")  # DELETE was refused


async def test_delete_is_allowed_when_enabled(sock_dir: Path) -> None:
    async with running_daemon(
        sock_dir,
        peer={"listen": "127.0.0.1:0", "token": TOKEN, "allow_delete": True},
        disk={"enabled": False},
    ) as d:
        async with await peer(d) as c:
            await c.put(b"k", b"v")
            assert await c.delete(b"k") is True
        assert not d.ram.contains(b"k")


@pytest.mark.parametrize(("token", "reason"), [(b"wrong-secret", "bad_token"), (b"", "no_token")])
async def test_a_wrong_or_missing_token_is_refused_and_counted(
    daemon: Daemon, token: bytes, reason: str
) -> None:
    with pytest.raises(ForbiddenError, match="peer authentication failed"):
        await peer(daemon, token=token)
    assert refused(daemon, reason) == 1
    assert daemon.peer_server is not None
    await wait_until(lambda: not daemon.peer_server.connections)  # type: ignore[union-attr]


async def test_a_plain_client_is_refused_before_anything_is_read(daemon: Daemon) -> None:
    assert daemon.peer_port is not None
    # A kvtier client that skips HELLO: its PUT is never acted on.
    reader, writer = await asyncio.open_connection("127.0.0.1", daemon.peer_port)
    meta, data = wire.encode_put([b"k"], [b"value"])
    writer.writelines(wire.frame_parts(Op.PUT, 1, meta, data))
    header = wire.unpack_header(await reader.readexactly(wire.HEADER_SIZE))
    assert header.status == ErrorCode.FORBIDDEN
    await reader.readexactly(header.meta_len + header.data_len)
    assert await reader.read() == b""  # closed by the daemon
    writer.close()
    # Something that is not kvtier at all, and a frame too big to be a HELLO.
    for payload in (
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        wire.pack_header(Op.HELLO, 2, 0, 1 << 20),
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", daemon.peer_port)
        writer.write(payload)
        assert await reader.read() != b""  # one error frame, then EOF
        writer.close()
    assert refused(daemon, "not_hello") == 3
    assert not daemon.ram.contains(b"k")
    assert daemon.ram.stats().blocks == 0


async def test_peer_requests_are_answered_from_local_tiers_only(sock_dir: Path) -> None:
    remote = MemoryRemoteTier("mem")
    remote.blocks[b"only-remote"] = b"r"
    async with running_daemon(
        sock_dir,
        remote_tiers=[RemoteSpec(remote, WritePolicy.WRITE_THROUGH, 1 << 20)],
        peer={"listen": "127.0.0.1:0", "token": TOKEN},
        disk={"enabled": False},
    ) as d:
        async with await peer(d) as c:
            # Not forwarded: the remote tier is never asked.
            assert (await c.lookup([b"only-remote"], wait=1.0)).states == [State.MISS]
            assert await c.get(b"only-remote") is None
            assert remote.lookup_calls == [] and remote.load_calls == []
            # A pushed block is kept here and not written out to the remote tier.
            await c.put(b"pushed", b"p")
            await d.settle()
            assert d.ram.contains(b"pushed")
            assert b"pushed" not in remote.blocks and remote.store_calls == []
        # The engines' own socket still reaches the remote tier.
        async with await Client.connect(d.socket_path) as local:
            assert (await local.lookup([b"only-remote"], wait=1.0)).states[0] in (
                State.HIT,
                State.PENDING,
            )


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_files(ca: trustme.CA, tmp: Path, name: str) -> dict[str, str]:
    cert = ca.issue_cert("127.0.0.1", "localhost")
    cert.private_key_pem.write_to_path(str(tmp / f"{name}.key"))
    cert.cert_chain_pems[0].write_to_path(str(tmp / f"{name}.crt"))
    ca.cert_pem.write_to_path(str(tmp / "ca.pem"))
    return {
        "tls_cert": str(tmp / f"{name}.crt"),
        "tls_key": str(tmp / f"{name}.key"),
        "tls_ca": str(tmp / "ca.pem"),
    }


async def test_tls_admits_peers_of_the_ca_and_refuses_others(
    sock_dir: Path, ca: trustme.CA
) -> None:
    files = tls_files(ca, sock_dir, "a")
    async with running_daemon(
        sock_dir,
        peer={"listen": "127.0.0.1:0", "token": TOKEN, **files},
        disk={"enabled": False},
    ) as d:
        good = ssl.create_default_context(cafile=files["tls_ca"])
        good.load_cert_chain(files["tls_cert"], files["tls_key"])
        good.check_hostname = False
        async with await peer(d, tls=good) as c:
            assert await c.ping(b"tls") == b"tls"
        # A client that does not trust the fleet's CA refuses the daemon.
        with pytest.raises(DaemonUnavailableError, match="CERTIFICATE_VERIFY_FAILED"):
            await peer(d, tls=ssl.create_default_context())
        # A client without a certificate from the CA is refused by the daemon.
        other = trustme.CA()
        stranger = ssl.create_default_context(cafile=files["tls_ca"])
        other.issue_cert("127.0.0.1").configure_cert(stranger)
        stranger.check_hostname = False
        with pytest.raises(DaemonUnavailableError):
            await peer(d, tls=stranger)
        # Plain TCP to a TLS port gets nowhere either.
        with pytest.raises(DaemonUnavailableError):
            await peer(d, connect_timeout=2.0)
    assert d.peer_server is not None
    assert d.peer_server.counters.requests.value("ping", "ok") == 1  # only the good client's


def test_peering_is_off_by_default_and_never_without_a_token() -> None:
    assert load_config(None, {}).peer.listen is None
    assert not load_config(None, {}).peer.enabled
    with pytest.raises(ConfigError, match="peering needs a shared secret"):
        load_config(None, {"peer": {"listen": "127.0.0.1:7070"}})
    with pytest.raises(ConfigError, match="expected host:port"):
        load_config(None, {"peer": {"members": ["nohost"], "token": "t"}})


# ---------------------------------------------------------------- strangers on the port


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closed the connection (EOF or reset) within 30 s."""
    try:
        async with asyncio.timeout(30):
            return await reader.read(1) == b""
    except ConnectionResetError:
        return True


async def test_connections_that_never_authenticate_are_closed_at_the_handshake_deadline(
    sock_dir: Path,
) -> None:
    async with running_daemon(
        sock_dir,
        peer={"listen": "127.0.0.1:0", "token": TOKEN, "handshake_timeout": 0.3},
        disk={"enabled": False},
    ) as d:
        assert d.peer_port is not None
        silent = [await asyncio.open_connection("127.0.0.1", d.peer_port) for _ in range(5)]
        # Half a header, then nothing: still not a HELLO.
        partial_reader, partial_writer = await asyncio.open_connection("127.0.0.1", d.peer_port)
        partial_writer.write(wire.HEADER.pack(wire.MAGIC, 1, Op.HELLO, 0, 0, 1, 10, 0)[:6])
        await partial_writer.drain()
        async with await peer(d) as c:  # an authenticated peer is never timed out
            closed = await asyncio.gather(
                *(_closed_by_server(r) for r, _ in silent), _closed_by_server(partial_reader)
            )
            assert all(closed)
            assert refused(d, "handshake_timeout") == 6
            assert await c.ping(b"still here") == b"still here"
        assert d.peer_server is not None and d.peer_server.unauthenticated_count == 0
        for _, w in [*silent, (partial_reader, partial_writer)]:
            w.close()
        text = d.metrics.render().decode()
        assert 'kvtier_peer_listener_refused_total{reason="handshake_timeout"} 6.0' in text


async def test_past_max_unauthenticated_the_oldest_waiting_connection_is_dropped(
    sock_dir: Path,
) -> None:
    async with running_daemon(
        sock_dir,
        peer={
            "listen": "127.0.0.1:0",
            "token": TOKEN,
            "handshake_timeout": 60.0,  # only the cap closes connections here
            "max_unauthenticated": 3,
        },
        disk={"enabled": False},
    ) as d:
        assert d.peer_port is not None and d.peer_server is not None
        conns = []
        for _ in range(5):
            conns.append(await asyncio.open_connection("127.0.0.1", d.peer_port))
        await wait_until(lambda: refused(d, "unauthenticated_limit") == 2)
        # The two oldest were dropped; the three newest still wait for a HELLO.
        assert await _closed_by_server(conns[0][0]) and await _closed_by_server(conns[1][0])
        assert d.peer_server.unauthenticated_count == 3
        async with await peer(d) as c:  # a new peer still gets in (the oldest waiting goes)
            assert await c.ping(b"in") == b"in"
        assert refused(d, "unauthenticated_limit") == 3
        assert await _closed_by_server(conns[2][0])
        for _, w in conns:
            w.close()


async def test_the_local_socket_gives_a_first_frame_deadline_where_uids_are_listed(
    sock_dir: Path,
) -> None:
    async with running_daemon(
        sock_dir, server={"allowed_uids": [os.getuid()], "handshake_timeout": 0.3}
    ) as d:
        reader, writer = await asyncio.open_unix_connection(str(d.socket_path))
        async with await Client.connect(d.socket_path) as c:  # sends HELLO at once
            assert await _closed_by_server(reader)
            assert d.server.counters.connections_refused.value("handshake_timeout") == 1
            assert await c.ping(b"ok") == b"ok"
        writer.close()
