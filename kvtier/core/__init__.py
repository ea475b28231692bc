"""The lookup engine: service verbs, where a key is (:mod:`.locate`), pending
writes and their deadlines, probes, the scheduler loop, write propagation.

No sockets, no frames, no Prometheus: imports the tiers, the shared records,
the counters, the errors and the config records; never the wire, the
server, the client or metrics.
"""
