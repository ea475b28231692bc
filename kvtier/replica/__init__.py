"""The lookup process (docs/lookup-process.md): lookups answered away from
the daemon's event loop, from a replica of what the daemon holds.

* ``replica``: the replica and the answers it may give (pure);
* ``feed``: the daemon's end of the feed (the ring written, reports read);
* ``listener``: the process's end (the ring read, the lookup socket served
  by the daemon's connection code with an op table of its own, reports sent);
* ``settings``: what the daemon tells the process at start;
* ``__main__``: the process (``python -m kvtier.replica SETTINGS``).

The daemon starts, feeds and restarts it from
:mod:`kvtier.supervisors.lookup_process`.
"""
