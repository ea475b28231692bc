"""The lookup process: ``python -m kvtier.replica SETTINGS``, started by the daemon.

It answers LOOKUP on a socket of its own from a replica of what the daemon
holds (docs/lookup-process.md), so that a lookup does not queue behind the
daemon's loop while blocks stream in. This module wires the replica
(:mod:`kvtier.replica.replica`) to the process's sockets
(:mod:`kvtier.replica.listener`); the daemon starts it with the socket pair's
other end and the feed ring's memory file as descriptors, and its
:class:`~kvtier.replica.settings.Settings` as JSON, and it runs until
the feed ends.
"""

from __future__ import annotations

import logging
import mmap
import signal
import socket
import sys
from pathlib import Path

from kvtier import loops, wire
from kvtier.core.checks import check_lookup
from kvtier.loops import IdlePoll
from kvtier.model import Limits, Lookup, LookupReply
from kvtier.replica.listener import LookupListener
from kvtier.replica.replica import Replica
from kvtier.replica.settings import Settings
from kvtier.schedule import request_slice
from kvtier.server.ops import NamespaceAccess, agreed_version
from kvtier.server.sockets import PeerPolicy
from kvtier.wire.replica import FeedRing


def build(settings: Settings) -> tuple[LookupListener, Replica]:
    limits = Limits(settings.max_key_bytes, settings.max_batch, settings.max_block_bytes)
    replica = Replica(remotes=settings.remotes)

    def answer(req: Lookup) -> LookupReply | None:
        check_lookup(limits, req)
        return replica.answer(req)

    def hello(req: wire.Hello) -> wire.HelloReply:
        return wire.HelloReply(
            version=agreed_version(req),
            max_key_bytes=settings.max_key_bytes,
            max_batch=settings.max_batch,
            max_frame_bytes=settings.max_frame_bytes,
            max_block_bytes=settings.max_block_bytes,
            server_name=settings.server_name,
        )

    uids = None if settings.uids is None else frozenset(settings.uids)
    with open(settings.ring_fd, "r+b", buffering=0) as ring_file:
        mem = mmap.mmap(ring_file.fileno(), 0)
    listener = LookupListener(
        socket.socket(fileno=settings.report_fd),
        FeedRing(memoryview(mem)),
        apply=replica.apply,
        answer=answer,
        hello=hello,
        peers=PeerPolicy(uids, frozenset(settings.gids)),
        access=NamespaceAccess.from_json(settings.access),
        max_frame=settings.max_frame_bytes,
        max_batch=settings.max_batch,
        idle_poll=IdlePoll(settings.idle_poll),
        tag_ttl=settings.request_state_ttl,
    )
    return listener, replica


async def serve(settings: Settings) -> None:
    listener, _ = build(settings)
    await listener.serve(Path(settings.path), settings.mode)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s lookups %(message)s")
    log = logging.getLogger("kvtier.lookups")
    # Its life follows the feed: the daemon ends it when it stops (or dies),
    # so a signal to the whole group stops the daemon, which stops this.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = Settings.from_json(argv[0])
    if settings.slice and not request_slice(settings.slice):
        log.warning(
            "this kernel takes no scheduler slice of the process's own (Linux 6.12 and "
            "later do): lookups wait for busy writers' slices"
        )
    try:
        loops.run(serve(settings))
    except OSError as exc:  # its socket: the daemon logs that it went
        log.error("cannot listen on %s: %s", settings.path, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
