"""How far a reader must follow one request: calls, files and switches between files.

A daemon runs in a thread of its own, on its own event loop; a profiler
(``sys.setprofile``, which sees only the thread it is set in) records every
call of a Python function defined in a kvtier module while a request is
measured, once the daemon has served one request of the same kind for
another key (so first-use set-up, such as a counter's first label, is not
counted). The
request is sent from the main thread, so the client's own
calls are not counted. Counted: everything of kvtier's the request runs in
the daemon, from the connection's receipt of its bytes to the reply's
write: the transport (connection, framing, flow control, the request's
counters and task), the op table and everything below it (core, tiers,
codecs, the scheduler loop, background tasks the request starts). Not
counted: the loop's idle poll, which runs by the clock, not by the request;
a coroutine resuming after an await (it is one call, however
often it waits); a list, dict or set
comprehension, an expression of the function it sits in (Python 3.12 runs
it inline, PEP 709); and the measurement's own wait for the daemon to be
idle (``Daemon.settle``).

``python -m tests.pathcount`` prints the figures of the traced paths:

* a GET of a key that only the disk holds (a fresh daemon over a data
  directory a previous daemon left);
* a LOOKUP of a key RAM holds, answered by the lookup process: its calls
  in the process (its listener on a thread of its own, wired as its main
  wires it) and the daemon's for the report it gets back;
* a LOOKUP of a key that only S3 holds: one LOOKUP answering RETRY (the
  probe starts), then one that waits (``wait``) until the key reads HIT
  (probe answered, promotion landed).
"""

from __future__ import annotations

import asyncio
import inspect
import mmap
import os
import shutil
import socket
import sys
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, TypeVar

import kvtier
from kvtier import loops
from kvtier.client import Client
from kvtier.config import load_config
from kvtier.core.timers import Scheduler
from kvtier.daemon import Daemon
from kvtier.model import FeedOp, LookupMode, LookupReply
from kvtier.replica.__main__ import build as build_lookup_process
from kvtier.replica.settings import Settings
from kvtier.server.ops import NamespaceAccess
from kvtier.wire.replica import RING_HEADER, FeedRing
from tests.helpers import short_tmpdir, wait_on_timers

if TYPE_CHECKING:  # (the S3 stack is imported only where S3 is measured)
    from tests.s3server import ProxiedS3

T = TypeVar("T")

PACKAGE = str(Path(kvtier.__file__).resolve().parent) + "/"

#: the loop's idle poll (``loops.IdlePoll``) runs by the clock while the
#: loop waits, as often as the machine's timing makes it: not the request's
CLOCKED = frozenset({"loops.py"})

#: comprehensions are expressions of the function they sit in: Python 3.12
#: inlines them (PEP 709), 3.11 still runs each in a frame of its own
COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>"})

#: the daemon's periodic housekeeping (leases and rooms past their
#: deadlines, ...): what it calls is on no request's path, whenever it runs
_PERIODIC = next(
    c for c in Scheduler.every.__code__.co_consts if isinstance(c, CodeType) and c.co_name == "tick"
)

_SUSPENDABLE = inspect.CO_COROUTINE | inspect.CO_GENERATOR | inspect.CO_ASYNC_GENERATOR

KEY = bytes.fromhex("aa" * 32)
#: read the same way just before the measured request: a warm daemon is measured
WARM = bytes.fromhex("bb" * 32)
VALUE = bytes(range(256)) * 1024  # 256 KiB


@dataclass
class PathCount:
    """The kvtier calls one measured request made, in order."""

    calls: list[tuple[str, str]] = field(default_factory=list)
    #: coroutine and generator frames already counted (held, so ids stay unique)
    frames: dict[int, FrameType] = field(default_factory=dict, repr=False)

    @property
    def files(self) -> set[str]:
        return {f for f, _ in self.calls}

    @property
    def switches(self) -> int:
        return sum(1 for a, b in zip(self.calls, self.calls[1:], strict=False) if a[0] != b[0])

    def by_function(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f, name in self.calls:
            out[f"{f}:{name}"] = out.get(f"{f}:{name}", 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def __str__(self) -> str:
        return f"{len(self.calls)} calls in {len(self.files)} files, {self.switches} switches"


def _periodic(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs within the daemon's periodic housekeeping."""
    while frame is not None:
        if frame.f_code is _PERIODIC:
            return True
        frame = frame.f_back
    return False


class ThreadedLoop:
    """An event loop in a thread of its own, with a switchable call recorder."""

    def __init__(self) -> None:
        self.loop = loops.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._count: PathCount | None = None
        #: the measurement's own waiting is not counted
        self._helpers = {Daemon.settle.__code__, wait_on_timers.__code__}
        self.run(self._install())

    async def _install(self) -> None:
        sys.setprofile(self._record)  # this thread only

    async def _uninstall(self) -> None:
        sys.setprofile(None)

    def _record(self, frame: FrameType, event: str, _arg: object) -> None:
        count = self._count
        if event != "call" or count is None:
            return
        code = frame.f_code
        filename = code.co_filename
        if not filename.startswith(PACKAGE):
            return
        rel = filename[len(PACKAGE) :]
        if rel in CLOCKED or code in self._helpers or code.co_name in COMPREHENSIONS:
            return
        caller = frame.f_back
        if caller is not None and caller.f_code in self._helpers:
            return
        if _periodic(frame):
            return
        if code.co_flags & _SUSPENDABLE:
            if id(frame) in count.frames:
                return  # a coroutine resumed after an await is not a new call
            count.frames[id(frame)] = frame
        count.calls.append((rel, code.co_name))

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def measure(self) -> PathCount:
        """Start recording; stop with :meth:`stop_measuring`."""
        self._count = PathCount()
        return self._count

    def stop_measuring(self, until: Callable[[], bool] | None = None) -> None:
        """Stop recording once ``until()`` holds (not counted)."""

        async def done() -> None:
            if until is not None:
                await wait_on_timers(until)
            self._count = None

        self.run(done())

    def close(self) -> None:
        self.run(self._uninstall())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class ThreadedDaemon(ThreadedLoop):
    """A daemon on its own thread's loop."""

    def __init__(self, overrides: dict[str, Any]) -> None:
        super().__init__()
        self.daemon = Daemon(load_config(None, overrides))
        self._task = asyncio.run_coroutine_threadsafe(self.daemon.run(), self.loop)
        self.run(self._ready())

    async def _ready(self) -> None:
        daemon = self.daemon
        await daemon.ready.wait()
        if daemon.disk is not None and daemon.disk.scan_done is not None:
            await daemon.disk.scan_done
        await daemon.settle()  # (the rebuild's compaction, after the scan)

    def stop_measuring(self, until: Callable[[], bool] | None = None) -> None:
        """Stop recording once ``until()`` holds and the background work the
        request started is done."""

        async def idle() -> None:
            if until is not None:
                await wait_on_timers(until)
            await self.daemon.settle()
            self._count = None

        self.run(idle())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.daemon.stop)
        self._task.result(60)
        super().close()


class ThreadedLookupProcess(ThreadedLoop):
    """The lookup process's listener, wired as its ``__main__`` wires it, on
    its own thread's loop, over a feed ring this object writes as the
    daemon would, and a report socket nobody reads (reports only queue)."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        ring_fd = os.memfd_create("kvtier-feed", os.MFD_CLOEXEC)
        os.ftruncate(ring_fd, RING_HEADER + (1 << 16))
        #: the daemon's end of the ring (unmapped when collected)
        self.ring = FeedRing(memoryview(mmap.mmap(ring_fd, 0)))
        self._ours, theirs = socket.socketpair()
        settings = Settings(
            report_fd=theirs.detach(),
            ring_fd=ring_fd,
            path=str(path),
            mode=0o600,
            uids=None,
            gids=[],
            access=NamespaceAccess().to_json(),
            max_key_bytes=256,
            max_batch=1024,
            max_block_bytes=1 << 20,
            max_frame_bytes=4 << 20,
            server_name="pathcount",
            remotes=False,
        )
        self.listener, _ = build_lookup_process(settings)
        self._serving = asyncio.run_coroutine_threadsafe(
            self.listener.serve(path, settings.mode), self.loop
        )
        self.run(wait_on_timers(path.exists))  # listening

    def close(self) -> None:
        self._ours.close()  # the daemon's end: the process sees its feed end, and stops
        self._serving.result(60)
        super().close()


async def _put(sock_dir: Path, durable: bool = False) -> None:
    """Store the measured key and the warm-up one."""
    async with await Client.connect(sock_dir / "d.sock") as c:
        await c.put_many([WARM, KEY], [VALUE, VALUE], durable=durable)


def _overrides(sock_dir: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        # The daemon's own paths: without a lookup process, whose feed is a
        # path of its own (one record per change of what is held, written by
        # server/lookups.py and wire/replica.py; docs/lookup-process.md).
        "server": {"socket_path": sock_dir / "d.sock", "lookup_process": False},
        "metrics": {"enabled": False},
        "ram": {"capacity": "64MiB"},
        "disk": {"path": sock_dir / "data", "capacity": "256MiB"},
        # No periodic sweep fires inside a measured request.
        "lookup": {"sweep_interval": 3600},
    }
    for name, values in sections.items():
        out.setdefault(name, {}).update(values)
    return out


def disk_only_get(sock_dir: Path) -> PathCount:
    """A GET of a key that a previous daemon left on disk only."""
    first = ThreadedDaemon(_overrides(sock_dir))
    try:
        asyncio.run(_put(sock_dir, durable=True))
    finally:
        first.close()
    daemon = ThreadedDaemon(_overrides(sock_dir))
    try:

        async def get() -> tuple[PathCount, bytes | None]:
            async with await Client.connect(sock_dir / "d.sock", shared=False) as c:
                assert await c.get(WARM) == VALUE  # a daemon that has served such a GET
                await c.ping()  # that GET's reply is out and its pins let go
                count = daemon.measure()
                value = await c.get(KEY)
                await asyncio.to_thread(daemon.stop_measuring)
                return count, None if value is None else bytes(value)

        count, value = asyncio.run(get())
        assert value == VALUE
        return count
    finally:
        daemon.close()


def s3_only_lookup(sock_dir: Path, s3: ProxiedS3) -> PathCount:
    """A LOOKUP of a key only S3 holds, until it reads HIT: the first answers
    RETRY, the second waits while the probe is held at the store, so it
    takes the same steps however busy the machine is."""
    remote = {"remote_tiers": [s3.tier_config(s3.new_bucket())]}
    first = ThreadedDaemon({**_overrides(sock_dir), **remote})
    try:
        asyncio.run(_put(sock_dir))  # written through to S3 in the background
        first.stop_measuring()  # waits for the write-through
    finally:
        first.close()
    shutil.rmtree(sock_dir / "data", ignore_errors=True)
    daemon = ThreadedDaemon({**_overrides(sock_dir, disk={"enabled": False}), **remote})
    try:

        async def lookups() -> tuple[PathCount, LookupReply, LookupReply]:
            async with await Client.connect(sock_dir / "d.sock", shared=False) as c:
                # A daemon that has served such a LOOKUP.
                await c.lookup([WARM], mode=LookupMode.PREFIX)
                warm = await c.lookup([WARM], mode=LookupMode.PREFIX, wait=10.0)
                assert warm.prefix_hits == 1, warm
                s3.proxy.hold("HEAD", 1)
                count = daemon.measure()
                first = await c.lookup([KEY], mode=LookupMode.PREFIX)
                assert await asyncio.to_thread(s3.proxy.held.wait, 30)
                settling = asyncio.ensure_future(c.lookup([KEY], mode=LookupMode.PREFIX, wait=30.0))
                server = daemon.daemon.server
                assert server is not None
                await wait_on_timers(lambda: sum(c.inflight for c in server.connections) == 1)
                s3.proxy.release()
                settled = await settling
                await asyncio.to_thread(daemon.stop_measuring)
                return count, first, settled

        count, first_answer, settled = asyncio.run(lookups())
        assert first_answer.defer and first_answer.prefix_hits == 0, first_answer
        assert settled.prefix_hits == 1, settled
        return count
    finally:
        daemon.close()


def process_lookup(sock_dir: Path) -> tuple[PathCount, PathCount]:
    """A LOOKUP of a key RAM holds, as the lookup process answers it: its
    calls there, from the bytes' arrival to the reply and the report sent
    back; and the daemon's, once that report arrives (the touches and counts
    it does after an answer of the lookup process)."""
    process = ThreadedLookupProcess(sock_dir / "l.sock")
    try:
        process.ring.write([(FeedOp.HELD, WARM), (FeedOp.HELD, KEY)])
        listener = process.listener

        def reported() -> bool:
            return not listener._answered and not listener._unsent

        async def at_the_process() -> PathCount:
            path = sock_dir / "l.sock"
            async with await Client.connect(path, shared=False, lookup_process=False) as c:
                assert (await c.lookup([WARM], mode=LookupMode.PREFIX)).prefix_hits == 1
                await asyncio.to_thread(process.stop_measuring, reported)
                count = process.measure()
                reply = await c.lookup([KEY], mode=LookupMode.PREFIX)
                await asyncio.to_thread(process.stop_measuring, reported)
                assert reply.prefix_hits == 1, reply
                return count

        there = asyncio.run(at_the_process())
    finally:
        process.close()
    daemon = ThreadedDaemon(_overrides(sock_dir, server={"lookup_process": True}))
    try:
        supervisor = daemon.daemon.lookups
        assert supervisor is not None

        async def at_the_daemon() -> PathCount:
            feed = supervisor.feed
            assert feed is not None
            await asyncio.to_thread(daemon.stop_measuring, feed.listening.is_set)
            async with await Client.connect(sock_dir / "d.sock", shared=False) as c:
                assert c.lookups_process
                await c.put_many([WARM, KEY], [VALUE, VALUE])
                assert (await c.lookup([WARM], mode=LookupMode.PREFIX)).prefix_hits == 1
                await asyncio.to_thread(daemon.stop_measuring, lambda: feed.answered == 1)
                count = daemon.measure()
                assert (await c.lookup([KEY], mode=LookupMode.PREFIX)).prefix_hits == 1
                await asyncio.to_thread(daemon.stop_measuring, lambda: feed.answered == 2)
                return count

        here = asyncio.run(at_the_daemon())
    finally:
        daemon.close()
    return there, here


def _paths() -> Iterator[tuple[str, PathCount]]:
    from tests.ceph import CephS3

    sock_dir = short_tmpdir()
    try:
        yield "disk-only GET", disk_only_get(sock_dir)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    sock_dir = short_tmpdir()
    try:
        there, here = process_lookup(sock_dir)
        yield "LOOKUP at the lookup process, there", there
        yield "LOOKUP at the lookup process, its report at the daemon", here
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
    s3 = CephS3()
    sock_dir = short_tmpdir()
    try:
        yield "S3-only LOOKUP until HIT", s3_only_lookup(sock_dir, s3)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)
        s3.close()


if __name__ == "__main__":
    verbose = "-v" in sys.argv
    for name, count in _paths():
        print(f"{name}: {count}")
        if verbose:
            for fn, n in count.by_function().items():
                print(f"  {n:4d} {fn}")
