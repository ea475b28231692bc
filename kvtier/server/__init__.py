"""The daemon's Unix-socket server: socket file safety (:mod:`.sockets`), one
reusable connection (:mod:`.connection`), the op table (:mod:`.ops`) and
accept/shutdown (:mod:`.server`).

Imports the wire, the shared records, the counters and the errors; never the
core, the tiers or metrics: the service arrives as a
:class:`~kvtier.model.CacheService` from the daemon.
"""
