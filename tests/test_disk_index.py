"""The disk index persists: a snapshot and a journal, loaded at start instead of a scan."""

from __future__ import annotations

import asyncio
import os
import random
import signal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import Client, cli
from kvtier.model import State, namespace_of, namespace_prefix
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.journal import (
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    IndexFormatError,
    Kind,
    Op,
    Record,
    decode,
    encode,
    encode_all,
    header,
    journal_name,
    plan_start,
    replay,
    snapshot_records,
)
from kvtier.tiers.disk.journaling import IndexJournal, read_index
from kvtier.tiers.policy import make_policy
from kvtier.tiers.shares import Quota, Shares
from tests.helpers import DaemonProcess, wait_on_timers

MiB = 1024 * 1024

records_st = st.lists(
    st.builds(
        Record,
        st.sampled_from(Op),
        st.binary(min_size=1, max_size=40),
        st.integers(0, 2**40),
    ),
    max_size=12,
)


@given(st.lists(records_st, max_size=6), st.data())
def test_a_journal_cut_anywhere_reads_as_its_whole_appends(
    appends: list[list[Record]], data: st.DataObject
) -> None:
    body = [encode(records) for records in appends]
    file = header(Kind.JOURNAL, 7) + b"".join(body)
    whole = decode(file, Kind.JOURNAL, 7)
    assert whole.records == [r for a in appends for r in a]
    assert whole.end == len(file) and not whole.torn
    cut = data.draw(st.integers(HEADER.size, len(file)))
    got = decode(file[:cut], Kind.JOURNAL, 7)
    ends = [HEADER.size + sum(len(b) for b in body[: i + 1]) for i in range(len(body))]
    n = sum(1 for e in ends if e <= cut)
    assert got.records == [r for a in appends[:n] for r in a]
    assert got.torn == (cut > (ends[n - 1] if n else HEADER.size))


def test_a_flipped_byte_ends_the_journal_at_its_append() -> None:
    appends = [[Record(Op.ADD, b"k%d-%d" % (i, j), 100 + i) for j in range(3)] for i in range(5)]
    file = bytearray(header(Kind.JOURNAL, 1) + b"".join(encode(a) for a in appends))
    at = HEADER.size + len(encode(appends[0])) * 2 + 15  # inside the third append
    file[at] ^= 0x40
    got = decode(bytes(file), Kind.JOURNAL, 1)
    assert got.records == appends[0] + appends[1] and got.torn


def test_a_snapshot_of_many_records_is_cut_into_frames() -> None:
    index = {b"key-%d" % i: i for i in range(10_000)}
    data = header(Kind.SNAPSHOT, 2) + encode_all(snapshot_records(index))
    decoded = decode(data, Kind.SNAPSHOT, 2)
    assert len(decoded.batches) == 3 and not decoded.torn  # 4096 + 4096 + 1808
    assert replay({}, decoded.batches) == index


def test_files_of_another_kind_version_or_generation_are_refused() -> None:
    good = header(Kind.SNAPSHOT, 3)
    assert decode(good, Kind.SNAPSHOT, 3).records == []
    for data, kind, gen in (
        (good, Kind.JOURNAL, 3),
        (good, Kind.SNAPSHOT, 4),
        (HEADER.pack(MAGIC, FORMAT_VERSION + 1, Kind.SNAPSHOT, 0, 3), Kind.SNAPSHOT, 3),
        (b"XXXX" + good[4:], Kind.SNAPSHOT, 3),
        (good[:5], Kind.SNAPSHOT, 3),
    ):
        with pytest.raises(IndexFormatError):
            decode(data, kind, gen)


def test_a_start_reads_the_newest_snapshot_and_the_journals_since() -> None:
    names = [
        "snapshot.2",
        "journal.1",
        "journal.2",
        "journal.3",
        "snapshot.1",
        "x",
        "snapshot.3.tmp",
    ]
    assert plan_start(names) == (2, [2, 3])
    assert plan_start(["journal.0"]) == (None, [0])
    assert plan_start([]) == (None, [])


def test_the_index_files_survive_compaction_and_a_torn_tail(tmp_path: Path) -> None:
    first = IndexJournal(tmp_path, fsync_each=False)
    loaded = first.load()
    assert loaded.index is None and "no snapshot" in loaded.reason
    first.append([Record(Op.ADD, b"a", 10), Record(Op.ADD, b"b", 20)])
    first.compact()  # snapshot.1: a, b
    first.append([Record(Op.REMOVE, b"a"), Record(Op.ADD, b"c", 30)])
    first.close()
    assert sorted(os.listdir(tmp_path)) == ["journal.1", "snapshot.1"]
    with open(tmp_path / "journal.1", "ab") as fh:  # a crash in the middle of an append
        fh.write(encode([Record(Op.ADD, b"d", 40)])[:9])

    second = IndexJournal(tmp_path, fsync_each=False)
    loaded = second.load()
    assert loaded.index == {b"b": 20, b"c": 30}
    assert (loaded.found.snapshot, loaded.found.records, loaded.found.torn) == (1, 2, True)
    assert second.generation == 2  # this run's changes go to a journal of their own
    second.append([Record(Op.ADD, b"e", 50)])
    second.close()
    third = IndexJournal(tmp_path, fsync_each=False)
    assert third.load().index == {b"b": 20, b"c": 30, b"e": 50}
    third.close()


def test_a_damaged_snapshot_means_a_scan_and_fresh_files(tmp_path: Path) -> None:
    first = IndexJournal(tmp_path, fsync_each=False)
    first.load()
    first.append([Record(Op.ADD, b"a", 10)])
    first.compact()
    first.close()
    snapshot = tmp_path / "snapshot.1"
    data = bytearray(snapshot.read_bytes())
    data[-3] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    second = IndexJournal(tmp_path, fsync_each=False)
    loaded = second.load()
    assert loaded.index is None and "damaged" in loaded.reason
    assert os.listdir(tmp_path) == ["journal.0"]  # the unusable files are gone
    second.close()


async def test_a_restarted_tier_answers_from_its_index_before_any_scan(tmp_path: Path) -> None:
    root = tmp_path / "data"
    first = DiskTier(root, 10 * MiB, fsync="batch")
    first.prepare()
    assert (await first.load_index()).index is None
    await first.rebuild_index()  # nothing to find; the snapshot marks the index whole
    keys = [b"key-%d" % i for i in range(30)]
    for i, key in enumerate(keys):
        await first.write(key, bytes([i]) * 5000, durable=True)
    for key in keys[:10]:
        assert await first.remove(key)
    await first.close()

    second = DiskTier(root, 10 * MiB)
    second.prepare()
    loaded = await second.load_index()
    assert loaded.index is not None and len(loaded.index) == 20
    assert not second.scanning  # lookups answer from the index at once
    assert [second.contains(k) for k in keys] == [False] * 10 + [True] * 20
    await second.rebuild_index()  # the pass over the files finds nothing new
    assert len(second) == 20
    for i, key in enumerate(keys[10:], start=10):
        assert bytes(await second.read(key) or b"") == bytes([i]) * 5000
    await second.close()


async def test_the_pass_over_the_files_adds_unknown_files_and_drops_lost_entries(
    tmp_path: Path,
) -> None:
    root = tmp_path / "data"
    first = DiskTier(root, 10 * MiB, fsync="batch")
    first.prepare()
    await first.load_index()
    await first.rebuild_index()
    keys = [b"key-%d" % i for i in range(40)]
    for key in keys:
        await first.write(key, key * 100, durable=True)
    await first.close()
    # While the daemon is stopped: ten files go behind its back, and a block
    # the index never heard of appears (its journal record lost).
    for key in keys[:10]:
        first.path_of(key).unlink()
    stray = DiskTier(tmp_path / "other", 10 * MiB, fsync="none")
    stray.prepare()
    await stray.load_index()
    await stray.rebuild_index()
    await stray.write(b"unjournalled", b"u" * 700)
    await stray.close()
    first.path_of(b"unjournalled").parent.mkdir(exist_ok=True)  # (its bucket, if new)
    os.rename(stray.path_of(b"unjournalled"), first.path_of(b"unjournalled"))

    second = DiskTier(root, 10 * MiB, fsync="batch")
    second.prepare()
    loaded = await second.load_index()
    assert loaded.index is not None and len(loaded.index) == 40  # as journalled
    assert all(second.contains(k) for k in keys)
    await second.rebuild_index()  # the gentle pass
    assert [second.contains(k) for k in keys] == [False] * 10 + [True] * 30
    assert second.contains(b"unjournalled")
    assert bytes(await second.read(b"unjournalled") or b"") == b"u" * 700
    await second.close()

    third = DiskTier(root, 10 * MiB)
    third.prepare()
    loaded = await third.load_index()  # the pass journalled both
    assert loaded.index is not None
    assert sorted(loaded.index) == sorted([*keys[10:], b"unjournalled"])
    await third.close()


async def test_an_entry_whose_file_lands_during_the_check_is_kept(tmp_path: Path) -> None:
    """A lost entry is checked again while no write of its key can begin: a
    write waits for the check, and the check never drops a file in place."""
    tier = DiskTier(tmp_path / "data", 10 * MiB, fsync="none", io_threads=1)
    tier.prepare()
    await tier.load_index()
    await tier.rebuild_index()
    await tier.write(b"a", b"1" * 100)
    await tier.write(b"b", b"2" * 100)
    tier.path_of(b"a").unlink()  # lost behind the tier's back
    gate = asyncio.Event()
    started = asyncio.Event()

    def hold() -> None:  # occupies the one I/O thread until the gate opens
        started.set()
        asyncio.run_coroutine_threadsafe(gate.wait(), loop).result()

    loop = asyncio.get_running_loop()
    blocker = loop.run_in_executor(tier.executor, hold)
    await started.wait()
    check = asyncio.create_task(tier._drop_missing([b"a", b"b"]))
    await asyncio.sleep(0)  # allow-sleep: let the check claim its keys
    rewrite = asyncio.create_task(tier.write(b"a", b"3" * 100))
    await asyncio.sleep(0)  # allow-sleep: let the write find the check in flight
    assert tier.stats().writes_in_flight == 2  # the check holds both keys; the write waits
    assert not rewrite.done()
    gate.set()
    await blocker
    assert await check == 1  # a's file was gone, b's is in place
    await rewrite  # a write after the drop: a fresh entry, its ADD after the REMOVE
    assert tier.contains(b"a") and tier.contains(b"b")
    assert bytes(await tier.read(b"a") or b"") == b"3" * 100
    await tier.close()
    again = DiskTier(tmp_path / "data", 10 * MiB)
    again.prepare()
    loaded = await again.load_index()
    assert loaded.index is not None and sorted(loaded.index) == [b"a", b"b"]
    await again.close()


@pytest.mark.parametrize("kind", ["lru", "s3fifo", "arc"])
async def test_namespaces_bytes_and_quotas_start_from_the_index(tmp_path: Path, kind: str) -> None:
    def tier() -> DiskTier:
        shares = Shares(
            64 * 1024,
            {b"a": Quota(max=20 * 1024), b"b": Quota()},
            lambda: make_policy(kind),
        )
        return DiskTier(tmp_path / "data", 64 * 1024, fsync="none", policy=shares)

    first = tier()
    first.prepare()
    await first.load_index()
    await first.rebuild_index()
    for i in range(30):  # a's max keeps it near 20 KiB; b takes the rest
        await first.write(namespace_prefix(b"a") + b"%d" % i, b"x" * 1000)
        await first.write(namespace_prefix(b"b") + b"%d" % i, b"y" * 500)
    await first.write(b"plain", b"z" * 300)  # the default namespace
    before = first.stats()
    assert first.budget.shares is not None
    held = dict(first.budget.shares.used)
    await first.close()

    second = tier()
    second.prepare()
    loaded = await second.load_index()
    assert loaded.index is not None
    assert second.budget.shares is not None
    assert second.budget.shares.used == held
    assert second.stats().used_bytes == before.used_bytes
    # a's quota holds from the loaded bytes on: its new blocks evict its own oldest
    oldest_a = next(k for k in loaded.index if namespace_of(k) == b"a")
    await second.write(namespace_prefix(b"a") + b"new", b"x" * 1000)
    assert not second.contains(oldest_a)
    assert second.budget.shares.used[b"a"] <= 20 * 1024
    assert second.budget.shares.used[b"b"] == held[b"b"]
    await second.close()


async def test_a_long_journal_is_compacted_in_the_background(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "data", 10 * MiB, fsync="none", compact_after=500)
    tier.prepare()
    await tier.load_index()
    await tier.rebuild_index()
    before = tier.journal.compactions
    for i in range(60):
        await tier.write(b"k%d" % i, b"v" * 100)
    await tier.close()  # waits for a compaction in flight
    assert tier.journal.compactions > before
    again = DiskTier(tmp_path / "data", 10 * MiB)
    again.prepare()
    loaded = await again.load_index()
    assert loaded.index is not None and len(loaded.index) == 60
    await again.close()


async def test_blocks_stored_one_by_one_are_journalled_in_frames_of_many(tmp_path: Path) -> None:
    """A start reads the journal a frame at a time: the records of blocks
    written one by one (a PUT each, as engines store) are grouped into
    frames, written within GROUP_SECONDS without a sync or a stop, so a
    journal of many PUTs reads as fast as a snapshot of them."""
    tier = DiskTier(tmp_path / "data", 64 * MiB, fsync="none")
    tier.prepare()
    await tier.load_index()
    await tier.rebuild_index()
    n = 2000
    await asyncio.gather(*(tier.write(b"key-%d" % i, b"v" * 100) for i in range(n)))
    journal = tier.journal
    await wait_on_timers(lambda: journal.held == 0)  # (the tier's period writes them)
    data = (journal.directory / journal_name(journal.generation)).read_bytes()
    decoded = decode(data, Kind.JOURNAL, journal.generation)
    assert decoded.count == n and not decoded.torn
    assert len(decoded.batches) <= n // 10  # (one a record before: 2000)
    # killed now: a start reads them all from the files as they are
    found = read_index(journal.directory)
    assert found.index is not None and len(found.index) == n
    await tier.close()


#: kill -9 trials: a few here, many in ``make soak-restart``
TRIALS = int(os.environ.get("KVTIER_RESTART_TRIALS", "2"))


@pytest.mark.parametrize("trial", range(TRIALS))
async def test_kill_9_while_writers_store_and_delete_keeps_every_acknowledged_block(
    sock_dir: Path, trial: int
) -> None:
    """Writers store durably and plainly and delete while the daemon is
    killed (after a number of durable blocks that differs by trial); after a
    restart from the index files every durable block is there, byte for
    byte, no deleted block comes back, no key reads wrong bytes, and no
    temporary file is left."""
    rng = random.Random(trial)
    kill_after = rng.randrange(10, 150)
    proc = DaemonProcess(sock_dir, "--ram-capacity", "2MiB").start()
    durable: dict[bytes, bytes] = {}
    deleted: set[bytes] = set()
    every: dict[bytes, bytes] = {}
    stop = asyncio.Event()
    enough = asyncio.Event()  # kill_after durable blocks acknowledged: time to kill

    async def writer(w: int) -> None:
        async with await Client.connect(proc.socket_path) as c:
            n = 0
            while not stop.is_set():
                n += 1
                key = b"w%d-%d" % (w, n)
                value = rng.randbytes(rng.choice((1000, 20_000, 70_000)))
                every[key] = value
                if n % 3 == 0:
                    await c.put(key, value, durable=True)
                    durable[key] = value
                    if len(durable) >= kill_after:
                        enough.set()
                else:
                    await c.put(key, value)
                if n % 5 == 0:
                    gone = b"w%d-%d" % (w, n - 3)
                    durable.pop(gone, None)  # (a delete in flight may land or not)
                    await c.delete(gone)
                    deleted.add(gone)

    tasks = [asyncio.create_task(writer(w)) for w in range(8)]
    await enough.wait()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)

    restarted = DaemonProcess(sock_dir, "--ram-capacity", "2MiB").start()
    try:
        assert any("index: snapshot" in line for line in restarted.lines), restarted.lines
        async with await Client.connect(restarted.socket_path) as c:
            keys = list(every)
            got = [v for i in range(0, len(keys), 8) for v in await c.get_many(keys[i : i + 8])]
        # The pass over the files (once the daemon is ready) removes what the crash left.
        await asyncio.to_thread(restarted.wait_for_line, "disk index reconciled")
    finally:
        assert restarted.stop() == 0
    for key, value in zip(keys, got, strict=True):
        if key in deleted:
            assert value is None, key
        elif value is not None:
            assert bytes(value) == every[key], key
        if key in durable:
            assert value is not None and bytes(value) == durable[key], key
    assert not list(Path(restarted.data_dir).glob("*/*.tmp-*"))


async def test_disk_check_verifies_a_data_directory_offline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "data"
    tier = DiskTier(root, 10 * MiB, fsync="batch")
    tier.prepare()
    await tier.load_index()
    await tier.rebuild_index()
    for i in range(12):
        await tier.write(b"key-%d" % i, bytes([i]) * 3000)
    await tier.close()
    assert cli.main(["disk", "check", str(root)]) == 0
    out = capsys.readouterr().out
    assert "12 blocks" in out and "block files: 12" in out and out.rstrip().endswith("ok")

    victim = tier.path_of(b"key-3")
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x01
    victim.write_bytes(bytes(data))
    tier.path_of(b"key-4").unlink()
    assert cli.main(["disk", "check", str(root)]) == 1
    out = capsys.readouterr().out
    assert "1 corrupt" in out and "checksum mismatch" in out
    assert "2 entries without a file" in out and out.rstrip().endswith("NOT OK")
    assert cli.main(["disk", "check", str(tmp_path / "nowhere")]) == 2


@pytest.mark.parametrize("damage", ["torn journal", "corrupt snapshot", "older format"])
async def test_a_daemon_restarts_through_damaged_or_older_index_files(
    sock_dir: Path, damage: str
) -> None:
    """A torn journal tail is dropped and the rest loaded; a corrupt
    snapshot, or one of another format version, means a scan, logged, never
    a failed start; every durable block is served either way."""
    keys = [b"durable-%d" % i for i in range(20)]
    proc = DaemonProcess(sock_dir).start()
    async with await Client.connect(proc.socket_path) as c:
        await c.put_many(keys, [bytes([i]) * 4000 for i in range(20)], durable=True)
    assert proc.stop() == 0
    index = Path(proc.data_dir) / "index"
    (snapshot,) = index.glob("snapshot.*")
    (journal,) = sorted(index.glob("journal.*"))[-1:]
    if damage == "torn journal":
        with open(journal, "ab") as fh:
            fh.write(encode([Record(Op.ADD, b"never-written", 4000)])[:-3])
    elif damage == "corrupt snapshot":  # (a frame whose checksum does not match)
        frame = bytearray(encode([Record(Op.ADD, b"k", 4000)]))
        frame[-1] ^= 0xFF
        snapshot.write_bytes(snapshot.read_bytes() + bytes(frame))
    else:
        data = bytearray(snapshot.read_bytes())
        data[4] = FORMAT_VERSION + 1  # the version byte after the magic
        snapshot.write_bytes(bytes(data))

    restarted = DaemonProcess(sock_dir).start()
    try:
        (ready,) = [line for line in restarted.lines if "kvtier ready" in line]
        if damage == "torn journal":
            assert "index: snapshot" in ready and "torn tail dropped" in ready, ready
        else:
            assert "index: scan" in ready, ready
        async with await Client.connect(restarted.socket_path) as c:
            if damage == "torn journal":  # the index is whole from the ready line on
                assert (await c.lookup(keys)).states == [State.HIT] * 20
            await c.lookup(keys, wait=30.0)
            got = await c.get_many(keys)
        # One pass over the files: the scan, or the gentle one after a loaded index.
        ended = "disk index rebuilt" if damage != "torn journal" else "disk index reconciled"
        await asyncio.to_thread(restarted.wait_for_line, ended)
    finally:
        assert restarted.stop() == 0
    passes = [
        line for line in restarted.lines if "disk index rebuilt" in line or "reconciled" in line
    ]
    assert len(passes) == 1, passes
    assert [bytes(g or b"") for g in got] == [bytes([i]) * 4000 for i in range(20)]


async def test_a_first_start_scans_once_and_a_restart_passes_over_the_files_once(
    sock_dir: Path,
) -> None:
    """The pass after the ready line is for an index loaded from its files:
    a first start (nothing to load) scans, and that is its only pass."""
    first = DaemonProcess(sock_dir).start()
    try:
        await asyncio.to_thread(first.wait_for_line, "disk index rebuilt")
        async with await Client.connect(first.socket_path) as c:
            await c.put(b"k", b"v" * 1000, durable=True)
    finally:
        assert first.stop() == 0
    again = DaemonProcess(sock_dir).start()
    try:
        await asyncio.to_thread(again.wait_for_line, "disk index reconciled")
    finally:
        assert again.stop() == 0
    for proc, only in ((first, "disk index rebuilt"), (again, "disk index reconciled")):
        passes = [
            line for line in proc.lines if "disk index rebuilt" in line or "reconciled" in line
        ]
        assert len(passes) == 1 and only in passes[0], passes
