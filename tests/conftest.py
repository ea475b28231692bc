from __future__ import annotations

import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvtier.daemon import Daemon
from tests.helpers import running_daemon, short_tmpdir


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
