"""Malformed input end to end: each gets its documented error or a closed
connection, and a second client on the same daemon keeps working throughout."""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator

import pytest

from kvtier import BlockingClient, wire
from kvtier.errors import ErrorCode
from kvtier.model import Lookup
from kvtier.wire import Op
from tests.helpers import DaemonProcess, RawConnection, metric_value, rss_bytes


@pytest.fixture(scope="module")
def proc() -> Iterator[DaemonProcess]:
    from tests.helpers import short_tmpdir

    p = DaemonProcess(short_tmpdir(), "--ram-capacity", "64MiB").start()
    yield p
    assert p.stop() == 0


@pytest.fixture
def bystander(proc: DaemonProcess) -> Iterator[BlockingClient]:
    """A well-behaved client that must be unaffected by the misbehaving one."""
    with BlockingClient(proc.socket_path) as client:
        client.put(b"bystander", b"safe")
        yield client
        assert client.get(b"bystander") == b"safe"
        assert client.ping(b"ok") == b"ok"


@pytest.fixture
def raw(proc: DaemonProcess) -> Iterator[RawConnection]:
    conn = RawConnection(proc.socket_path)
    yield conn
    conn.close()


def expect_error(raw: RawConnection, rid: int, code: ErrorCode) -> str:
    frame = raw.recv_frame()
    assert frame.header.request_id == rid
    assert frame.header.flags & wire.FLAG_REPLY
    assert frame.header.status == code, wire.decode_error(frame.meta)
    return wire.decode_error(frame.meta)


def assert_still_usable(raw: RawConnection) -> None:
    raw.send_frame(Op.PING, 999, b"alive")
    frame = raw.recv_frame()
    assert (frame.header.request_id, frame.meta, frame.header.status) == (999, b"alive", 0)


def test_unknown_opcode(raw: RawConnection, bystander: BlockingClient) -> None:
    raw.send_frame(0x7E, 5)
    assert "unknown opcode 0x7e" in expect_error(raw, 5, ErrorCode.UNKNOWN_OPCODE)
    assert_still_usable(raw)


def test_malformed_reserve(raw: RawConnection, bystander: BlockingClient) -> None:
    raw.send_frame(Op.RESERVE, 6, wire.encode_keys([b"k"]))  # no deadline, no sizes
    assert "RESERVE" in expect_error(raw, 6, ErrorCode.MALFORMED)
    assert_still_usable(raw)


def test_wrong_version(raw: RawConnection, bystander: BlockingClient) -> None:
    raw.send_frame(Op.PING, 7, b"x", version=9)
    assert "version 9" in expect_error(raw, 7, ErrorCode.UNSUPPORTED_VERSION)
    assert_still_usable(raw)


def test_hello_without_common_version(raw: RawConnection, bystander: BlockingClient) -> None:
    raw.send_frame(Op.HELLO, 8, wire.encode_hello(wire.Hello(2, 5, "future")))
    expect_error(raw, 8, ErrorCode.UNSUPPORTED_VERSION)
    assert_still_usable(raw)


@pytest.mark.parametrize(
    ("keys", "fragment"),
    [([b""], "key 0 is 0 bytes"), ([b"ok", b"x" * 257], "key 1 is 257 bytes")],
)
def test_bad_keys(
    raw: RawConnection, bystander: BlockingClient, keys: list[bytes], fragment: str
) -> None:
    for op in (Op.GET, Op.DELETE):
        raw.send_frame(op, 10, wire.encode_keys(keys))
        assert fragment in expect_error(raw, 10, ErrorCode.BAD_KEY)
    raw.send_frame(Op.LOOKUP, 11, wire.encode_lookup(Lookup(keys)))
    expect_error(raw, 11, ErrorCode.BAD_KEY)
    meta, data = wire.encode_put(keys, [b"v"] * len(keys))
    raw.send_frame(Op.PUT, 12, meta, b"".join(data))
    expect_error(raw, 12, ErrorCode.BAD_KEY)
    assert_still_usable(raw)


def test_oversized_value_stores_nothing(raw: RawConnection, bystander: BlockingClient) -> None:
    meta, _ = wire.encode_put([b"small", b"huge"], [b"v", b""])
    big = 16 * 1024 * 1024 + 1
    meta = wire.encode_keys([b"small", b"huge"]) + struct.pack("<2I", 1, big)
    raw.send_frame(Op.PUT, 13, meta, b"v" + bytes(big))
    assert "maximum block size" in expect_error(raw, 13, ErrorCode.VALUE_TOO_LARGE)
    raw.send_frame(Op.GET, 14, wire.encode_keys([b"small"]))
    frame = raw.recv_frame()
    assert wire.decode_get_reply(frame.meta, frame.data) == [None]  # nothing half-stored
    assert_still_usable(raw)


def test_batch_too_large(raw: RawConnection, bystander: BlockingClient) -> None:
    keys = [i.to_bytes(4, "big") for i in range(65537)]
    raw.send_frame(Op.GET, 15, wire.encode_keys(keys))
    expect_error(raw, 15, ErrorCode.BATCH_TOO_LARGE)
    # A whole frame of 1-byte keys: refused from its count, before decoding.
    n = 64 * 1024 * 1024 - 4096
    raw.send_frame(
        Op.LOOKUP, 16, wire.encode_lookup(Lookup([]))[:-6] + struct.pack("<IH", n, 1) + bytes(n)
    )
    assert "exceeds the maximum of 65536" in expect_error(raw, 16, ErrorCode.BATCH_TOO_LARGE)
    assert_still_usable(raw)


def test_malformed_message_body(raw: RawConnection, bystander: BlockingClient) -> None:
    raw.send_frame(Op.GET, 16, struct.pack("<IH", 50, 32) + b"short")
    assert "frame too short" in expect_error(raw, 16, ErrorCode.MALFORMED)
    raw.send_frame(Op.LOOKUP, 17, b"\x00")
    expect_error(raw, 17, ErrorCode.MALFORMED)
    raw.send_frame(Op.PING, 18, flags=0x0100)
    assert "unknown flags" in expect_error(raw, 18, ErrorCode.MALFORMED)
    raw.send_frame(Op.PING, 19, flags=wire.FLAG_REPLY)
    expect_error(raw, 19, ErrorCode.MALFORMED)
    assert_still_usable(raw)


def test_oversized_frame_closes_only_that_connection(
    raw: RawConnection, bystander: BlockingClient
) -> None:
    raw.send(wire.pack_header(Op.PUT, 20, 0, 0xFFFFFFFF))
    assert "exceeds the maximum frame size" in expect_error(raw, 20, ErrorCode.FRAME_TOO_LARGE)
    assert raw.at_eof()


def test_garbage_closes_only_that_connection(raw: RawConnection, bystander: BlockingClient) -> None:
    raw.send(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert "bad magic" in expect_error(raw, 0, ErrorCode.MALFORMED)
    assert raw.at_eof()


def scrape_until(proc: DaemonProcess, done: Callable[[str], bool], tries: int = 200) -> str:
    """Scrape until ``done`` holds: each scrape is a full turn of the daemon's loop."""
    for _ in range(tries):
        text = proc.scrape()
        if done(text):
            return text
    raise AssertionError("the daemon never reached the expected state")


def test_truncated_frame_then_hangup(proc: DaemonProcess, bystander: BlockingClient) -> None:
    before = proc.scrape()
    truncated = metric_value(before, "kvtier_protocol_errors_total", 'code="truncated_frame"')
    opened = metric_value(before, "kvtier_connections_open")
    conn = RawConnection(proc.socket_path)
    meta, data = wire.encode_put([b"torn"], [b"x" * 100_000])
    frame = wire.pack_header(Op.PUT, 21, len(meta), 100_000) + meta + data[0]
    conn.send(frame[: len(frame) // 2])
    conn.sock.shutdown(2)
    conn.close()
    after = scrape_until(
        proc, lambda t: metric_value(t, "kvtier_connections_open") == opened
    )  # the daemon closed its side
    assert metric_value(after, "kvtier_protocol_errors_total", 'code="truncated_frame"') == (
        truncated + 1
    )
    assert bystander.get(b"torn") is None  # a torn frame stores nothing


def test_client_that_never_reads_does_not_stall_others(
    proc: DaemonProcess, bystander: BlockingClient
) -> None:
    block = 8 * 1024 * 1024
    bystander.put(b"big", bytes(block))
    rss_before = rss_bytes(proc.pid)
    received_before = metric_value(proc.scrape(), "kvtier_received_bytes_total")
    hog = RawConnection(proc.socket_path, timeout=0.5)
    request = wire.encode_keys([b"big"])
    sent = 0
    with pytest.raises(TimeoutError):  # the daemon stopped reading: our send blocks
        for rid in range(1_000_000):  # 8 TB of replies, were they all served
            hog.send_frame(Op.GET, rid, request)
            sent += 1
    assert bystander.get(b"big") == bytes(block)
    received = metric_value(proc.scrape(), "kvtier_received_bytes_total") - received_before
    frame_len = wire.HEADER_SIZE + len(request)
    # It read what fills its buffers and the in-flight limit, not what we sent.
    assert received < sent * frame_len
    # Replies to a client that never reads are not materialised without bound:
    # far less than the 8 MiB x requests it asked for.
    assert rss_bytes(proc.pid) - rss_before < 64 * block
    hog.close()


def test_protocol_errors_are_counted(proc: DaemonProcess, bystander: BlockingClient) -> None:
    def counts(text: str) -> tuple[float, float]:
        return (
            metric_value(text, "kvtier_protocol_errors_total", 'code="unknown_opcode"'),
            metric_value(text, "kvtier_requests_total", 'op="get",outcome="bad_key"'),
        )

    unknown, bad_key = counts(proc.scrape())
    with RawConnection(proc.socket_path) as raw:
        raw.send_frame(0x7E, 1)
        expect_error(raw, 1, ErrorCode.UNKNOWN_OPCODE)
        raw.send_frame(Op.GET, 2, wire.encode_keys([b""]))
        expect_error(raw, 2, ErrorCode.BAD_KEY)
    assert counts(proc.scrape()) == (unknown + 1, bad_key + 1)
