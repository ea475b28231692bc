from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvtier.daemon import Daemon
from tests.ceph import CephS3, ceph_s3, missing
from tests.helpers import running_daemon, short_tmpdir


@pytest.fixture(scope="session")
def ceph() -> Iterator[CephS3]:
    """The object store the tests start (tests/ceph.py): one single-node Ceph
    cluster and its RADOS Gateway for the session (each worker's), a bucket
    per test. Without Ceph's programs the tests that need it are skipped,
    saying how to install them; ``make test`` (KVTIER_REQUIRE_TOOLS=1)
    installs them first and fails rather than skip."""
    absent = missing()
    if absent:
        how = "apt-get install -y --no-install-recommends " + " ".join(absent)
        if os.environ.get("KVTIER_REQUIRE_TOOLS"):
            pytest.fail(f"Ceph is not installed: {how}")
        pytest.skip(f"needs Ceph's RADOS Gateway: {how} (make test does)")
    yield from ceph_s3()


@pytest.fixture
def s3(ceph: CephS3) -> CephS3:
    """The S3 endpoint the tests use: Ceph's RGW, through a counting proxy
    (a bucket of its own per test: ``s3.new_bucket()``)."""
    return ceph


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = short_tmpdir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
async def daemon(sock_dir: Path) -> AsyncIterator[Daemon]:
    async with running_daemon(sock_dir) as d:
        yield d


#: tests/vllm, tests/lmcache, tests/sglang and tests/e2e run in venvs of their
#: own (make test-vllm, test-lmcache, test-sglang, test-e2e), where the engine is installed
collect_ignore = ["vllm", "lmcache", "sglang", "e2e"]
