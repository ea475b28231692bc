"""Engine integrations: kvtier as a tier of an inference engine's KV offload.

:mod:`.engine` is the engine-agnostic part (non-blocking lookups with a
request tag, loads straight into the engine's rows, stores from them,
reconnects); engine adapters build on it. Imports the client, the shared
records and the loop choice; never the daemon side (config, core, server,
tiers, metrics).
"""
