"""A reader can follow a request: the traced paths stay short.

Counted by :mod:`tests.pathcount` over real requests to a daemon in a
thread of its own, from the bytes' arrival to the reply. The ceilings are
on calls and on switches from one file to another (what a reader follows),
not on the number of files (a ceiling on files pushes code into fewer of
them, which is not a clearer path); they only come down: a change that
makes a verb harder to follow fails here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import pathcount
from tests.s3server import S3Server, s3_server

#: (calls, switches between files) at most.
#: A disk-only GET (109 calls, 65 switches measured, in 19 files).
DISK_GET = (112, 65)
#: An S3-only LOOKUP until HIT (194 to 196 calls, 123 to 125 switches
#: measured, in 27 files: its waits vary by a call or two);
#: docs/architecture.md lists the files and why each is on the path.
S3_LOOKUP = (205, 130)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from s3_server()


def test_a_disk_only_get_reads_top_to_bottom(sock_dir: Path) -> None:
    count = pathcount.disk_only_get(sock_dir)
    calls, switches = DISK_GET
    assert len(count.calls) <= calls, f"{count}: {count.by_function()}"
    assert count.switches <= switches, f"{count}: {count.calls}"


def test_an_s3_only_lookup_until_hit_reads_top_to_bottom(s3: S3Server, sock_dir: Path) -> None:
    count = pathcount.s3_only_lookup(sock_dir, s3.tier_config(s3.new_bucket()))
    calls, switches = S3_LOOKUP
    assert len(count.calls) <= calls, f"{count}: {count.by_function()}"
    assert count.switches <= switches, f"{count}: {count.calls}"
