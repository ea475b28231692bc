"""Pending writes: who is writing which key, and the deadline that ends it.

``table`` is the pure half (the reservation table: one pending write per
key, its owner, its ``done`` future); ``deadlines`` is the acting half (a
scheduler timer per reservation, the RAM it holds, the log and the count
when a deadline passes).
"""
