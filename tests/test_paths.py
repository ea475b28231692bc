"""A reader can follow a request: the traced paths stay short.

Counted by :mod:`tests.pathcount` over real requests to a daemon in a
thread of its own. The ceilings only come down: a change that makes a
verb harder to follow (more calls, more files to read) fails here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import pathcount
from tests.s3server import S3Server, s3_server

#: (calls, files) at most: the targets the layout was reshaped for.
#: A disk-only GET (67 calls in 8 files measured).
DISK_GET = (80, 12)
#: An S3-only LOOKUP until HIT (148 calls in 15 files measured);
#: docs/architecture.md lists the files and why each is on the path.
S3_LOOKUP = (150, 15)


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    yield from s3_server()


def test_a_disk_only_get_reads_top_to_bottom(sock_dir: Path) -> None:
    count = pathcount.disk_only_get(sock_dir)
    calls, files = DISK_GET
    assert len(count.calls) <= calls, f"{count}: {count.by_function()}"
    assert len(count.files) <= files, f"{count}: {sorted(count.files)}"


def test_an_s3_only_lookup_until_hit_reads_top_to_bottom(s3: S3Server, sock_dir: Path) -> None:
    count = pathcount.s3_only_lookup(sock_dir, s3.tier_config(s3.new_bucket()))
    calls, files = S3_LOOKUP
    assert len(count.calls) <= calls, f"{count}: {count.by_function()}"
    assert len(count.files) <= files, f"{count}: {sorted(count.files)}"
