"""Hints from writers and readers reach RAM's eviction order, end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.client.aio import Client
from kvtier.model import LookupMode, PutHint, PutStatus
from tests.helpers import running_daemon

BLOCK = 200_000  # five fit in the 1 MiB of RAM below
#: no disk below RAM: a block RAM evicts is gone
RAM_ONLY = {"enabled": False}


def block(i: int) -> bytes:
    return bytes([i]) * BLOCK


@pytest.mark.parametrize("policy", ["harc", "lru", "arc", "s3fifo"])
async def test_a_tail_block_is_the_first_to_go(sock_dir: Path, policy: str) -> None:
    async with (
        running_daemon(sock_dir, ram={"capacity": "1MiB", "policy": policy}, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        keys = [f"b{i}".encode() for i in range(6)]
        assert await c.put_many(keys[:4], [block(i) for i in range(4)]) == [PutStatus.STORED] * 4
        assert await c.put(keys[4], block(4), hint=PutHint.TAIL) == PutStatus.STORED
        assert await c.put(keys[5], block(5)) == PutStatus.STORED  # one must go
        present = [await c.get(k) is not None for k in keys]
        assert present == [True, True, True, True, False, True]
        hinted = d.metrics.registry.get_sample_value("kvtier_put_hints_total", {"hint": "tail"})
        assert hinted == 1


async def test_put_many_carries_one_hint_per_key_and_answers_in_order(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, ram={"capacity": "1MiB", "policy": "lru"}, disk=RAM_ONLY) as d,
        await Client.connect(d.socket_path, shared=False) as c,
    ):
        await c.put(b"old", b"o" * 70_000)
        keys = [b"small", b"old", b"tail", b"new"]
        values = [b"s", b"o" * 70_000, block(1), block(2)]
        hints = [PutHint.NONE, PutHint.NONE, PutHint.TAIL, PutHint.NONE]
        statuses = await c.put_many(keys, values, hints=hints)
        assert statuses == [PutStatus.STORED, PutStatus.EXISTS, PutStatus.STORED, PutStatus.STORED]
        await c.put_many([b"x", b"y", b"z"], [block(3), block(4), block(5)])
        assert await c.get(b"tail") is None  # the hinted one went first
        assert await c.get(b"new") is not None


async def test_a_peek_leaves_the_eviction_order_alone(sock_dir: Path) -> None:
    async with (
        running_daemon(sock_dir, ram={"capacity": "1MiB", "policy": "lru"}, disk=RAM_ONLY) as d,
        # The daemon's own lookups: touches applied before the next write
        # (the lookup process's reach it within milliseconds).
        await Client.connect(d.socket_path, shared=False, lookup_process=False) as c,
    ):
        keys = [f"b{i}".encode() for i in range(5)]
        await c.put_many(keys, [block(i) for i in range(5)])
        seen = await c.lookup(keys[:2], mode=LookupMode.PREFIX, peek=True)
        assert seen.prefix_hits == 2  # answered as usual
        assert d.metrics.registry.get_sample_value("kvtier_lookup_peeks_total") == 1
        await c.put(b"f", block(5))
        assert await c.get(keys[0]) is None  # the peek did not make it recent
        read = await c.lookup(keys[1:2], mode=LookupMode.PREFIX)
        assert read.prefix_hits == 1
        await c.put(b"g", block(6))
        assert await c.get(keys[1]) is not None  # a real lookup did
        assert await c.get(keys[2]) is None
