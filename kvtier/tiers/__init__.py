"""Where blocks live: the tier interface (:mod:`.base`), the eviction policy and
the byte budget RAM and disk share, the RAM, disk, S3 and in-memory remote
tiers, and the circuit breaker remote tiers use.

Tiers count into their own counters and never import the core, the wire, the
server or metrics.
"""
