"""SIGHUP: live settings apply, the rest wait for a restart, a bad file changes nothing."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

from kvtier.client.aio import Client
from kvtier.client.blocking import BlockingClient
from kvtier.config import Config, load_config
from kvtier.daemon import Daemon
from kvtier.reload import LIVE, changed
from tests.helpers import DaemonProcess, running_daemon

BEFORE = """
[log]
level = "info"
[shared]
lease_timeout = 30.0
[server]
max_batch = 65536
"""

AFTER = """
[log]
level = "debug"
[shared]
lease_timeout = 5.0
[server]
max_batch = 100
"""


def test_sighup_rereads_the_file_and_says_what_waits_for_a_restart(sock_dir: Path) -> None:
    path = sock_dir / "kvtier.toml"
    path.write_text(BEFORE)
    proc = DaemonProcess(sock_dir, "--config", str(path), "--no-disk").start()
    try:
        path.write_text(AFTER)
        mark = len(proc.lines)
        proc.send_signal(signal.SIGHUP)
        applied = proc.wait_for_line("reloaded:", mark)
        assert "log.level" in applied and "shared.lease_timeout" in applied
        waiting = proc.wait_for_line("not applied until a restart", mark)
        assert "server.max_batch" in waiting and "log.level" not in waiting

        path.write_text("[server\nbroken = ")
        mark = len(proc.lines)
        proc.send_signal(signal.SIGHUP)
        proc.wait_for_line("reload failed; the running configuration is kept", mark)
        with BlockingClient(proc.socket_path) as c:  # still serving
            c.ping()
    finally:
        assert proc.stop() == 0


async def test_a_reload_changes_what_it_says_it_changes(sock_dir: Path) -> None:
    root = logging.getLogger()
    level = root.level
    sources: list[Config] = []  # what SIGHUP re-reads
    async with running_daemon(sock_dir, reread=lambda: sources[-1]) as d:
        base: dict[str, Any] = d.config.model_dump(mode="json")
        new = load_config(
            None,
            {
                **{k: v for k, v in base.items() if isinstance(v, dict)},
                "shared": {**base["shared"], "lease_timeout": 7.0},
                "disk": {**base["disk"], "max_pending_write_bytes": 1234},
                "log": {"level": "debug"},
                "lookup": {**base["lookup"], "pending_deadline": 3.0},
            },
        )
        assert set(changed(d.config, new)) <= set(LIVE)
        sources.append(new)
        try:
            d.reload()
            assert d.shared is not None and d.shared.lease_timeout == 7.0
            (disk,) = [w for w in d.service.propagation.writers if w.name == "disk"]
            assert disk.max_pending == 1234
            assert d.service.cfg.pending_deadline == 3.0  # read where writes start
            assert root.level == logging.DEBUG
            assert changed(d.config, new) == []  # the config shows what is in force
        finally:
            root.setLevel(level)


async def test_a_daemon_without_a_source_keeps_running(daemon: Daemon) -> None:
    daemon.reload()  # logs that there is nothing to re-read
    async with await Client.connect(daemon.socket_path) as c:
        await c.ping()
