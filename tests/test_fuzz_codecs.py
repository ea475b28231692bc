"""Property-based fuzz of the wire decoders: any bytes either decode or raise the
codec's own error, with memory bounded by the input's size, never more."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier import wire
from kvtier.errors import BatchTooLargeError
from kvtier.model import Lookup, LookupMode, PutHint, PutStatus, Reserve

MAX_KEYS = 65536
#: what a decoder may raise on bad input: the codec's own error, or the batch limit
REFUSALS = (wire.CodecError, BatchTooLargeError)

DECODERS: dict[str, Callable[[bytes], Any]] = {
    "keys": lambda b: wire.decode_keys(b, 0, MAX_KEYS),
    "hello": wire.decode_hello,
    "hello_reply": wire.decode_hello_reply,
    "lookup": lambda b: wire.decode_lookup(b, MAX_KEYS),
    "lookup_reply": wire.decode_lookup_reply,
    "get_reply": lambda b: wire.decode_get_reply(b, b"x" * 64),
    "put": lambda b: wire.decode_put(b, b"x" * 64, MAX_KEYS),
    "reserve": lambda b: wire.decode_reserve(b, MAX_KEYS),
    "status_bytes": wire.decode_status_bytes,
    "tag": wire.decode_tag,
    "json": wire.decode_json,
    "header": wire.unpack_header,
    "stage": lambda b: wire.decode_stage(b, "STAGE"),
    "commit": wire.decode_commit,
    "commit_reply": wire.decode_commit_reply,
    "commit_many": lambda b: wire.decode_commit_many(b, MAX_KEYS),
    "commit_many_reply": lambda b: wire.decode_commit_many_reply(b, 3),
}

fuzz = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _bounded(decode: Callable[[bytes], Any], data: bytes) -> None:
    tracemalloc.start()
    try:
        try:
            decode(data)
        except REFUSALS:
            pass
        except struct.error:
            # unpack_header reads a fixed 24 bytes; shorter input is the caller's to avoid
            assert len(data) < wire.HEADER_SIZE
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Decoded keys and values are copies of the input at most a few times over,
    # plus small per-item objects: never a size the input only claims.
    assert peak <= 64 * len(data) + 64 * 1024


@pytest.mark.parametrize("name", sorted(DECODERS))
@fuzz
@given(data=st.binary(max_size=2048))
def test_any_bytes_decode_or_are_refused(name: str, data: bytes) -> None:
    _bounded(DECODERS[name], data)


@pytest.mark.parametrize("name", ["keys", "lookup", "put", "reserve"])
@fuzz
@given(
    count=st.integers(0, 2**32 - 1), width=st.integers(0, 2**16 - 1), tail=st.binary(max_size=256)
)
def test_claimed_counts_cost_nothing(name: str, count: int, width: int, tail: bytes) -> None:
    """A key list claiming any count and width is refused from its header alone."""
    head = struct.pack("<IH", count, width)
    prefix = {
        "keys": b"",
        "lookup": wire.encode_lookup(Lookup([]))[:-6],
        "put": b"",
        "reserve": struct.pack("<d", 0.0),
    }[name]
    _bounded(DECODERS[name], prefix + head + tail)


keys = st.lists(st.binary(min_size=1, max_size=64), max_size=200)


@fuzz
@given(keys=keys)
def test_key_lists_round_trip(keys: list[bytes]) -> None:
    encoded = wire.encode_keys(keys)
    decoded, end, _ = wire.decode_keys(encoded, 0, MAX_KEYS)
    assert decoded == keys and end == len(encoded)


@fuzz
@given(
    keys=keys,
    mode=st.sampled_from(list(LookupMode)),
    window=st.integers(0, 0xFFFF),
    wait=st.floats(0, 1e6),
    tag=st.binary(max_size=255),
)
def test_lookups_round_trip(
    keys: list[bytes], mode: LookupMode, window: int, wait: float, tag: bytes
) -> None:
    req = Lookup(keys, mode, window, wait, wait / 2, tag)
    assert wire.decode_lookup(wire.encode_lookup(req), MAX_KEYS) == req


@fuzz
@given(pairs=st.lists(st.tuples(st.binary(min_size=1, max_size=32), st.binary(max_size=512))))
def test_puts_and_reserves_round_trip(pairs: list[tuple[bytes, bytes]]) -> None:
    keys = [k for k, _ in pairs]
    values = [v for _, v in pairs]
    meta, data = wire.encode_put(keys, values)
    body = b"".join(bytes(d) for d in data)
    got_keys, got_values, hints = wire.decode_put(meta, body, MAX_KEYS)
    assert got_keys == keys and [bytes(v) for v in got_values] == values and hints is None
    tails = [PutHint.TAIL if len(v) % 2 else PutHint.NONE for v in values]
    meta, _ = wire.encode_put(keys, values, tails)
    assert wire.decode_put(meta, body, MAX_KEYS, hinted=True)[2] == bytes(tails)
    req = Reserve(keys, [len(v) for v in values], 1.5)
    assert wire.decode_reserve(wire.encode_reserve(req), MAX_KEYS) == req


@fuzz
@given(chunks=st.lists(st.binary(max_size=300), max_size=30))
def test_the_frame_reader_survives_any_stream(chunks: list[bytes]) -> None:
    """Bytes in any chunking: frames, or the reader's own error; never anything else."""
    reader = wire.FrameReader(4096, buffer_size=1024, direct_threshold=256)
    try:
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                buf = reader.get_buffer(len(view))
                n = min(len(buf), len(view))
                assert n > 0
                buf[:n] = view[:n]
                view = view[n:]
                for frame in reader.buffer_updated(n):
                    assert len(frame.meta) + len(frame.data) <= 4096
    except wire.CodecError:
        pass


@fuzz
@given(
    offset=st.integers(0, 2**64 - 2),
    length=st.integers(0, 2**32 - 1),
    checksum=st.integers(0, 2**64 - 1),
    keep=st.booleans(),
    in_place=st.booleans(),
    unchecked=st.booleans(),
    key=st.binary(min_size=1, max_size=64),
)
def test_stages_and_commits_round_trip(
    offset: int,
    length: int,
    checksum: int,
    keep: bool,
    in_place: bool,
    unchecked: bool,
    key: bytes,
) -> None:
    assert wire.decode_stage(wire.encode_stage(offset, in_place), "STAGE") == (offset, in_place)
    commit = wire.Commit(key, offset, length, checksum, keep, in_place, unchecked)
    if unchecked and not in_place:
        with pytest.raises(wire.CodecError, match="only a COMMIT in place"):
            wire.decode_commit(wire.encode_commit(commit))
    else:
        assert wire.decode_commit(wire.encode_commit(commit)) == commit
    for status in PutStatus:
        for room in (None, offset):
            reply = wire.encode_commit_reply(status, room)
            assert wire.decode_commit_reply(reply) == (status, room)


@fuzz
@given(
    st.lists(
        st.tuples(
            st.binary(min_size=1, max_size=64),
            st.integers(0, 2**64 - 2),
            st.integers(0, 2**32 - 1),
            st.booleans(),
        ),
        min_size=1,
        max_size=MAX_KEYS,
    )
)
def test_commits_of_many_round_trip(commits: list[tuple[bytes, int, int, bool]]) -> None:
    many = [wire.Commit(k, o, n, 0, keep, True, True) for k, o, n, keep in commits]
    assert wire.decode_commit_many(wire.encode_commit_many(many), MAX_KEYS) == many
    answers = [
        (PutStatus.STORED, o) if keep else (PutStatus.EXISTS, None) for _, o, _, keep in commits
    ]
    reply = wire.encode_commit_many_reply(answers)
    assert wire.decode_commit_many_reply(reply, len(answers)) == answers


def test_a_commit_of_many_is_in_place_unchecked_and_bounded() -> None:
    one = wire.Commit(b"k", 4096, 1 << 20, 0, True, True, True)
    good = wire.encode_commit_many([one, wire.Commit(b"j", 0, 1 << 20, 0, False, True, True)])
    with pytest.raises(wire.CodecError, match="1 to 1 are allowed"):
        wire.decode_commit_many(good, 1)
    with pytest.raises(wire.CodecError, match="1 to"):
        wire.decode_commit_many(b"\0\0\0\0", MAX_KEYS)  # none
    with pytest.raises(wire.CodecError, match="frame too short"):
        wire.decode_commit_many(good[:-2], MAX_KEYS)  # a key cut short
    with pytest.raises(wire.CodecError, match="one key per commit"):
        wire.decode_commit_many(good + b"x", MAX_KEYS)  # more after the keys
    checked = bytearray(good)
    checked[4 + 20] = 0x02  # the first commit in place, but checked
    with pytest.raises(wire.CodecError, match="in place and unchecked"):
        wire.decode_commit_many(bytes(checked), MAX_KEYS)
    with pytest.raises(wire.CodecError, match="does not answer 2 commits"):
        wire.decode_commit_many_reply(wire.encode_commit_reply(PutStatus.STORED, None), 2)
