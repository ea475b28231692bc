"""Public client API: ``from kvtier.client import Client, BlockingClient``."""

from kvtier.protocol.client import DEFAULT_TIMEOUT, BlockingClient, Client
from kvtier.protocol.codec import LookupMode, LookupReply, PutStatus, ReserveStatus, State

__all__ = [
    "DEFAULT_TIMEOUT",
    "BlockingClient",
    "Client",
    "LookupMode",
    "LookupReply",
    "PutStatus",
    "ReserveStatus",
    "State",
]
