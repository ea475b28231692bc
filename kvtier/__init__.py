"""kvtier: a tiered cache sidecar for LLM inference KV-cache blocks.

The public face: the clients, the lookup vocabulary, the config loader and
the error hierarchy. Everything else is internal.
"""

from kvtier._version import __version__
from kvtier.config import Config, load_config
from kvtier.errors import ErrorCode, KvtierError
from kvtier.protocol.client import BlockingClient, Client
from kvtier.protocol.codec import LookupMode, LookupReply, PutStatus, ReserveStatus, State

__all__ = [
    "BlockingClient",
    "Client",
    "Config",
    "ErrorCode",
    "KvtierError",
    "LookupMode",
    "LookupReply",
    "PutStatus",
    "ReserveStatus",
    "State",
    "__version__",
    "load_config",
]
