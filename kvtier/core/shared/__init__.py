"""Shared memory for same-host clients: leases on arena blocks and staging rooms.

``leases`` is the pure half (the lease table and its deadlines); ``blocks``
is the acting half (grants leases on RAM blocks, hands out staging rooms,
checks and commits what clients wrote into them).
"""
