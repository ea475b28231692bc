"""Ports for the tests' listeners (standard library only: the engines'
venvs use it too)."""

from __future__ import annotations

import random
import socket

#: ports handed out for listeners: below the kernel's ephemeral range
#: (32768-60999 by default), so no outgoing connection of another test takes
#: one between its choice and its bind, or while its daemon restarts
_LISTEN_PORTS = range(20000, 32000)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, outside the
    ephemeral range (a daemon restarted on it finds it free again)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(_LISTEN_PORTS)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port below the ephemeral range")
