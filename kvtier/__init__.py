"""kvtier: a tiered cache sidecar for LLM inference KV-cache blocks.

The public face: the clients, the lookup vocabulary and the error
hierarchy, all light to import. ``Config`` and ``load_config`` (pydantic)
load on first use only, so an engine that imports kvtier for the client
never pays for the daemon's config.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier._version import __version__
from kvtier.client import BlockingClient, Client, ClientOptions
from kvtier.errors import ErrorCode, KvtierError
from kvtier.model import LookupMode, LookupReply, PutHint, PutStatus, ReserveStatus, State

if TYPE_CHECKING:
    from kvtier.config import Config, load_config

__all__ = [
    "BlockingClient",
    "Client",
    "ClientOptions",
    "Config",
    "ErrorCode",
    "KvtierError",
    "LookupMode",
    "LookupReply",
    "PutHint",
    "PutStatus",
    "ReserveStatus",
    "State",
    "__version__",
    "load_config",
]


def __getattr__(name: str) -> Any:
    if name in ("Config", "load_config"):
        from kvtier import config

        return getattr(config, name)
    raise AttributeError(f"module 'kvtier' has no attribute {name!r}")
