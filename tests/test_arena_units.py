"""The shared arena's pure parts alone: the extent allocator, the lease table."""

from __future__ import annotations

import mmap
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.core.shared.leases import LeaseEnd, LeaseTable
from kvtier.model import ConnId
from kvtier.tiers.ram import ExtentAllocator, OutOfArena

PAGE = 4096


def test_blocks_round_up_to_whole_pages() -> None:
    a = ExtentAllocator(64 * PAGE)
    assert a.block_size(1) == PAGE
    assert a.block_size(PAGE + 1) == 2 * PAGE
    assert a.block_size(300_000) == 74 * PAGE  # 1% over, not 512 KiB
    x = a.alloc(3 * PAGE)
    assert a.allocated_bytes == 3 * PAGE and a.free_bytes == 61 * PAGE
    a.free(x)
    assert a.is_pristine()


def test_a_full_or_fragmented_arena_says_so() -> None:
    a = ExtentAllocator(4 * PAGE)
    blocks = [a.alloc(PAGE) for _ in range(4)]
    with pytest.raises(OutOfArena, match="0 bytes free"):
        a.alloc(1)
    a.free(blocks[0])
    a.free(blocks[2])  # two free pages that do not touch: no 2-page extent
    with pytest.raises(OutOfArena, match="largest 4096"):
        a.alloc(2 * PAGE)
    a.free(blocks[1])  # 0, 1 and 2 merge into one extent
    assert a.alloc(3 * PAGE) == 0
    with pytest.raises(OutOfArena, match="no free extent"):
        a.alloc(5 * PAGE)
    with pytest.raises(ValueError, match="not an allocated block"):
        a.free(12345)


def test_blocks_of_one_size_reuse_freed_extents_exactly() -> None:
    a = ExtentAllocator(10 * 74 * PAGE)
    blocks = [a.alloc(300_000) for _ in range(10)]
    assert a.free_bytes == 0
    a.free(blocks[3])
    a.free(blocks[7])
    assert sorted(a.alloc(300_000) for _ in range(2)) == [blocks[3], blocks[7]]
    assert "free_extents=0" in repr(a)


@settings(max_examples=200, deadline=None)
@given(
    pages=st.integers(1, 300),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40 * PAGE)), max_size=120),
)
def test_random_sequences_never_overlap_and_merge_back(
    pages: int, ops: list[tuple[bool, int]]
) -> None:
    a = ExtentAllocator(pages * PAGE)
    live: dict[int, int] = {}
    for do_alloc, size in ops:
        if do_alloc or not live:
            try:
                offset = a.alloc(size)
            except OutOfArena:
                assert a.largest_free < a.block_size(size)
                continue
            block = a.block_size(size)
            assert offset % PAGE == 0 and offset + block <= a.size
            for other, other_size in live.items():
                assert offset + block <= other or other + other_size <= offset
            live[offset] = block
        else:
            offset = next(iter(live))
            a.free(offset)
            del live[offset]
        assert a.allocated_bytes == sum(live.values())
        assert a.free_bytes + a.allocated_bytes == a.size
    for offset in list(live):
        a.free(offset)
    assert a.is_pristine()


def test_leases_end_once_by_release_close_or_revoke() -> None:
    ended: list[tuple[tuple[bytes, ...], LeaseEnd]] = []
    table = LeaseTable(on_end=lambda lease, end: ended.append((lease.keys, end)))
    a, b = ConnId(1), ConnId(2)
    late = table.grant(b, (b"j",), deadline=5.0)
    first = table.grant(a, (b"k", b"l", b"m"), deadline=10.0)  # one lease, three blocks
    table.grant(a, (b"k",), deadline=10.0)
    assert len(table) == 3
    assert table.release(b, first.lease_id) is False  # not b's lease
    assert table.release(a, first.lease_id) is True
    assert table.release(a, first.lease_id) is False  # once only
    assert table.expire(4.9) == 0
    assert table.expire(5.0) == 1  # b's lease is past its deadline
    assert table.release(b, late.lease_id) is False  # already revoked
    assert table.close(a) == 1  # a's remaining lease ends with its connection
    assert ended == [
        ((b"k", b"l", b"m"), LeaseEnd.RELEASED),
        ((b"j",), LeaseEnd.REVOKED),
        ((b"k",), LeaseEnd.CLOSED),
    ]
    assert len(table) == 0
    assert table.expire(100.0) == 0
    assert "live=0" in repr(table) and "revoked=1" in repr(table)
    assert table.ended == {LeaseEnd.RELEASED: 1, LeaseEnd.CLOSED: 1, LeaseEnd.REVOKED: 1}


def test_an_arena_handed_over_a_unix_socket_is_read_in_place_read_only() -> None:
    import socket

    from kvtier.tiers.ram import Arena, map_readonly

    arena = Arena(16 * PAGE)
    daemon_side, client_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        slot = arena.allocate(5000)
        view = arena.view(slot)
        view[:] = bytes(range(256)) * 19 + bytes(136)
        handed = arena.readonly_fd()
        socket.send_fds(daemon_side, [b"arena"], [handed])
        os.close(handed)
        _, fds, _, _ = socket.recv_fds(client_side, 16, 1)
        with pytest.raises(PermissionError):  # the descriptor cannot be mapped writable
            mmap.mmap(fds[0], arena.size)
        mapped = map_readonly(fds[0], arena.size)
        seen = memoryview(mapped)[slot.offset : slot.offset + slot.length]
        assert bytes(seen) == bytes(view)
        view[:4] = b"new!"  # the daemon's write shows through the client's mapping
        assert bytes(seen[:4]) == b"new!"
        with pytest.raises(TypeError):
            seen[0] = 1  # read-only for the client
        seen.release()
        mapped.close()
        os.close(fds[0])
        view.release()
        arena.free(slot)
        assert arena.allocator.is_pristine()
    finally:
        daemon_side.close()
        client_side.close()
        arena.close()
