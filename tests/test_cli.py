"""The ``kvtier`` commands as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import DaemonProcess


def kvtier(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier", *args], input=stdin, capture_output=True, timeout=60
    )


@pytest.fixture(scope="module")
def proc() -> Iterator[DaemonProcess]:
    from tests.helpers import short_tmpdir

    p = DaemonProcess(short_tmpdir(), "--ram-capacity", "32MiB").start()
    yield p
    assert p.stop() == 0


def test_ping(proc: DaemonProcess) -> None:
    out = kvtier("ping", "--socket", str(proc.socket_path))
    assert out.returncode == 0
    assert out.stdout.decode().startswith("pong from kvtier/")


def test_put_get_lookup_stats(proc: DaemonProcess, tmp_path: Path) -> None:
    sock = ["--socket", str(proc.socket_path)]
    src = tmp_path / "block.bin"
    src.write_bytes(bytes(range(256)) * 100)
    out = kvtier("put", *sock, "c0ffee", str(src))
    assert out.returncode == 0 and out.stdout.startswith(b"stored c0ffee")

    out = kvtier("get", *sock, "c0ffee")
    assert out.returncode == 0 and out.stdout == src.read_bytes()
    dest = tmp_path / "copy.bin"
    assert kvtier("get", *sock, "c0ffee", "-o", str(dest)).returncode == 0
    assert dest.read_bytes() == src.read_bytes()

    out = kvtier("get", *sock, "beef")
    assert out.returncode == 3 and b"not found" in out.stderr

    out = kvtier("lookup", *sock, "--prefix", "c0ffee", "beef")
    lines = out.stdout.decode().splitlines()
    assert lines == ["c0ffee  HIT", "beef  MISS", "prefix hits: 1  defer: no"]

    stats = json.loads(kvtier("stats", *sock, "--json").stdout)
    assert stats["tiers"]["ram"]["blocks"] >= 1
    table = kvtier("stats", *sock).stdout.decode()
    assert "tiers.ram.used_bytes" in table
    capacity = next(line for line in table.splitlines() if "tiers.ram.capacity_bytes" in line)
    assert capacity.split()[1:] == ["32.0", "MiB", "(33554432)"]


def test_put_from_stdin(proc: DaemonProcess) -> None:
    sock = ["--socket", str(proc.socket_path)]
    assert kvtier("put", *sock, "0102", "-", stdin=b"from stdin").returncode == 0
    assert kvtier("get", *sock, "0102").stdout == b"from stdin"


def test_bad_key_and_no_daemon(tmp_path: Path, proc: DaemonProcess) -> None:
    out = kvtier("get", "--socket", str(proc.socket_path), "xyz")
    assert out.returncode == 2 and b"not a hex key" in out.stderr
    out = kvtier("ping", "--socket", str(tmp_path / "none.sock"))
    assert out.returncode == 1 and b"no kvtier daemon is listening" in out.stderr


def test_config_check(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[ram]\ncapacity = "2GiB"\n')
    out = kvtier("config", "check", str(good))
    assert out.returncode == 0
    assert b"capacity = 2147483648" in out.stdout

    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nmax_batch = -1\n")
    out = kvtier("config", "check", str(bad))
    assert out.returncode == 2
    assert b"server.max_batch" in out.stderr


def test_serve_with_bad_config_exits_with_the_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[ram]\ncapacity = "0"\n')
    out = kvtier("serve", "--config", str(bad))
    assert out.returncode == 2
    assert b"ram.capacity" in out.stderr
