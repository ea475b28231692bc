"""Agent sessions as a replay trace (kvtier/replay.py, load_sessions): one
JSON file per session, in a folder or a tarball, interleaved by a seeded
arrival model; each session's block ids its own."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kvtier import agentic
from kvtier.errors import ConfigError


def session(turns: int, gap: float) -> dict[str, object]:
    """A session whose prompt grows by two blocks a turn (ids local to it),
    with a sub-agent run in the middle."""
    requests: list[dict[str, object]] = [
        {"t": n * gap, "type": "n", "hash_ids": list(range(2 * n + 2)), "stop": "tool_use"}
        for n in range(turns)
    ]
    requests.insert(
        1, {"t": 0.5, "type": "subagent", "requests": [{"t": 0.6, "hash_ids": [900, 901]}]}
    )
    return {"block_size": 64, "hash_id_scope": "local", "requests": requests}


def write_folder(where: Path, n: int) -> Path:
    where.mkdir()
    for i in range(n):
        (where / f"trace_{i:04d}.json").write_text(json.dumps(session(3 + i, 10.0)))
    return where


def test_sessions_interleave_keep_their_order_and_their_own_ids(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "sessions", 3)
    chains = agentic.load_sessions(folder, concurrency=2, seed=7)
    assert len(chains) == (3 + 4 + 5) + 3  # every turn, and each sub-agent's request
    by_session: dict[int, list[list[int]]] = {}
    for chain in chains:
        assert len({b >> 32 for b in chain}) == 1  # one session's ids each
        by_session.setdefault(chain[0] >> 32, []).append(chain)
    assert len(by_session) == 3
    for turns in by_session.values():
        grown = [c for c in turns if (c[0] & 0xFFFFFFFF) == 0]
        assert [len(c) for c in grown] == sorted(len(c) for c in grown)  # in turn order
    # the same seed, the same arrivals; another seed, another interleaving
    assert agentic.load_sessions(folder, concurrency=2, seed=7) == chains
    assert agentic.load_sessions(folder, concurrency=2, seed=8) != chains


def test_a_tarball_reads_as_the_folder_does(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "sessions", 3)
    tarball = tmp_path / "sessions.tar.gz"
    with tarfile.open(tarball, "w:gz") as tar:
        for p in sorted(folder.iterdir()):
            data = p.read_bytes()
            info = tarfile.TarInfo(f"traces/{p.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert agentic.load_sessions(tarball, 4, 3) == agentic.load_sessions(folder, 4, 3)


def test_bad_sessions_are_refused_clearly(tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    folder.mkdir()
    (folder / "trace_0000.json").write_text('{"requests": [{"t": 0, "hash_ids": ["x"]}]}')
    with pytest.raises(ConfigError, match=r"trace_0000\.json: not a session"):
        agentic.load_sessions(folder)
    with pytest.raises(ConfigError, match="concurrency"):
        agentic.load_sessions(folder, concurrency=0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no session"):
        agentic.load_sessions(tmp_path / "empty")


def test_kvtier_replay_reads_sessions(tmp_path: Path) -> None:
    folder = write_folder(tmp_path / "sessions", 4)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "replay",
            str(folder),
            "--capacity",
            "50%",
            "--policy",
            "lru",
            "--concurrency",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = report["results"]
    assert rows and 0 < rows[0]["prefix_hit_ratio"] < 1, report
