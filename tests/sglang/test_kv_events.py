"""The daemon's KV events for SGLang's pages, decoded with SGLang's own
classes: each page is announced under the hash SGLang's own KV events give
it, once however many blocks the page is stored as."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from sglang.srt.mem_cache.utils import hash_str_to_int64

from kvtier import BlockingClient
from tests.enginedaemon import EngineDaemon, start
from tests.sglang.test_storage import Engine
from tests.zmqevents import EventReader


@pytest.fixture
def publishing(workdir: Path) -> Iterator[tuple[EngineDaemon, EventReader]]:
    config = workdir / "kvtier.toml"
    config.write_text(
        "[events]\n"
        f'endpoint = "ipc://{workdir}/events"\n'
        f'replay_endpoint = "ipc://{workdir}/replay"\n'
        'node = "n1"\nkey_format = "sglang"\n'
    )
    d = start(workdir, "--config", str(config), "--no-disk", "--ram-capacity", "64MiB")
    reader = EventReader(
        f"ipc://{workdir}/events", f"ipc://{workdir}/replay", "kv@n1@", KVEventBatch
    )
    try:
        yield d, reader
    finally:
        reader.close()
        d.stop()


def test_pages_go_out_under_sglangs_own_event_hashes(
    publishing: tuple[EngineDaemon, EventReader],
) -> None:
    d, reader = publishing
    e = Engine(d.socket_path)
    try:
        assert e.storage.parts == 2  # a page is two blocks: its K and its V
        keys = [hashlib.sha256(b"page-%d" % i).hexdigest() for i in range(3)]
        src, _ = e.fill(3)
        assert e.storage.batch_set_v1(keys, src) == [True] * 3
        k_part, v_part = e.storage.names(keys[:1], e.storage.parts)
        with BlockingClient(d.socket_path, namespace=e.storage.namespace) as c:
            assert c.delete(k_part)  # half the page is gone: it is still announced
            assert c.delete(v_part)  # now it is not
        events = reader.until(lambda seen: isinstance(seen[-1], BlockRemoved))
        cleared, *stored, removed = events
        assert isinstance(cleared, AllBlocksCleared)
        announced = [h for s in stored for h in s.block_hashes]
        assert all(isinstance(s, BlockStored) for s in stored)
        assert announced == [hash_str_to_int64(k) for k in keys]
        assert isinstance(removed, BlockRemoved)
        assert removed.block_hashes == [hash_str_to_int64(keys[0])]
    finally:
        e.close()
