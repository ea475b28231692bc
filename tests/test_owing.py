"""The acting half of the owed writes (kvtier/core/propagation.py) against a
fake remote tier gated by events: failed writes are owed, sent again up
to SEND_AT_ONCE at a time once the tier takes writes, oldest first, and a
block that cannot be read back is given up, never left half-sent."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from kvtier.core.counts import CoreCounters
from kvtier.core.outbox import Outbox
from kvtier.core.propagation import SEND_AT_ONCE, Propagation, WritePolicy, Writer
from kvtier.model import Buffer
from tests.helpers import wait_on_timers


class Store:
    """A remote tier: refuses while ``down``; each write waits for ``gate``."""

    def __init__(self) -> None:
        self.down = True
        self.gate = asyncio.Event()
        self.gate.set()
        self.in_flight = 0
        self.most_in_flight = 0
        self.stored: list[bytes] = []
        self.calls = 0

    async def write(self, key: bytes, value: Buffer) -> None:
        self.calls += 1
        if self.down:
            raise OSError("the store is down")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.gate.wait()
        finally:
            self.in_flight -= 1
        self.stored.append(key)


def propagation(store: Store, copy_of: Any = None) -> tuple[Propagation, Writer, set[Any]]:
    """``copy_of``: the local tiers' copy of a block (given, an owed block's
    bytes are not kept: read back through it when sent, as with a disk)."""
    w = Writer(
        "s3",
        WritePolicy.WRITE_THROUGH,
        1 << 30,
        store.write,
        lambda _key: False,
        local=False,
        outlives=True,
        outbox=Outbox(1 << 30),
    )
    tasks: set[asyncio.Task[None]] = set()

    def task(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        t = asyncio.get_running_loop().create_task(coro)
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        return t

    prop = Propagation(
        [w],
        CoreCounters(),
        task,
        lambda: False,
        copy_of=copy_of,
        kept_locally=lambda _key: copy_of is not None,
    )
    return prop, w, tasks


async def test_owed_blocks_are_sent_oldest_first_at_most_send_at_once_in_flight() -> None:
    store = Store()
    prop, w, tasks = propagation(store)
    keys = [b"k%03d" % i for i in range(200)]
    for key in keys:
        prop.stored(key, b"v" * 10, None)
    await wait_on_timers(lambda: not tasks and len(w.outbox or ()) == 200)
    assert store.stored == []
    store.down = False
    store.gate.clear()
    # The retry timer passes; the first SEND_AT_ONCE go out, and wait at the gate.
    await wait_on_timers(lambda: store.in_flight == SEND_AT_ONCE)
    prop.stored(b"new", b"v" * 10, None)  # behind the owed ones
    assert store.in_flight == SEND_AT_ONCE
    store.gate.set()
    await wait_on_timers(lambda: not tasks and not w.outbox)
    assert store.most_in_flight == SEND_AT_ONCE
    assert store.stored[:SEND_AT_ONCE] and set(store.stored) == {*keys, b"new"}
    # oldest first: each block left after the ones owed before it were sent
    assert store.stored.index(b"new") >= len(keys) - SEND_AT_ONCE
    assert prop.stats()["s3"]["owed_sent"] == 201


async def test_a_block_no_local_tier_can_read_back_is_given_up_not_left_sending() -> None:
    store = Store()

    async def copy_of(key: bytes) -> Buffer | None:
        if key == b"broken":
            raise OSError("unreadable")
        return None if key == b"gone" else b"v" * 10

    prop, w, tasks = propagation(store, copy_of)
    box = w.outbox
    assert box is not None
    for key in (b"broken", b"gone", b"kept"):
        prop.stored(key, b"v" * 10, None)
    # Read back when sent: the broken and the gone ones leave at the first try.
    await wait_on_timers(lambda: not tasks and len(box) == 1)
    store.down = False  # the retry timer passes: the kept one is sent
    await wait_on_timers(lambda: not tasks and not box)
    assert store.stored == [b"kept"] and box.sending == 0
    assert prop.stats()["s3"]["dropped_gone"] == 2
