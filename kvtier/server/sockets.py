"""The Unix socket's file: a private directory, a stale socket cleared, mode 0600.

Synchronous and small; called once at startup. Imports only the errors.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import stat
from pathlib import Path

from kvtier.errors import SocketInUseError, UnsafeSocketDirError

log = logging.getLogger("kvtier.server")


def prepare_socket_path(path: Path) -> None:
    """Make ``path``'s directory (0700 when we create it) and clear a stale socket.

    A socket file that still answers belongs to a live daemon and is not
    stolen; a socket file nobody answers on is left over from a dead one.
    """
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=0o700, parents=True)
        os.chmod(parent, 0o700)
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


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening socket at ``path``, created with mode 0600."""
    prepare_socket_path(path)
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
    os.chmod(path, 0o600)
    sock.listen(512)
    sock.setblocking(False)
    return sock
