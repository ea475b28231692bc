"""Test helpers: in-process and subprocess daemons, raw frame sockets."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier import wire
from kvtier.config import Config, load_config
from kvtier.core.propagation import RemoteSpec
from kvtier.daemon import READY_MESSAGE, Daemon
from kvtier.supervisors.lookup_process import TIMING, Timing
from kvtier.tiers.base import Tier

ROOT = Path(__file__).resolve().parent.parent


_TMP_ROOT: Path | None = None


def short_tmpdir() -> Path:
    """A short directory: Unix socket paths are limited to ~107 bytes.

    Each lies in one root per test process, removed when the process
    exits, so a test that does not remove its own leaves nothing behind."""
    global _TMP_ROOT
    if _TMP_ROOT is None:
        _TMP_ROOT = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
        atexit.register(shutil.rmtree, _TMP_ROOT, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix="", dir=_TMP_ROOT))


@contextlib.asynccontextmanager
async def running_daemon(
    sock_dir: Path,
    remote_tiers: Sequence[Tier | RemoteSpec] | None = None,
    remote_tier_configs: list[dict[str, Any]] | None = None,
    reread: Callable[[], Config] | None = None,
    lookup_timing: Timing = TIMING,
    **sections: dict[str, Any],
) -> AsyncIterator[Daemon]:
    """An in-process daemon on the test's event loop; ``reread`` is its
    configuration source for SIGHUP (:meth:`Daemon.reload`).

    Without the lookup process unless a test asks for it
    (``server={"lookup_process": True}``): clients then ask the daemon
    itself, which answers as the lookup process does (tests/test_lookup_truth.py
    compares the two), and a daemon starts and stops in a third of the time.
    Its shared memory is not allocated up front unless a test asks for it
    (``shared={"preallocate": True}``): :meth:`Daemon.settle` would wait for
    the 320 MiB of a test daemon's arena and staging region."""
    overrides: dict[str, dict[str, Any]] = {
        "server": {"socket_path": sock_dir / "d.sock", "lookup_process": False},
        "metrics": {"port": 0},
        "ram": {"capacity": "64MiB"},
        "disk": {"path": sock_dir / "data", "capacity": "256MiB"},
        "shared": {"preallocate": False},
    }
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    config_overrides: dict[str, Any] = dict(overrides)
    if remote_tier_configs is not None:
        config_overrides["remote_tiers"] = remote_tier_configs
    daemon = Daemon(
        load_config(None, config_overrides),
        remote_tiers=remote_tiers,
        reread=reread,
        lookup_timing=lookup_timing,
    )
    task = asyncio.create_task(daemon.run())
    ready = asyncio.create_task(daemon.ready.wait())
    await asyncio.wait({task, ready}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()  # raises the startup error
    if daemon.disk is not None and daemon.disk.scan_done is not None:
        await daemon.disk.scan_done  # tests start from a complete index
    try:
        yield daemon
    finally:
        daemon.stop()
        await task


async def wait_until(predicate: Callable[[], bool], limit: int = 10_000) -> None:
    """Yield to the event loop until ``predicate()`` holds (no timed sleeps).

    Only for counters, which no event announces; anything with an event
    (a connection's ``done``, a gate, ``Daemon.settle``) waits on that.
    """
    for _ in range(limit):
        if predicate():
            return
        await asyncio.sleep(0)  # allow-sleep: one loop turn, no wait
    raise AssertionError("condition never became true")


async def wait_on_timers(predicate: Callable[[], bool], seconds: float = 30.0) -> None:
    """Until ``predicate()`` holds, for what real timers bring about (another
    process's polls, a restart's backoff, a reader thread): checked every
    5 ms instead of spinning the loop, for ``seconds`` at most."""
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not true within {seconds}s")
        await asyncio.sleep(0.005)  # allow-sleep: what is awaited runs on real timers


class DaemonProcess:
    """``kvtier serve`` as a real child process; its shared memory not
    allocated up front unless ``env`` asks for it
    (``KVTIER_SHARED__PREALLOCATE``): a test daemon lives seconds, and its
    320 MiB would be allocated while the test runs."""

    def __init__(self, sock_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.socket_path = sock_dir / "d.sock"
        self.data_dir = sock_dir / "data"
        self.args = args
        self.env = {**os.environ, "KVTIER_SHARED__PREALLOCATE": "false", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.lines: list[str] = []
        self.metrics_url: str | None = None
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        #: notified for every line of stderr (wait_for_line)
        self._line = threading.Condition()

    def start(self, timeout: float = 30.0, command: list[str] | None = None) -> DaemonProcess:
        """Start ``kvtier serve`` (or ``command``, in a session of its own) and
        wait for its ready line."""
        return self.launch(command).ready(timeout)

    def launch(self, command: list[str] | None = None) -> DaemonProcess:
        """Start ``kvtier serve`` (or ``command``, in a session of its own)
        without waiting: several daemons start side by side, then each is
        waited for (:meth:`ready`)."""
        cmd = command or [
            sys.executable,
            "-m",
            "kvtier",
            "serve",
            "--socket",
            str(self.socket_path),
            "--metrics-port",
            "0",
            "--data-dir",
            str(self.data_dir),
            *self.args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=self.env,
            cwd=ROOT,
            start_new_session=command is not None,
        )
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        return self

    def ready(self, timeout: float = 30.0) -> DaemonProcess:
        """Once the launched daemon has said it is ready; raises when it
        does not within ``timeout`` seconds, or exits first."""
        if not self._ready.wait(timeout):
            self.stop(signal.SIGKILL)
            raise RuntimeError("daemon did not become ready:\n" + "\n".join(self.lines))
        if not self.metrics_url and not any(READY_MESSAGE in line for line in self.lines):
            # Its stderr closed without the ready line: it is exiting on its own.
            self.wait(timeout)
            raise RuntimeError("daemon did not become ready:\n" + "\n".join(self.lines))
        return self

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            with self._line:
                self.lines.append(line)
                self._line.notify_all()
            if READY_MESSAGE in line:
                match = re.search(r"metrics=(\S+)", line)
                if match and match.group(1).startswith("http"):
                    self.metrics_url = match.group(1)
                self._ready.set()
        self._ready.set()  # EOF: the process is gone; start() reports it

    def wait_for_line(self, needle: str, start: int = 0, timeout: float = 30.0) -> str:
        """The first line from ``start`` on that contains ``needle``, as it arrives."""
        with self._line:
            found = self._line.wait_for(
                lambda: any(needle in line for line in self.lines[start:]), timeout
            )
            if not found:
                raise AssertionError(f"no line with {needle!r}:\n" + "\n".join(self.lines))
            return next(line for line in self.lines[start:] if needle in line)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 30.0) -> int:
        assert self.proc is not None
        code = self.proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(timeout)
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(sig)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.wait(timeout)

    def scrape(self) -> str:
        assert self.metrics_url is not None
        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text: str = resp.read().decode()
            return text


def memory_of(pid: int) -> dict[str, int]:
    """Process ``pid``'s memory figures from ``/proc/<pid>/status``, in bytes
    (``VmRSS``, ``RssShmem``, ...)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            value = rest.split()
            if len(value) == 2 and value[1] == "kB":
                fields[name] = int(value[0]) * 1024
    if "VmRSS" not in fields:
        raise AssertionError(f"no VmRSS for pid {pid}")
    return fields


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` that is its own: the shared memory
    it maps (a daemon's arena and staging region, their size set by its
    configuration and allocated once it serves) left out."""
    fields = memory_of(pid)
    return fields["VmRSS"] - fields.get("RssShmem", 0)


def metric_value(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in a Prometheus text exposition."""
    needle = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(needle + " "):
            return float(line.split()[-1])
    return 0.0


class RawConnection:
    """A blocking socket speaking frames by hand, for malformed-input tests."""

    def __init__(self, path: Path, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(str(path))

    def __enter__(self) -> RawConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send_frame(
        self,
        op: int,
        rid: int,
        meta: bytes = b"",
        data: bytes = b"",
        *,
        version: int = wire.VERSION,
        flags: int = 0,
    ) -> None:
        header = wire.HEADER.pack(wire.MAGIC, version, op, flags, 0, rid, len(meta), len(data))
        self.send(header + meta + data)

    def recv_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
            buf += chunk
        return bytes(buf)

    def recv_frame(self) -> wire.Frame:
        header = wire.unpack_header(self.recv_exact(wire.HEADER_SIZE))
        meta = self.recv_exact(header.meta_len)
        data = self.recv_exact(header.data_len)
        return wire.Frame(header, meta, data)

    def at_eof(self) -> bool:
        """True when the server closed the connection (reads EOF)."""
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True


def shared_stats(d: Daemon) -> dict[str, Any]:
    """The daemon's shared-memory figures (leases, staging, regions)."""
    assert d.shared is not None
    return d.shared.stats().as_dict()


@dataclass
class StoresSeen:
    """What :func:`watching_stores` saw."""

    #: the bytes the daemon had sent when each store of shared blocks ran
    sent: list[float] = field(default_factory=list)
    #: set as each runs
    stored: asyncio.Event = field(default_factory=asyncio.Event)


@contextlib.contextmanager
def watching_stores(d: Daemon) -> Iterator[StoresSeen]:
    """Each store of blocks from shared memory (a COMMIT's, a PUT_REGION's)
    as it runs, against the bytes the daemon had sent by then: whether its
    reply left first."""
    assert d.shared is not None
    stores = d.service.stores  # (the shared blocks' stores; the service's own are bound)
    sent, seen, put = d.server.counters.sent_bytes, StoresSeen(), stores.put

    def recording(keys: Any, values: Any, **how: Any) -> Any:
        seen.sent.append(sent.value)
        seen.stored.set()
        return put(keys, values, **how)

    stores.put = recording  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        stores.put = put  # type: ignore[method-assign]


def received_bytes(d: Daemon) -> float:
    """Bytes the daemon has received on its sockets (what crossed them)."""
    value = d.metrics.registry.get_sample_value("kvtier_received_bytes_total")
    assert value is not None
    return value
