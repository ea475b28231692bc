"""KV events for routers: the daemon's block events as vLLM KV event batches.

llm-d's KV-cache indexer and Dynamo's KV router learn where blocks are from
vLLM's KV event stream; this publishes kvtier's blocks on the same stream,
including blocks no engine on the node computed (promoted from S3 or a
peer, pushed by a peer). The format is vLLM's (``vllm/distributed/
kv_events.py``): a ZMQ PUB socket sends three frames per batch, the topic,
an 8-byte big-endian sequence number and a msgpack ``KVEventBatch``
(``[ts, events]``, each event a map tagged with its type: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``); a ROUTER socket answers a replay
request (an 8-byte start sequence number) with every buffered batch from
there, then an end marker (sequence -1).

Each namespace's blocks (docs/tenancy.md) go out under their own topic,
``kv@<node>@<namespace>`` (``[events] topic`` sets one for all), as vLLM
names a pod's model in its topic; the sequence numbers are the endpoint's,
one run for every topic, as a subscriber to the endpoint sees them.

What is published: a block is BlockStored once when the node first holds
it (in RAM or on disk) and BlockRemoved once when no local tier holds it
any more, so a consumer that reference-counts announcements stays right;
on start, and after the daemon's own event queue overflowed, an
AllBlocksCleared followed by a BlockStored for every block held resyncs
routers. Block hashes come from the keys (``key_format``: the vLLM tier's
keys carry the engine's block hash and group index); token ids, the parent
hash and LoRA are not known to the daemon and go out empty, so an indexer
places such a block where it has seen its hash with tokens (from the engine
itself) and counts it on this node. Imports the shared records only.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from kvtier.model import (
    DEFAULT_NAMESPACE,
    NAMESPACE_MARK,
    BlockEvent,
    EventKind,
    EventSource,
    namespace_name,
    namespace_of,
)

log = logging.getLogger("kvtier.events")

#: events the publisher may have queued in the daemon before it resyncs
QUEUE = 1 << 20
#: events per published batch at most: small enough that translating and
#: encoding one stays a short step of the daemon's loop
BATCH = 256
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class _KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class BlockStored(_KVCacheEvent, tag="BlockStored"):
    """vLLM's ``BlockStored``: its required fields, then the optional ones used."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class BlockRemoved(_KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(_KVCacheEvent, tag="AllBlocksCleared"):
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


_HASH_GROUP = struct.Struct(">QI")


def vllm_hash(key: bytes) -> tuple[int, int | None]:
    """(block hash, group index) of a vLLM tier's key (namespace, block hash,
    4-byte group index), the hash converted as vLLM converts it (its last 8
    bytes, big-endian)."""
    if len(key) >= 12:
        return _HASH_GROUP.unpack_from(key, len(key) - 12)
    return int.from_bytes(key[-12:-4], "big"), int.from_bytes(key[-4:], "big")


def tail_hash(key: bytes) -> tuple[int, int | None]:
    """A key's last 8 bytes, big-endian, as the block hash; no group."""
    return int.from_bytes(key[-8:], "big"), None


def sglang_hash(key: bytes) -> tuple[int, int | None]:
    """The SGLang integration's key: its last 8 bytes are SGLang's own event
    hash of the page (``hash_str_to_int64``: the page hash's first 64 bits as
    a signed integer), so the hash matches SGLang's own KV events; no group."""
    return int.from_bytes(key[-8:], "big", signed=True), None


KEY_FORMATS: dict[str, Callable[[bytes], tuple[int, int | None]]] = {
    "vllm": vllm_hash,
    "tail": tail_hash,
    "sglang": sglang_hash,
}


@dataclass(slots=True)
class PublisherStats:
    """What the publisher did; metrics reads the fields by name."""

    batches: int = 0
    stored: int = 0
    removed: int = 0
    resyncs: int = 0
    replays: int = 0


class KVEventPublisher:
    """Publishes ``source``'s block events on ZMQ until cancelled."""

    def __init__(
        self,
        source: EventSource,
        *,
        endpoint: str,
        replay_endpoint: str | None,
        buffer_steps: int,
        hwm: int,
        node: str,
        topic: str = "",
        medium: str,
        block_size: int,
        key_format: str = "vllm",
    ) -> None:
        self._source = source
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.node = node
        #: every batch's topic when set; else each namespace's own,
        #: ``kv@<node>@<namespace>`` (_topic_of)
        self.topic = topic.encode()
        #: the topics published on so far (a resync clears each)
        self._topics: dict[bytes, bytes] = {}
        self.medium = medium
        self.block_size = block_size
        self._hash = KEY_FORMATS[key_format]
        self._hwm = hwm
        #: (sequence number, topic, payload) of the last batches, for replay
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(maxlen=buffer_steps)
        self._seq = 0
        #: the keys held, as announced (a key stored in RAM and on disk is one)
        self._held: set[bytes] = set()
        #: held keys per announced hash: several keys may carry one hash (an
        #: SGLang page stored as one block per layer buffer); the hash goes out
        #: as stored with its first key and as removed with its last
        self._hashes: dict[int, int] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self.stats = PublisherStats()
        #: set after each batch goes out (wait_published)
        self._sent = asyncio.Event()

    def __repr__(self) -> str:
        return (
            f"<KVEventPublisher {self.endpoint} seq={self._seq} held={len(self._hashes)} "
            f"buffered={len(self._buffer)}>"
        )

    def bind(self) -> None:
        """Open and bind the sockets (at startup: a bad address fails the start)."""
        self._ctx = zmq.asyncio.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self._hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(self.endpoint)
        if self.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(self.replay_endpoint)

    def close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
        self._pub = self._replay = self._ctx = None

    async def serve(self) -> None:
        """Publish until cancelled (or the daemon's event log closes)."""
        async with asyncio.TaskGroup() as group:
            replays = None
            if self._replay is not None:
                replays = group.create_task(self._serve_replays(self._replay))
            try:
                await self._publish_events()
            finally:
                if replays is not None:  # the stream ended: so does the replay
                    replays.cancel()

    async def _publish_events(self) -> None:
        source = self._source
        while True:
            sub = source.subscribe(QUEUE)
            try:
                await self._resync(source.snapshot())
                while True:
                    await sub.ready.wait()
                    if sub.closed:
                        return
                    events = sub.take(BATCH)
                    if events and events[0].kind is EventKind.GAP:
                        self.stats.resyncs += 1
                        log.warning("KV events: the publisher fell behind; resyncing routers")
                        break  # subscribe again, then a fresh snapshot
                    for topic, batch in self._translate(events).items():
                        await self._publish(batch, topic)
            finally:
                source.unsubscribe(sub)

    async def _resync(self, snapshot: list[BlockEvent]) -> None:
        """On each topic, AllBlocksCleared, then every block held, in batches."""
        self._held.clear()
        self._hashes.clear()
        held = self._translate(e for e in snapshot if e.kind is EventKind.SNAPSHOT)
        topics = dict.fromkeys([self._topic_of(DEFAULT_NAMESPACE), *self._topics.values(), *held])
        for topic in topics:
            first: list[VllmEvent] = [AllBlocksCleared()]
            stored = held.get(topic, [])
            await self._publish(first + stored[: BATCH - 1], topic)
            for lo in range(BATCH - 1, len(stored), BATCH):
                await self._publish(stored[lo : lo + BATCH], topic)

    def _topic_of(self, ns: bytes) -> bytes:
        topic = self._topics.get(ns)
        if topic is None:
            name = namespace_name(ns)
            topic = self._topics[ns] = self.topic or f"kv@{self.node}@{name}".encode()
        return topic

    def _translate(self, events: Iterable[BlockEvent]) -> dict[bytes, list[VllmEvent]]:
        """vLLM events for ``events``, by the topic of their blocks' namespace:
        a run of stores (or removals) of one topic and group is one event
        listing their hashes, as vLLM lists a request's blocks. One pass: this
        runs for every block the daemon stores or lets go."""
        out: dict[bytes, list[VllmEvent]] = {}
        held, counts, hash_of = self._held, self._hashes, self._hash
        default = self._topic_of(DEFAULT_NAMESPACE)
        stored_kinds = (EventKind.STORED, EventKind.SNAPSHOT)
        removed_kinds = (EventKind.EVICTED, EventKind.DELETED)
        # the run being gathered: its topic, kind and group, and its hashes
        topic, stored, group = default, True, None
        hashes: list[int] = []
        n_stored = n_removed = 0
        for e in events:
            key, kind = e.key, e.kind
            if kind in stored_kinds:
                if key in held:
                    continue  # on disk too, or again: already announced
                held.add(key)
                h, g = hash_of(key)
                n = counts.get(h, 0)
                counts[h] = n + 1
                if n:
                    continue  # another key with this hash announced it
                n_stored += 1
                s = True
            elif kind in removed_kinds:
                if key not in held:
                    continue
                held.discard(key)
                h, g = hash_of(key)
                n = counts.pop(h)
                if n > 1:
                    counts[h] = n - 1
                    continue  # another key still carries this hash
                n_removed += 1
                s = False
            else:
                continue
            t = default if key[0] != NAMESPACE_MARK else self._topic_of(namespace_of(key))
            if t != topic or s is not stored or g != group:
                if hashes:
                    self._close_run(out, topic, stored, group, hashes)
                    hashes = []
                topic, stored, group = t, s, g
            hashes.append(h)
        if hashes:
            self._close_run(out, topic, stored, group, hashes)
        self.stats.stored += n_stored
        self.stats.removed += n_removed
        return out

    def _close_run(
        self,
        out: dict[bytes, list[VllmEvent]],
        topic: bytes,
        stored: bool,
        group: int | None,
        hashes: list[int],
    ) -> None:
        event: VllmEvent
        if stored:
            event = BlockStored(hashes, None, [], self.block_size, None, self.medium, None, group)
        else:
            event = BlockRemoved(hashes, self.medium, group)
        batch = out.get(topic)
        if batch is None:
            out[topic] = [event]
        else:
            batch.append(event)

    async def _publish(self, events: list[VllmEvent], topic: bytes) -> None:
        if not events or self._pub is None:
            return
        self._seq += 1
        payload = self._encoder.encode(KVEventBatch(time.time(), events))
        self._buffer.append((self._seq, topic, payload))
        await self._pub.send_multipart((topic, self._seq.to_bytes(8, "big"), payload))
        self.stats.batches += 1
        self._sent.set()

    async def wait_published(self, batches: int) -> None:
        """Until ``batches`` batches have gone out since the start."""
        while self.stats.batches < batches:
            self._sent.clear()
            await self._sent.wait()

    async def _serve_replays(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames: list[Any] = await sock.recv_multipart()
            if len(frames) != 3:
                log.info("KV events: a replay request of %d frames ignored", len(frames))
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, topic, payload in list(self._buffer):
                if seq >= first:
                    await sock.send_multipart((client, b"", topic, seq.to_bytes(8, "big"), payload))
            await sock.send_multipart((client, b"", b"", END_SEQ, b""))
            self.stats.replays += 1
