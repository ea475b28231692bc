"""The object store the tests start: a throw-away single-node Ceph cluster
and its RADOS Gateway (RGW), the S3 a fleet runs on premises.

:class:`CephCluster` starts one monitor, one OSD (``memstore``: objects in
memory, or ``bluestore`` on a sparse file where a disk matters) and one
``radosgw`` on 127.0.0.1, as the current user, every path under a temp
dir of its own, with no systemd, containers or manager daemon; each daemon
runs in the foreground, its PID kept, and stopping stops exactly those.
:class:`CephS3` is the S3 endpoint the tests use (an S3 user, buckets, a
tier's configuration), seen through the same counting proxy the tests
hold or cut requests with (:class:`tests.s3server.CountingProxy`);
:meth:`CephCluster.rgw_signal` and :meth:`CephCluster.restart_rgw` inject
the faults a real store has (a hang, a crash, a restart).

Debian ships Ceph: ``apt-get install --no-install-recommends ceph-mon
ceph-osd radosgw ceph-common`` (``make test`` installs them where they are
missing; :func:`missing` says which are). Settings that matter, each
measured: monitor proposals every 10 ms (RGW makes a few monitor requests
per pool: at the default 1 s a start takes 13 s), a 0.5 s objecter tick
(else RGW's first pool I/O, issued before the OSD is up, can stall 5 s),
``tcp_nodelay`` on RGW's frontend (else small GETs take 46 ms), pools of
one replica and 8 placement groups.

Run as ``python -m tests.ceph`` it starts a cluster, prints its S3
configuration as one line of JSON, and stops when its standard input
closes (for benchmarks and processes without this module's imports).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from tests.s3server import ProxiedS3

#: the Debian packages the cluster runs from, and a program each ships
PACKAGES = {
    "ceph-mon": "ceph-mon",
    "ceph-osd": "ceph-osd",
    "radosgw": "radosgw",
    "ceph-common": "ceph-authtool",
}
#: seconds a start may take before it is given up (about 2-3 s here)
START_TIMEOUT = 60.0
#: seconds a daemon is given to exit on SIGTERM before SIGKILL
STOP_GRACE = 2.0

Store = Literal["memstore", "bluestore"]


class CephUnavailable(RuntimeError):
    """Ceph's programs are not installed here."""


def missing() -> list[str]:
    """The Debian packages whose programs are not on the PATH."""
    return [pkg for pkg, program in PACKAGES.items() if shutil.which(program) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class CephCluster:
    """One monitor, one OSD and one RGW on loopback, in ``root`` (a new temp dir)."""

    def __init__(self, store: Store = "memstore", root: Path | None = None) -> None:
        if missing():
            raise CephUnavailable(
                "Ceph is not installed: apt-get install -y --no-install-recommends "
                + " ".join(PACKAGES)
            )
        self.store = store
        self.root = Path(root or tempfile.mkdtemp(prefix="kvt-ceph-", dir="/tmp"))
        self.fsid = str(uuid.uuid4())
        self.mon_port, self.rgw_port = _free_port(), _free_port()
        self.conf = self.root / "ceph.conf"
        self.keyring = self.root / "keyring"
        self.access_key = "KVTIER" + secrets.token_hex(7).upper()
        self.secret_key = secrets.token_hex(20)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.started_in = 0.0

    def __repr__(self) -> str:
        up = ",".join(n for n, p in self.procs.items() if p.poll() is None)
        return f"<CephCluster {self.store} {self.endpoint} up={up or '-'} {self.root}>"

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.rgw_port}"

    # -- start

    def start(self) -> CephCluster:
        began = time.monotonic()
        try:
            self._configure()
            self._run(
                "ceph-mon",
                "--mkfs",
                "-i",
                "a",
                "--monmap",
                str(self.root / "monmap"),
                "--keyring",
                str(self.keyring),
                "-c",
                str(self.conf),
            )
            self._spawn("mon", "ceph-mon", "-f", "-i", "a", "-c", str(self.conf))
            osd_uuid = str(uuid.uuid4())
            self._run("ceph", "-c", str(self.conf), "-n", "client.admin", "osd", "new", osd_uuid)
            self._run("ceph-osd", "-i", "0", "--mkfs", "--osd-uuid", osd_uuid, "-c", str(self.conf))
            self._spawn("osd", "ceph-osd", "-f", "-i", "0", "-c", str(self.conf))
            self.start_rgw()
            self._run(
                "radosgw-admin",
                "-c",
                str(self.conf),
                "-n",
                "client.admin",
                "user",
                "create",
                "--uid",
                "kvtier",
                "--display-name",
                "kvtier tests",
                "--access-key",
                self.access_key,
                "--secret-key",
                self.secret_key,
            )
        except BaseException:
            self.stop()
            raise
        self.started_in = time.monotonic() - began
        return self

    def _configure(self) -> None:
        r = self.root
        for sub in ("run", "log", "crash", "mon/a", "osd/0", "rgw"):
            (r / sub).mkdir(parents=True, exist_ok=True)
        store = (
            "osd_objectstore = memstore\nmemstore_device_bytes = 8589934592\n"
            if self.store == "memstore"
            else "osd_objectstore = bluestore\nbluestore_block_path = "
            f"{r}/osd/0/block.file\nbluestore_block_size = 8589934592\n"
            "bluestore_block_create = true\n"
        )
        self.conf.write_text(
            f"[global]\nfsid = {self.fsid}\nmon_host = v2:127.0.0.1:{self.mon_port}\n"
            "mon_initial_members = a\npublic_addr = 127.0.0.1\ncluster_addr = 127.0.0.1\n"
            "ms_bind_ipv6 = false\nms_bind_msgr1 = false\n"
            "auth_cluster_required = cephx\nauth_service_required = cephx\n"
            f"auth_client_required = cephx\nkeyring = {self.keyring}\n"
            f"run_dir = {r}/run\nadmin_socket = {r}/run/$name.asok\n"
            f"log_file = {r}/log/$name.log\nmon_cluster_log_file = {r}/log/cluster.log\n"
            f"crash_dir = {r}/crash\n"
            "osd_pool_default_size = 1\nosd_pool_default_min_size = 1\n"
            "mon_allow_pool_size_one = true\nosd_pool_default_pg_num = 8\n"
            "osd_pool_default_pgp_num = 8\nosd_pool_default_pg_autoscale_mode = off\n"
            "paxos_propose_interval = 0.01\npaxos_min_wait = 0.01\n"
            "objecter_tick_interval = 0.5\nmon_data_avail_crit = 1\nmon_data_avail_warn = 2\n"
            "osd_fast_shutdown_notify_mon = false\n"
            # A killed RGW's watches on its control objects would stay for
            # 30 s, and the next one's first metadata write (a bucket) waits
            # for their acks until they expire.
            "osd_client_watch_timeout = 3\n"
            f"[mon.a]\nmon_data = {r}/mon/a\n"
            f"[osd.0]\nosd_data = {r}/osd/0\n{store}"
            f"[client.rgw.a]\nrgw_data = {r}/rgw\n"
            f"rgw_frontends = beast endpoint=127.0.0.1:{self.rgw_port} tcp_nodelay=1\n"
        )
        kr = str(self.keyring)
        self._run(
            "ceph-authtool",
            "--create-keyring",
            kr,
            "--gen-key",
            "-n",
            "mon.",
            "--cap",
            "mon",
            "allow *",
        )
        for name, caps in (
            ("client.admin", ("mon", "allow *", "osd", "allow *", "mgr", "allow *")),
            ("osd.0", ("mon", "allow profile osd", "osd", "allow *")),
            ("client.rgw.a", ("mon", "allow rw", "osd", "allow rwx")),
        ):
            args = ["ceph-authtool", kr, "--gen-key", "-n", name]
            for i in range(0, len(caps), 2):
                args += ["--cap", caps[i], caps[i + 1]]
            self._run(*args)
        self._run(
            "monmaptool",
            "--create",
            "--addv",
            "a",
            f"[v2:127.0.0.1:{self.mon_port}]",
            "--fsid",
            self.fsid,
            str(r / "monmap"),
        )

    def _run(self, *args: str) -> str:
        done = subprocess.run(args, capture_output=True, text=True, timeout=START_TIMEOUT)
        if done.returncode:
            raise RuntimeError(f"{' '.join(args[:3])}... failed: {done.stderr or done.stdout}")
        return done.stdout

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")  # noqa: SIM115 - the process's
        with log:
            self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    # -- the gateway, and its faults

    def start_rgw(self) -> None:
        """Start RGW (again), and return once it answers HTTP."""
        self._spawn("rgw", "radosgw", "-f", "-n", "client.rgw.a", "-c", str(self.conf))
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # (it answered)
            except OSError:
                for name, proc in self.procs.items():
                    if proc.poll() is not None:
                        raise RuntimeError(
                            f"ceph {name} exited {proc.returncode}; {self.root}/log"
                        ) from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"RGW did not answer within {START_TIMEOUT:g}s") from None
                time.sleep(0.02)  # allow-sleep: another process's start, polled

    def rgw_signal(self, sig: int) -> None:
        """Send ``sig`` to RGW: SIGSTOP hangs it (connections open, nothing
        answered), SIGCONT wakes it, SIGKILL crashes it."""
        self.procs["rgw"].send_signal(sig)
        if sig == signal.SIGKILL:
            self.procs["rgw"].wait()

    def restart_rgw(self) -> None:
        """Kill RGW and start it again on the same port (its objects stay)."""
        self.rgw_signal(signal.SIGKILL)
        self.start_rgw()

    # -- stop

    def stop(self) -> None:
        """Stop exactly the daemons started here, then remove the temp dir."""
        procs = list(self.procs.values())
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # (a hung one must hear the TERM)
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)


class CephS3(ProxiedS3):
    """The tests' S3 on a :class:`CephCluster`, through a counting proxy."""

    def __init__(self, store: Store = "memstore") -> None:
        self.cluster = CephCluster(store).start()
        try:
            super().__init__(
                self.cluster.endpoint, self.cluster.access_key, self.cluster.secret_key
            )
        except BaseException:
            self.cluster.stop()
            raise

    def __repr__(self) -> str:
        return f"<CephS3 {self.cluster!r} buckets={self._buckets}>"

    def close(self) -> None:
        try:
            self.proxy.close()
        finally:
            self.cluster.stop()


def ceph_s3(store: Store = "memstore") -> Iterator[CephS3]:
    server = CephS3(store)
    try:
        yield server
    finally:
        server.close()


if __name__ == "__main__":
    s3 = CephS3()
    try:
        print(json.dumps(s3.tier_config(s3.new_bucket())), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            sys.stdin.read()
    finally:
        s3.close()
    os._exit(0)
