"""Reading a KV event publisher as a router does, for the engine tests: the
replay socket for every batch sent so far (decoded with the engine's own
msgspec classes), the live stream to wait on between looks. pyzmq and msgspec,
which every engine's venv has; nothing of the daemon."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import zmq


class EventReader:
    """A SUB socket on ``endpoint`` and replay requests to ``replay``; every
    batch's topic starts with ``topic``."""

    def __init__(self, endpoint: str, replay: str, topic: str, batch_type: type[Any]) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.replay = replay
        self.topic = topic.encode()
        self.decoder = msgspec.msgpack.Decoder(type=batch_type)
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)

    def close(self) -> None:
        self.sub.close()
        self.ctx.term()

    def batches(self, start: int) -> list[tuple[int, Any]]:
        """Every buffered batch from sequence number ``start`` on, in order
        and without holes."""
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.setsockopt(zmq.RCVTIMEO, 10_000)
        req.connect(self.replay)
        try:
            req.send_multipart((b"", start.to_bytes(8, "big")))
            out: list[tuple[int, Any]] = []
            while True:
                _, topic, seq, payload = req.recv_multipart()
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    return out
                assert topic.startswith(self.topic), topic
                assert n == (out[-1][0] + 1 if out else start), "a hole in the replay"
                out.append((n, self.decoder.decode(payload)))
        finally:
            req.close()

    def events(self, wanted: int, start: int = 1) -> list[Any]:
        """The first ``wanted`` events from ``start`` on, once they are sent."""
        return self.until(lambda events: len(events) >= wanted, start)

    def until(self, done: Callable[[list[Any]], bool], start: int = 1) -> list[Any]:
        """The events from ``start`` on once ``done`` holds of them, waiting on
        the live stream between looks."""
        for _ in range(50):
            events = [e for _, b in self.batches(start) for e in b.events]
            if done(events):
                return events
            if self.sub.poll(200):  # bounded: the next batch, or look again
                self.sub.recv_multipart()
        raise AssertionError("the events expected were not published")
