"""Dialling a daemon's peer port: TCP, the shared token in HELLO, optional TLS.

The peer tier's connections are clients like any other once connected;
only this step differs from the Unix socket's. Same import rules as
:mod:`kvtier.client.aio`.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from kvtier import wire
from kvtier._version import __version__
from kvtier.client.protocol import ClientProtocol
from kvtier.defaults import DEFAULT_TIMEOUT
from kvtier.errors import ConnectionClosedError, DaemonUnavailableError

if TYPE_CHECKING:
    import ssl

    from kvtier.client.aio import Client


async def connect_tcp(
    cls: type[Client],
    host: str,
    port: int,
    *,
    token: bytes,
    tls: ssl.SSLContext | None = None,
    connect_timeout: float = 1.0,
    timeout: float | None = DEFAULT_TIMEOUT,
    name: str = f"kvtier-peer/{__version__}",
) -> Client:
    """Connect to a daemon's peer port and authenticate with ``token`` (HELLO)."""
    address = f"{host}:{port}"
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(connect_timeout):
            _, protocol = await loop.create_connection(
                lambda: ClientProtocol(wire.MAX_FRAME_BYTES_V1),
                host,
                port,
                ssl=tls,
                server_hostname=host if tls is not None else None,
            )
    except TimeoutError as exc:
        raise DaemonUnavailableError(
            f"no answer from peer {address} within {connect_timeout}s"
        ) from exc
    except OSError as exc:  # ssl.SSLError included: a failed handshake
        raise DaemonUnavailableError(f"cannot connect to peer {address}: {exc}") from exc
    client = cls(protocol, address, timeout, name, token)
    try:
        async with asyncio.timeout(connect_timeout):  # authenticating is connecting
            client.server = await client.hello()
    except TimeoutError as exc:
        await client.close()
        raise DaemonUnavailableError(
            f"peer {address} did not answer HELLO within {connect_timeout}s"
        ) from exc
    except ConnectionClosedError as exc:
        await client.close()
        # With TLS 1.3 a refused client certificate shows only now.
        raise DaemonUnavailableError(
            f"peer {address} closed the connection at HELLO ({exc}); "
            "if TLS is on, check that both sides use the same CA"
        ) from exc
    except BaseException:
        await client.close()
        raise
    return client
