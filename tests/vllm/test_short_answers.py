"""Scenario 4: a backend whose batch lookup answers fewer keys than asked.

The kvtier tier asks every key of a step in one LOOKUP. Here a scripted
server speaks kvtier's protocol but answers one state short. vLLM's own
worker thread strands the unanswered key in that case; the kvtier tier
answers every key of the short batch MISS (vLLM recomputes them) and leaves
nothing waiting.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from kvtier import LookupReply, wire

STEP = ScheduleEndContext((), ())


class ShortServer:
    """kvtier's protocol on a Unix socket, answering LOOKUPs one state short."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lookups = 0  # LOOKUP requests answered
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ShortServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(
            asyncio.start_unix_server(self._handle, str(self.path))
        )
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                header = wire.unpack_header(await reader.readexactly(wire.HEADER_SIZE))
                meta = await reader.readexactly(header.meta_len)
                await reader.readexactly(header.data_len)
                if header.opcode == wire.Op.HELLO:
                    reply = wire.encode_hello_reply(
                        wire.HelloReply(1, 256, 1000, 1 << 26, 1 << 24, "short")
                    )
                elif header.opcode == wire.Op.LOOKUP:
                    keys = wire.decode_lookup(meta).keys
                    states = bytes([1] * (len(keys) - 1))  # HIT for all but the last
                    reply = wire.encode_lookup_reply(LookupReply(states, len(states), False))
                    self.lookups += 1
                else:  # RELEASE and the like: acknowledged, empty
                    reply = b""
                writer.writelines(
                    wire.frame_parts(header.opcode, header.request_id, reply, flags=1)
                )
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()


@pytest.fixture
def short_server(tmp_path: Path) -> Iterator[ShortServer]:
    with ShortServer(tmp_path / "short.sock") as server:
        yield server


def test_a_short_lookup_answer_strands_no_key(short_server: ShortServer) -> None:
    region = np.zeros((4, 4096), dtype=np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(
        {
            "type": "KvtierTier",
            "module_path": "kvtier.integrations.vllm",
            "socket_path": str(short_server.path),
        },
        primary_kv_view=memoryview(region),  # type: ignore[arg-type]
        offloading_spec=None,
    )
    try:
        req = ReqContext("r")
        tier.on_new_request(req)
        keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(3)]
        assert [tier.lookup(k, req) for k in keys] == [LookupResult.RETRY] * 3
        tier.on_schedule_end(STEP)
        tier.drain_jobs()  # tests only: wait for the answer
        assert short_server.lookups == 1
        # Every key has its answer; none is left RETRY for ever.
        assert [tier.lookup(k, req) for k in keys] == [LookupResult.MISS] * 3
        tier.on_schedule_end(STEP)
        tier.drain_jobs()
        assert short_server.lookups == 1  # answered keys are not asked again
    finally:
        tier.shutdown()
