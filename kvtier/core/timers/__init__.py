"""Time in the core: many deadlines, one wake-up.

``heap`` is the pure half (a timer heap with lazy cancellation);
``scheduler`` is the acting half (the one long-lived task that fires
timers, flushes probe batches and runs the periodic sweeps).
"""
