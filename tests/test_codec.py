"""The codec alone: bytes in, messages out."""

from __future__ import annotations

import struct

import pytest

from kvtier import wire
from kvtier.model import Lookup, LookupMode, LookupReply, PutHint, PutStatus, Reserve, State
from kvtier.wire import FrameReader, Op


def frame_bytes(op: int, rid: int, meta: bytes = b"", data: bytes = b"", **kw: int) -> bytes:
    return b"".join(bytes(p) for p in wire.frame_parts(op, rid, meta, [data] if data else [], **kw))


def test_header_round_trip() -> None:
    raw = wire.pack_header(Op.GET, 2**64 - 1, 10, 20, flags=3, status=7)
    assert len(raw) == wire.HEADER_SIZE == 24
    h = wire.unpack_header(raw)
    assert (h.version, h.opcode, h.flags, h.status) == (1, Op.GET, 3, 7)
    assert (h.request_id, h.meta_len, h.data_len) == (2**64 - 1, 10, 20)


def test_bad_magic_is_rejected() -> None:
    with pytest.raises(wire.BadMagic):
        wire.unpack_header(b"XX" + bytes(22))


@pytest.mark.parametrize(
    "keys",
    [
        [],
        [b"a" * 32] * 5,
        [b"\x00", b"/..", b"x" * 300, b"\xff" * 7],
        [bytes([i]) * 32 for i in range(100)],
    ],
)
def test_keys_round_trip(keys: list[bytes]) -> None:
    encoded = wire.encode_keys(keys)
    decoded, end, _ = wire.decode_keys(encoded)
    assert decoded == keys
    assert end == len(encoded)


def test_uniform_keys_use_compact_form() -> None:
    keys = [bytes([i]) * 32 for i in range(10)]
    assert len(wire.encode_keys(keys)) == 6 + 32 * 10


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        struct.pack("<IH", 3, 32) + b"x" * 95,  # uniform, one byte short
        struct.pack("<IH", 2, 0) + struct.pack("<H", 1),  # lengths array cut
        struct.pack("<IH", 1, 0) + struct.pack("<H", 5) + b"abc",  # key bytes cut
        struct.pack("<IH", 0xFFFFFFFF, 0),  # absurd count
    ],
)
def test_truncated_key_lists_raise(raw: bytes) -> None:
    with pytest.raises(wire.CodecError):
        wire.decode_keys(raw)


def test_lookup_round_trip() -> None:
    req = Lookup([b"k1", b"k2"], LookupMode.SLIDING_WINDOW, 4, 0.5, 2.0, b"req-7")
    assert wire.decode_lookup(wire.encode_lookup(req)) == req
    whole = Lookup([b"k1"], LookupMode.PREFIX, peek=True, budget=0.25, whole=True)
    assert wire.decode_lookup(wire.encode_lookup(whole)) == whole


def test_reserve_round_trip() -> None:
    req = Reserve([b"a", b"bb"], [100, 0], 2.5)
    assert wire.decode_reserve(wire.encode_reserve(req)) == req
    with pytest.raises(wire.CodecError):
        wire.decode_reserve(wire.encode_reserve(req)[:-1])


def test_tag_round_trip() -> None:
    assert wire.decode_tag(wire.encode_tag(b"req-1")) == b"req-1"
    with pytest.raises(wire.CodecError):
        wire.encode_tag(b"x" * 256)


def test_lookup_rejects_unknown_mode_and_trailing_bytes() -> None:
    good = wire.encode_lookup(Lookup([b"k"]))
    with pytest.raises(wire.CodecError, match="mode"):
        wire.decode_lookup(bytes([9]) + good[1:])
    with pytest.raises(wire.CodecError, match="trailing"):
        wire.decode_lookup(good + b"!")


def test_lookup_reply_round_trip() -> None:
    reply = LookupReply(bytes([1, 1, 2, 0]), 2, True)
    decoded = wire.decode_lookup_reply(wire.encode_lookup_reply(reply))
    assert decoded == reply
    assert decoded.states == [
        State.HIT,
        State.HIT,
        State.PENDING,
        State.MISS,
    ]


def test_put_round_trip_single_value_is_zero_copy() -> None:
    meta, _data = wire.encode_put([b"k"], [b"value"])
    body = bytearray(b"value")
    keys, values, hints = wire.decode_put(meta, body)
    assert keys == [b"k"] and hints is None
    assert values[0] is body


def test_put_round_trip_many_values_are_copied_out() -> None:
    meta, data = wire.encode_put([b"a", b"b", b"c"], [b"1", b"", b"333"])
    joined = b"".join(data)
    keys, values, _ = wire.decode_put(meta, joined)
    assert keys == [b"a", b"b", b"c"]
    assert [bytes(v) for v in values] == [b"1", b"", b"333"]
    assert all(isinstance(v, bytes) for v in values)


def test_put_hints_travel_one_byte_per_key_and_unknown_bits_are_refused() -> None:
    meta, data = wire.encode_put([b"a", b"b"], [b"1", b"22"], [PutHint.NONE, PutHint.TAIL])
    keys, _, hints = wire.decode_put(meta, b"".join(data), hinted=True)
    assert keys == [b"a", b"b"] and hints == bytes([0, PutHint.TAIL])
    bad, _ = wire.encode_put([b"a"], [b"1"], [0x80])
    with pytest.raises(wire.CodecError, match="hint"):
        wire.decode_put(bad, b"1", hinted=True)
    with pytest.raises(wire.CodecError, match="trailing"):
        wire.decode_put(meta, b"122")  # hints present but the flag not set


def test_a_lookup_peek_round_trips_and_unknown_flags_are_refused() -> None:
    req = Lookup([b"k"], LookupMode.PREFIX, peek=True)
    assert wire.decode_lookup(wire.encode_lookup(req)) == req
    raw = bytearray(wire.encode_lookup(req))
    raw[1] = 0x80
    with pytest.raises(wire.CodecError, match="flags"):
        wire.decode_lookup(bytes(raw))


def test_put_length_mismatch_raises() -> None:
    meta, _ = wire.encode_put([b"a"], [b"12345"])
    with pytest.raises(wire.CodecError, match="lengths"):
        wire.decode_put(meta, b"1234")


def test_get_reply_round_trip_with_misses() -> None:
    meta, data = wire.encode_get_reply([b"one", None, b"", b"four"])
    out = wire.decode_get_reply(meta, b"".join(data))
    assert [None if v is None else bytes(v) for v in out] == [b"one", None, b"", b"four"]


def test_hello_and_negotiation() -> None:
    hello = wire.Hello(1, 3, "me")
    assert wire.decode_hello(wire.encode_hello(hello)) == hello
    assert wire.negotiate_version(hello) == 1
    assert wire.negotiate_version(wire.Hello(2, 3, "future")) is None
    reply = wire.HelloReply(1, 256, 65536, 1 << 26, 1 << 24, "kvtier/x")
    assert wire.decode_hello_reply(wire.encode_hello_reply(reply)) == reply


def test_hello_carries_a_peer_token_and_the_reply_a_node_id() -> None:
    hello = wire.Hello(1, 1, "peer", token=b"s3cret")
    assert wire.decode_hello(wire.encode_hello(hello)) == hello
    assert "s3cret" not in repr(hello)
    reply = wire.HelloReply(1, 256, 65536, 1 << 26, 1 << 24, "kvtier/x", node_id="ab12")
    assert wire.decode_hello_reply(wire.encode_hello_reply(reply)) == reply
    cut = wire.encode_hello(hello)[:-3]
    with pytest.raises(wire.CodecError, match="truncated HELLO token"):
        wire.decode_hello(cut)


def test_small_status_replies_round_trip() -> None:
    statuses = [PutStatus.STORED, PutStatus.EXISTS]
    assert wire.decode_put_reply(wire.encode_put_reply(statuses)) == statuses
    assert wire.decode_delete_reply(wire.encode_delete_reply([True, False])) == [True, False]


# ------------------------------------------------------------------ FrameReader


def feed(reader: FrameReader, stream: bytes, chunk: int) -> list[wire.Frame]:
    frames: list[wire.Frame] = []
    pos = 0
    while pos < len(stream):
        buf = reader.get_buffer(-1)
        n = min(chunk, len(buf), len(stream) - pos)
        buf[:n] = stream[pos : pos + n]
        pos += n
        frames.extend(reader.buffer_updated(n))
    return frames


@pytest.mark.parametrize("chunk", [1, 7, 24, 1000, 1 << 20])
def test_reader_reassembles_any_chunking(chunk: int) -> None:
    big = bytes(range(256)) * 1024  # 256 KiB: received directly
    stream = b"".join(
        [
            frame_bytes(Op.PING, 1, b"hello"),
            frame_bytes(Op.PUT, 2, b"m" * 10, big),
            frame_bytes(Op.PING, 3),
            frame_bytes(Op.PUT, 4, b"", b"x" * 70_000),
        ]
        * 3
    )
    reader = FrameReader(max_frame=1 << 22, buffer_size=128 * 1024, direct_threshold=64 * 1024)
    frames = feed(reader, stream, chunk)
    assert [f.header.request_id for f in frames] == [1, 2, 3, 4] * 3
    assert bytes(frames[0].meta) == b"hello"
    assert bytes(frames[1].meta) == b"m" * 10 and bytes(frames[1].data) == big
    assert bytes(frames[3].data) == b"x" * 70_000
    assert reader.idle


def test_reader_direct_frames_are_views_of_their_own_buffer() -> None:
    reader = FrameReader(max_frame=1 << 22)
    frames = feed(reader, frame_bytes(Op.PUT, 9, b"", b"z" * 200_000), 4096)
    assert isinstance(frames[0].data, memoryview)
    # The next frame must not overwrite the previous frame's bytes.
    feed(reader, frame_bytes(Op.PUT, 10, b"", b"y" * 200_000), 4096)
    assert bytes(frames[0].data) == b"z" * 200_000


def test_a_large_frame_is_received_in_steps() -> None:
    """No receive fills more than LOOP_STEP bytes: a large frame takes
    several loop steps, and other connections are served between them."""
    from kvtier.model import LOOP_STEP

    reader = FrameReader(max_frame=8 * LOOP_STEP)
    raw = frame_bytes(Op.PUT, 1, b"m" * 300_000, b"d" * (3 * LOOP_STEP))
    frames: list[wire.Frame] = []
    at = steps = 0
    while at < len(raw):
        buf = reader.get_buffer(-1)
        assert 0 < len(buf) <= LOOP_STEP
        n = min(len(buf), len(raw) - at)
        buf[:n] = raw[at : at + n]
        at += n
        steps += 1
        frames += reader.buffer_updated(n)
    assert steps >= (300_000 + 3 * LOOP_STEP) // LOOP_STEP
    (frame,) = frames
    assert bytes(frame.meta) == b"m" * 300_000 and bytes(frame.data) == b"d" * (3 * LOOP_STEP)


def test_reader_reports_partial_frames() -> None:
    reader = FrameReader(max_frame=1 << 20)
    raw = frame_bytes(Op.PING, 1, b"abc")
    assert feed(reader, raw[:-1], 100) == []
    assert not reader.idle
    assert len(feed(reader, raw[-1:], 100)) == 1
    assert reader.idle


def test_reader_rejects_oversized_frame_with_its_header() -> None:
    reader = FrameReader(max_frame=1000)
    with pytest.raises(wire.OversizedFrame) as info:
        feed(reader, wire.pack_header(Op.PUT, 77, 0, 5000), 100)
    assert info.value.header.request_id == 77


def test_reader_rejects_garbage() -> None:
    reader = FrameReader(max_frame=1000)
    with pytest.raises(wire.BadMagic):
        feed(reader, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 100)


def test_protocol_doc_example_matches_the_codec() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "protocol.md").read_text()
    keys = [bytes.fromhex("00000001"), bytes.fromhex("00000002")]
    meta = wire.encode_lookup(Lookup(keys, LookupMode.PREFIX))
    request = wire.pack_header(Op.LOOKUP, 7, len(meta), 0) + meta
    reply_meta = wire.encode_lookup_reply(LookupReply(bytes([1, 0]), 1, False))
    reply = wire.pack_header(Op.LOOKUP, 7, len(reply_meta), 0, flags=wire.FLAG_REPLY)
    assert f"request `{request.hex()}`" in doc
    assert f"reply `{(reply + reply_meta).hex()}`" in doc


def test_a_batch_over_the_limit_is_refused_from_its_count_alone() -> None:
    import tracemalloc

    from kvtier.errors import BatchTooLargeError

    # 64 MiB of 1-byte keys: refused before a single key is decoded.
    frame = struct.pack("<IH", 64 * 1024 * 1024, 1) + bytes(64 * 1024 * 1024)
    tracemalloc.start()
    try:
        with pytest.raises(BatchTooLargeError, match="exceeds the maximum of 65536"):
            wire.decode_keys(frame, 0, 65536)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    # The same check guards every message that carries keys.
    lookup = wire.encode_lookup(Lookup([b"k"] * 3))
    with pytest.raises(BatchTooLargeError):
        wire.decode_lookup(lookup, max_keys=2)
    meta, _ = wire.encode_put([b"a", b"b", b"c"], [b"", b"", b""])
    with pytest.raises(BatchTooLargeError):
        wire.decode_put(meta, b"", max_keys=2)
    with pytest.raises(BatchTooLargeError):
        wire.decode_reserve(wire.encode_reserve(Reserve([b"a", b"b"], [0, 0])), max_keys=1)


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 1000, 4097])
def test_uniform_and_mixed_key_lists_decode_in_chunks(n: int) -> None:
    uniform = [i.to_bytes(4, "big") for i in range(n)]
    encoded = wire.encode_keys(uniform)
    assert wire.decode_keys(encoded) == (uniform, len(encoded), 4 if n else 0)
    mixed = [b"x" * (i % 7 + 1) for i in range(n)]
    encoded = wire.encode_keys(mixed)
    assert wire.decode_keys(encoded) == (mixed, len(encoded), 0 if n != 1 else 1)


def test_a_sink_receives_data_in_place_and_detach_spares_it() -> None:
    dest = bytearray(200_000)
    reader = FrameReader(
        1 << 20, sink=lambda h, _m: memoryview(dest) if h.request_id == 7 else None
    )
    meta, parts = wire.encode_put([b"k"], [b"\x01" * 150_000])  # any meta + 150 kB of data
    raw = frame_bytes(Op.GET, 7, meta, bytes(parts[0]))
    frames: list[wire.Frame] = []

    def feed(data: bytes) -> None:
        while data:
            buf = reader.get_buffer()
            n = min(len(buf), len(data), 4096)
            buf[:n] = data[:n]
            data = data[n:]
            frames.extend(reader.buffer_updated(n))

    feed(raw[:100_000])
    reader.detach(7)  # the caller gave up: the rest must not touch its buffer
    feed(raw[100_000:])
    (frame,) = frames
    assert frame.header.request_id == 7 and bytes(frame.meta) == meta
    written = 100_000 - wire.HEADER_SIZE - len(meta)
    assert dest[:written] == b"\x01" * written  # before the detach: in place
    assert dest[written:] == bytes(len(dest) - written)  # after it: untouched
    assert reader.idle


def test_a_key_scope_admits_its_namespaces_keys_only_and_escapes_the_defaults() -> None:
    from kvtier.errors import ForbiddenError
    from kvtier.model import NAMESPACE_ESCAPE, client_key, namespace_of, namespace_prefix

    p = namespace_prefix(b"llama")
    own = [b"k1", b"k2", b"k3"]
    meta = wire.encode_keys(own, p)
    keys, _, uniform = wire.decode_keys(meta, 0, None, wire.KeyScope(p))
    assert keys == [p + k for k in own] and uniform == len(p) + 2
    assert {namespace_of(k) for k in keys} == {b"llama"}
    assert [client_key(k, p) for k in keys] == own
    # Another namespace's prefix, a bare key, a mixed list: refused.
    for bad in (
        wire.encode_keys(own, namespace_prefix(b"mistr")),  # same length, other name
        wire.encode_keys([p + b"k1", b"\xff\x05llamX" + b"k2"]),
        wire.encode_keys([p + b"k1", b"plain-key"]),
        wire.encode_keys([p]),  # the prefix alone names no key
    ):
        with pytest.raises(ForbiddenError, match="outside this connection's namespace"):
            wire.decode_keys(bad, 0, None, wire.KeyScope(p))
    # The default namespace: keys as sent, unless they start with the mark.
    forged = [p + b"k1", b"x" * len(p + b"k1")]
    keys, _, uniform = wire.decode_keys(wire.encode_keys(forged), 0, None, wire.KeyScope())
    assert keys == [NAMESPACE_ESCAPE + forged[0], forged[1]] and uniform == 0
    assert namespace_of(keys[0]) == b"" and client_key(keys[0], b"") == forged[0]
    assert client_key(p + b"k1", b"") is None  # a namespaced key is not the default's
    mixed = [b"\xffa", b"bb", b"ccc"]
    keys, _, _ = wire.decode_keys(wire.encode_keys(mixed), 0, None, wire.KeyScope())
    assert keys == [NAMESPACE_ESCAPE + b"\xffa", b"bb", b"ccc"]
    with pytest.raises(ForbiddenError, match="name a namespace"):
        wire.decode_keys(wire.encode_keys(own), 0, None, wire.KeyScope(closed=True))
    assert repr(wire.KeyScope(closed=True)) == "<KeyScope closed>"
