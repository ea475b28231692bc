"""Existence probes of the remote tiers: shared while in flight, always ended.

``table`` is the pure half (per tier, key -> the probe in flight and key ->
the kept verdict); ``runner`` is the acting half (batches a tick's probes
into one ``batch_lookup`` per tier, runs it under a deadline, resolves
every probe it covered).
"""
