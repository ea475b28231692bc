"""What the server counts: requests, protocol errors, connections and
bytes, read by metrics at scrape time."""

from __future__ import annotations

from kvtier.counters import LATENCY_BUCKETS, Counts, Histograms


class ServerCounters:
    """What the server counts; metrics reads it at scrape time."""

    def __init__(self) -> None:
        self.requests = Counts("op", "outcome")
        self.request_seconds = Histograms(LATENCY_BUCKETS, "op")
        self.protocol_errors = Counts("code")
        self.connections = Counts().bind()
        self.connections_refused = Counts("reason")
        self.received_bytes = Counts().bind()
        self.sent_bytes = Counts().bind()
        #: lookups the lookup process answered and referred to the daemon
        self.lookup_process = Counts("outcome")
        #: times the lookup process was started again after it went
        self.lookup_restarts = Counts().bind()

    def __repr__(self) -> str:
        return (
            f"<ServerCounters requests={self.requests.total():g} "
            f"connections={self.connections.value:g}>"
        )
