"""kvtier.blockcopy: a block's copy into shared memory, and the faults
before it."""

from __future__ import annotations

import ctypes
import mmap
import os
import platform

import pytest

from kvtier import addresses, blockcopy

MiB = 1024 * 1024
PAGE = os.sysconf("SC_PAGE_SIZE")


def test_the_streaming_copy_is_built_where_make_test_runs() -> None:
    """``make test`` installs the package with its extension; a build that
    failed quietly (it is optional) would leave every copy memcpy's."""
    if os.environ.get("KVTIER_REQUIRE_TOOLS") != "1" or platform.machine() != "x86_64":
        pytest.skip("only make test on x86-64 requires the extension")
    assert blockcopy.STREAMING


@pytest.fixture(params=["extension", "memcpy"])
def built(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each copy test runs with the extension (where it is built) and
    without it, as a package installed with no compiler copies."""
    if request.param == "extension" and not blockcopy.BUILT:
        pytest.skip("the extension is not built here")
    if request.param == "memcpy":
        monkeypatch.setattr("kvtier.blockcopy._blockcopy", None)
    return str(request.param)


@pytest.mark.parametrize("length", [0, 1, 15, 16, 63, 64, 65, 4096, 64 * 1024 - 1, MiB + 7])
@pytest.mark.parametrize("shift", [0, 1, 8, 15])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "cached"])
def test_copy_into_leaves_the_source_bytes_and_nothing_past_them(
    built: str, length: int, shift: int, stream: bool
) -> None:
    """Any length, any alignment of either side (the streamed body starts at
    the destination's first 16-byte boundary; head and tail are copied
    plainly), streamed or through the caches: the first ``length`` bytes
    are the source's, the rest untouched."""
    source = bytes((i * 7 + 3) % 251 for i in range(length + 3))[3:]  # (unaligned start)
    dest = bytearray(b"\xee" * (length + 40))
    view = memoryview(dest)[shift : shift + length + 20]
    blockcopy.copy_into(view, source, stream=stream)
    assert dest[shift : shift + length] == source
    assert dest[:shift] == b"\xee" * shift
    assert dest[shift + length :] == b"\xee" * (len(dest) - shift - length)


def test_copy_into_takes_any_contiguous_buffer_and_refuses_a_short_destination(built: str) -> None:
    dest = bytearray(16)
    blockcopy.copy_into(memoryview(dest), memoryview(b"abcdefgh"))
    cells = (ctypes.c_char * 4).from_buffer_copy(b"wxyz")  # a ctypes array: format "<c"
    blockcopy.copy_into(memoryview(dest)[8:], memoryview(cells))
    assert bytes(dest) == b"abcdefghwxyz\x00\x00\x00\x00"
    with pytest.raises(ValueError, match="does not fit"):
        blockcopy.copy_into(memoryview(dest)[:4], b"too long")
    with pytest.raises(ValueError, match="does not fit"):
        blockcopy.copy_into(memoryview(dest)[:4], b"too long" * 10**4, stream=False)
    assert bytes(dest[:4]) == b"abcd"  # nothing written
    with pytest.raises(TypeError):
        blockcopy.copy_into(memoryview(b"read-only"), b"x")


@pytest.mark.parametrize("fault", [False, True], ids=["", "faulted-in"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "cached"])
def test_copy_many_copies_each_pair_as_copy_into_does(
    built: str, stream: bool, fault: bool
) -> None:
    """A batch of blocks, short and long, at any alignment, each destination
    mapped first or not: each holds its source's bytes and, past them, what
    it held."""
    lengths = [0, 5, 64 * 1024 - 1, 64 * 1024, MiB + 7, 300]
    sources = [os.urandom(n) for n in lengths]
    dests = [bytearray(b"\xee" * (n + 9)) for n in lengths]
    views = [memoryview(d)[i % 4 :] for i, d in enumerate(dests)]
    blockcopy.copy_many(views, sources, stream=stream, fault=fault)
    for i, (dest, source) in enumerate(zip(dests, sources, strict=True)):
        shift = i % 4
        assert dest[shift : shift + len(source)] == source
        assert dest[:shift] == b"\xee" * shift
        assert dest[shift + len(source) :] == b"\xee" * (len(dest) - shift - len(source))


def test_copy_many_checks_every_pair_before_it_copies_any(built: str) -> None:
    """A source that does not fit, even the last, leaves every destination
    as it was; so do lists of different lengths; a read-only destination
    is refused."""
    dests = [bytearray(MiB), bytearray(MiB), bytearray(10)]
    sources = [b"\x01" * MiB, b"\x02" * MiB, b"\x03" * 11]
    with pytest.raises(ValueError, match="does not fit"):
        blockcopy.copy_many([memoryview(d) for d in dests], sources)
    assert dests[0] == dests[1] == bytes(MiB) and dests[2] == bytes(10)
    with pytest.raises(ValueError, match="one source per destination"):
        blockcopy.copy_many([memoryview(dests[0])], sources)
    assert dests[0] == bytes(MiB)
    with pytest.raises((TypeError, BufferError)):
        blockcopy.copy_many([memoryview(b"read-only")], [b"x"])
    blockcopy.copy_many([], [])


def test_a_copy_into_a_shared_mapping_is_seen_through_another_mapping(built: str) -> None:
    """What a writer in place does: copy a block into its room of the arena;
    the daemon's own mapping of the same file reads the same bytes."""
    fd = os.memfd_create("blockcopy")
    try:
        os.ftruncate(fd, 4 * MiB)
        with mmap.mmap(fd, 4 * MiB) as writer, mmap.mmap(fd, 4 * MiB) as reader:
            block = os.urandom(MiB + 5)
            room = memoryview(writer)[MiB + 3 : 2 * MiB + 8]
            blockcopy.fault_in(room)
            blockcopy.copy_into(room, block)
            room.release()
            assert reader[MiB + 3 : 2 * MiB + 8] == block
    finally:
        os.close(fd)


def mapped_pages(view: memoryview) -> list[bool]:
    """Whether each page of ``view`` is mapped in this process (/proc/self/pagemap)."""
    start = addresses.address_of(view)[0]
    first, last = start // PAGE, (start + view.nbytes - 1) // PAGE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    return [
        bool(int.from_bytes(entries[i : i + 8], "little") >> 63) for i in range(0, len(entries), 8)
    ]


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="Linux only")
def test_fault_in_maps_every_page_of_a_span_another_mapping_wrote() -> None:
    fd = os.memfd_create("fault-in")
    try:
        os.ftruncate(fd, 1 * MiB)
        with mmap.mmap(fd, MiB) as writer:
            writer[:] = b"\x01" * MiB  # the file's pages exist, mapped over there
            with mmap.mmap(fd, MiB) as here:
                whole = memoryview(here)
                # unaligned at both ends, over more than one fault-around window
                span = whole[PAGE + 1 : PAGE + 1 + 3 * blockcopy.FAULT_AROUND - 2]
                assert not any(mapped_pages(span))
                blockcopy.fault_in(span)
                assert all(mapped_pages(span))
                blockcopy.fault_in(whole[:0])  # nothing to map
                span.release()
                whole.release()
    finally:
        os.close(fd)


@pytest.mark.skipif(not blockcopy.BUILT, reason="the extension is not built here")
def test_populate_allocates_a_shared_files_pages_and_changes_no_byte() -> None:
    fd = os.memfd_create("kvtier-test-populate")
    try:
        os.ftruncate(fd, 8 * 4096)
        with mmap.mmap(fd, 8 * 4096) as mapping:
            mapping[4096:4100] = b"kept"  # a block already there
            with memoryview(mapping) as view:
                assert os.fstat(fd).st_blocks * 512 == 4096
                assert blockcopy.populate(view[4096:]) is True  # (Linux 5.14 on)
                assert os.fstat(fd).st_blocks * 512 == 7 * 4096  # the span's pages, not the first
                assert bytes(view[4096:4100]) == b"kept"
                blockcopy.fault_in(view)  # reads only
                assert bytes(view[4096:4100]) == b"kept" and not any(view[:4096])
                with pytest.raises(ValueError, match="step"):
                    blockcopy._blockcopy.touch(view, 0)  # type: ignore[union-attr]
    finally:
        os.close(fd)
