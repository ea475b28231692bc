"""The Python client: ``from kvtier.client import Client, BlockingClient``.

Light by contract: imports the wire, the shared records and the errors,
never pydantic, aiobotocore, prometheus_client, the core or the server.
"""

from kvtier.client.aio import Client, Timeout
from kvtier.client.blocking import BlockingClient
from kvtier.client.options import ClientOptions
from kvtier.defaults import DEFAULT_TIMEOUT
from kvtier.model import LookupMode, LookupReply, PutStatus, ReserveStatus, Retention, State

__all__ = [
    "DEFAULT_TIMEOUT",
    "BlockingClient",
    "Client",
    "ClientOptions",
    "LookupMode",
    "LookupReply",
    "PutStatus",
    "ReserveStatus",
    "Retention",
    "State",
    "Timeout",
]
