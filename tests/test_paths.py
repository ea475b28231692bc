"""A reader can follow a request: the traced paths stay short.

Counted by :mod:`tests.pathcount` over real requests to a daemon in a
thread of its own, from the bytes' arrival to the reply. The ceilings are
on calls and on switches from one file to another (what a reader follows),
not on the number of files (a ceiling on files pushes code into fewer of
them, which is not a clearer path); they only come down: a change that
makes a verb harder to follow fails here.
"""

from __future__ import annotations

from pathlib import Path

from tests import pathcount
from tests.s3server import ProxiedS3

#: (calls, switches between files) at most.
#: A disk-only GET of a key a previous daemon left (115 calls, 68 switches
#: measured, in 21 files: the key was loaded at start, and its first touch
#: takes it out of the eviction policy's backlog of loaded keys; what the
#: read cost, and how many reads shared the disk meanwhile, teaches the
#: disk's estimate for lookups' budgets).
DISK_GET = (115, 68)
#: A LOOKUP the lookup process answers: there (35 calls, 23 switches
#: measured, in 11 files), and the daemon's part once its report arrives
#: (19 calls, 11 switches, in 9 files).
PROCESS_LOOKUP = (38, 25)
PROCESS_REPORT = (21, 12)
#: An S3-only LOOKUP until HIT (213-220 calls, 140-144 switches measured,
#: idle and with both cores kept busy, in 32 files: the second LOOKUP waits
#: while the probe is held at the store, and how the load's answer meets
#: its wait varies by a few calls; the tier asks whether it
#: seals what it loads, the probe's round trip and the load's cost are
#: learnt for lookups' budgets, and the GET is timed for the p95 its hedge
#: waits for, in tiers/hedger.py and tiers/hedging.py; the first LOOKUP's
#: hit waits in tiers/touches.py until the promotion's write has landed);
#: docs/architecture.md lists the files and why each is on the path.
S3_LOOKUP = (222, 145)


def test_a_disk_only_get_reads_top_to_bottom(sock_dir: Path) -> None:
    count = pathcount.disk_only_get(sock_dir)
    calls, switches = DISK_GET
    assert len(count.calls) <= calls, f"{count}: {count.by_function()}"
    assert count.switches <= switches, f"{count}: {count.calls}"


def test_an_s3_only_lookup_until_hit_reads_top_to_bottom(s3: ProxiedS3, sock_dir: Path) -> None:
    count = pathcount.s3_only_lookup(sock_dir, s3)
    calls, switches = S3_LOOKUP
    assert len(count.calls) <= calls, f"{count}: {count.by_function()}"
    assert count.switches <= switches, f"{count}: {count.calls}"


def test_a_lookup_at_the_lookup_process_reads_top_to_bottom_in_both_processes(
    sock_dir: Path,
) -> None:
    there, here = pathcount.process_lookup(sock_dir)
    for count, (calls, switches) in ((there, PROCESS_LOOKUP), (here, PROCESS_REPORT)):
        assert len(count.calls) <= calls, f"{count}: {count.by_function()}"
        assert count.switches <= switches, f"{count}: {count.calls}"
