"""The Unix socket's file and who may use it.

The file: a private directory, a stale socket cleared, the configured mode
(0600, or 0660 for a shared group). The peers: :class:`PeerPolicy` checks
each connection's uid and gid (SO_PEERCRED) at accept. Synchronous and
small. Imports only the errors.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import SocketInUseError, UnsafeSocketDirError

log = logging.getLogger("kvtier.server")


def prepare_socket_path(path: Path, dir_mode: int = 0o700) -> None:
    """Make ``path``'s directory (``dir_mode`` when we create it) and clear a stale socket.

    A socket file that still answers belongs to a live daemon and is not
    stolen; a socket file nobody answers on is left over from a dead one.
    """
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=dir_mode, parents=True)
        os.chmod(parent, dir_mode)
    else:
        # Another user who controls the directory could swap the socket for
        # their own: refuse directories we cannot trust.
        st = os.stat(parent)
        if st.st_uid not in (os.getuid(), 0):
            raise UnsafeSocketDirError(
                f"socket directory {parent} belongs to uid {st.st_uid}, not to this user"
            )
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise UnsafeSocketDirError(
                f"socket directory {parent} is writable by every user; use a private directory"
            )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise SocketInUseError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        log.info("removing stale socket %s left by a daemon that is gone", path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    except OSError as exc:
        raise SocketInUseError(f"cannot tell whether {path} is in use: {exc}") from exc
    finally:
        probe.close()
    raise SocketInUseError(f"another kvtier daemon is serving on {path}")


def bind_unix_socket(path: Path, mode: int = 0o600) -> socket.socket:
    """A listening socket at ``path`` with permission bits ``mode`` (0600 or 0660)."""
    # A group-usable socket needs a group-traversable directory.
    prepare_socket_path(path, 0o750 if mode & 0o060 else 0o700)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SocketInUseError(f"another process bound {path} meanwhile") from exc
        raise
    finally:
        os.umask(old_umask)
    os.chmod(path, mode)
    sock.listen(512)
    sock.setblocking(False)
    return sock


_UCRED = struct.Struct("3i")  # pid, uid, gid


@dataclass(slots=True, frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int


def peer_of(sock: Any) -> Peer | None:
    """The connecting process's credentials, or None where the platform has none."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except (AttributeError, OSError):
        return None
    return Peer(*_UCRED.unpack(raw))


def process_gone(peer: Peer | None) -> bool:
    """Whether the process at the other end of a closed connection has
    exited (so its memory, and any write of it into shared memory, is gone):
    no such process, or a zombie. False where it cannot be told (no
    credentials, a pid of another namespace, no ``/proc``), and while the
    process lives; a pid reused since errs on that side too."""
    if peer is None or peer.pid <= 0:
        return False
    try:
        with open(f"/proc/{peer.pid}/stat", "rb") as fh:
            stat = fh.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    # "pid (comm) state ...": the command may hold spaces and parentheses
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state in (b"Z", b"X")


@dataclass(slots=True, frozen=True)
class PeerPolicy:
    """Who may connect: ``uids is None`` admits whoever can open the socket."""

    uids: frozenset[int] | None
    gids: frozenset[int] = frozenset()

    @classmethod
    def for_socket(cls, mode: int, uids: list[int] | None, gids: list[int] | None) -> PeerPolicy:
        """Explicit lists win; without them a private socket needs no check and a
        group-usable one admits the daemon's own user only."""
        if uids is None and gids is None:
            if not mode & 0o077:
                return cls(None)
            return cls(frozenset({os.getuid()}))
        return cls(frozenset(uids or ()), frozenset(gids or ()))

    def allows(self, peer: Peer | None) -> bool:
        if self.uids is None:
            return True
        if peer is None:
            return False  # nothing to check against: refuse
        return peer.uid in self.uids or peer.gid in self.gids
