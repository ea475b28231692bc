"""Defaults shared by the daemon's config and the client. Light: stdlib only.

The client needs the default socket path and timeout without paying for the
daemon's pydantic config, so both live here, defined once.

Imports nothing of kvtier.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

#: seconds a client call waits for its reply unless told otherwise
DEFAULT_TIMEOUT: Final = 30.0
DEFAULT_METRICS_PORT: Final = 9477
#: seconds an event loop keeps polling instead of sleeping: the daemon's after
#: each request arrives and after each answer, a client's while it awaits a
#: reply (kvtier.loops.IdlePoll)
IDLE_POLL: Final = 200e-6


def default_socket_path() -> Path:
    """``$XDG_RUNTIME_DIR/kvtier/kvtier.sock``, else ``/tmp/kvtier-<uid>/kvtier.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime) / "kvtier" / "kvtier.sock"
    return Path(f"/tmp/kvtier-{os.getuid()}") / "kvtier.sock"


def default_data_dir() -> Path:
    """``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``: blocks are a cache."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "kvtier"
