"""Shared memory for same-host clients (docs/shared-memory.md).

``leases`` is the pure half of reading in place (the lease table and its
deadlines) and ``leasing`` its acting half (the pins leases hold);
``staging`` the staging region's rooms, ``inplace`` the RAM slots written
in place, ``regions`` clients' memory files and ``copier`` where their
copies run; ``blocks`` the facade the server calls.
"""
