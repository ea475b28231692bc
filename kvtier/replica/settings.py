"""What the daemon tells its lookup process at start (JSON on its command line)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass


@dataclass(slots=True, frozen=True)
class Settings:
    """What the daemon tells its lookup process."""

    #: the socket pair's end for reports, and the feed ring's memory file:
    #: descriptors the process inherits
    report_fd: int
    ring_fd: int
    #: the lookup socket's path and permission bits
    path: str
    mode: int
    #: who may connect (None: whoever can open the socket)
    uids: list[int] | None
    gids: list[int]
    #: who may use which namespace (:meth:`NamespaceAccess.to_json`)
    access: dict[str, object]
    max_key_bytes: int
    max_batch: int
    max_block_bytes: int
    max_frame_bytes: int
    server_name: str
    #: the daemon has remote tiers
    remotes: bool
    #: seconds the process's loop polls after each request (``server.idle_poll``)
    idle_poll: float = 0.0
    #: seconds of the scheduler slice the process asks for (``server.lookup_slice``)
    slice: float = 0.0
    #: seconds the daemon keeps an idle request tag's state (``lookup.request_state_ttl``)
    request_state_ttl: float = 60.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Settings:
        return cls(**json.loads(text))
