"""How a client connects and moves its blocks: one record.

:class:`ClientOptions` is the one definition of a local connection's
options and their defaults; :meth:`Client.connect
<kvtier.client.aio.Client.connect>` and :class:`~kvtier.client.blocking.BlockingClient`
take it, and its fields as keyword arguments (:class:`OptionChanges`, the
same names and types, checked against it by a test), which change it.

Invariants: a record is checked once, when it is made (a bad ``idle_poll``
is refused before anything connects); it never changes after. Same import
rules as the rest of the client.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypedDict

from kvtier._version import __version__
from kvtier.defaults import DEFAULT_TIMEOUT, IDLE_POLL
from kvtier.errors import BadArgumentError
from kvtier.loops import IdlePoll
from kvtier.model import DEFAULT_NAMESPACE_NAME, namespace_id, namespace_prefix


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """A local connection's options (docs/client.md)."""

    #: seconds any one call may take; None: no limit
    timeout: float | None = DEFAULT_TIMEOUT
    #: the client's name, sent at HELLO
    name: str = f"kvtier-python/{__version__}"
    #: read blocks through the daemon's shared memory when it offers it (same
    #: host; docs/shared-memory.md), else over the socket
    shared: bool = True
    #: how large blocks are written when shared memory is on. None: a block of
    #: 512 KiB or more through shared memory, written in place
    #: (``write_in_place``) or else staged (a memcpy into the staging region,
    #: then COMMIT); with writing in place, every block of 64 KiB or more of a
    #: ``put_many`` goes in place too; the rest over the socket,
    #: which the daemon receives straight into the block's place. True: every
    #: block of 64 KiB or more through shared memory; False: none
    stage_writes: bool | None = None
    #: where the daemon allows it (a client of its own user), write each large
    #: block straight into its RAM slot, one memcpy and no copy in the daemon;
    #: False: through staging
    write_in_place: bool = True
    #: the namespace this connection's keys belong to (docs/tenancy.md): the
    #: daemon keeps them apart from every other namespace's in every tier and
    #: applies its quotas; empty (or "default"): the default namespace
    namespace: str = ""
    #: seconds this client's event loop keeps polling for a reply after each
    #: request instead of sleeping until the kernel wakes it (docs/client.md);
    #: it stops as soon as no reply is awaited. 0: sleep at once
    idle_poll: float = IDLE_POLL
    #: where the daemon runs a lookup process (a socket ``<path>.lookups``;
    #: docs/lookup-process.md), send lookups there first; the daemon answers
    #: what it refers back
    lookup_process: bool = True
    #: seconds the lookup process has to answer a dial or a lookup: it answers
    #: from memory and never waits, so one slower is taken for stuck (the
    #: daemon answers, and the connection to it is dropped)
    lookups_timeout: float = 0.1
    #: seconds before a lookup dials the lookup process again while no
    #: connection to it is open (the daemon starts it again once it went),
    #: doubling after each dial that fails, up to 30 s
    lookups_redial: float = 1.0

    def __post_init__(self) -> None:
        check_idle_poll(self.idle_poll)
        if not self.lookups_timeout > 0:
            raise BadArgumentError(f"lookups_timeout must be positive, got {self.lookups_timeout}")
        if not self.lookups_redial >= 0:
            raise BadArgumentError(f"lookups_redial must be 0 or more, got {self.lookups_redial}")


class OptionChanges(TypedDict, total=False):
    """:class:`ClientOptions`' fields as keyword arguments."""

    timeout: float | None
    name: str
    shared: bool
    stage_writes: bool | None
    write_in_place: bool
    namespace: str
    idle_poll: float
    lookup_process: bool
    lookups_timeout: float
    lookups_redial: float


def check_idle_poll(idle_poll: float) -> None:
    """Refused before connecting (nothing is left open), by the poller's own rule."""
    try:
        IdlePoll(idle_poll)
    except ValueError as exc:
        raise BadArgumentError(f"idle_poll: {exc}") from None


def key_prefix(namespace: str) -> bytes:
    """What the daemon expects before every key of ``namespace`` (docs/tenancy.md):
    nothing for the default namespace. A name no namespace can have is
    refused before connecting."""
    if not namespace or namespace == DEFAULT_NAMESPACE_NAME:
        return b""
    try:
        return namespace_prefix(namespace_id(namespace))
    except ValueError as exc:
        raise BadArgumentError(str(exc)) from None


#: the options of a client that names none
DEFAULTS = ClientOptions()
