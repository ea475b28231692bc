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


def replay_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvtier replay`` with ``args``, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvtier", "replay", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


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
    out = replay_cli(
        str(folder),
        "--capacity",
        "50%",
        "--policy",
        "lru",
        "--concurrency",
        "2",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    rows = report["results"]
    assert rows and 0 < rows[0]["prefix_hit_ratio"] < 1, report


def agent(seed: int, turns: int = 12) -> dict[str, object]:
    """A session of tool loops and ends of turn: a prompt that grows turn by
    turn, short pauses after a tool call, long ones after the end of a turn."""
    import random

    rng = random.Random(seed)
    t, size, requests = 0.0, 4, []
    for n in range(turns):
        stop = "end_turn" if n % 4 == 3 else "tool_use"
        requests.append({"t": t, "hash_ids": list(range(size)), "stop": stop})
        size += rng.randint(1, 3)
        t += rng.uniform(5, 20) if stop == "tool_use" else rng.uniform(200, 900)
    return {"block_size": 64, "hash_id_scope": "local", "requests": requests}


def agents_folder(where: Path, n: int = 12) -> Path:
    where.mkdir()
    for i in range(n):
        (where / f"trace_{i:04d}.json").write_text(json.dumps(agent(i)))
    return where


def test_the_hints_an_engine_would_send(tmp_path: Path) -> None:
    turns = agentic.load(agents_folder(tmp_path / "a", 3), concurrency=2, seed=1)
    hints = agentic.retention_hints(turns)
    for turn, lease in zip(turns, hints, strict=True):
        assert lease.session == b"s%d" % turn.session
        tool = turn.stop == "tool_use"
        bonus = agentic.TOOL_CALL_BONUS if tool else 0
        assert lease.priority == agentic.PRIORITY_BY_TTL[lease.ttl] + bonus
        if turn.pause is None:  # a session's last request: its stop's default
            assert lease.ttl == agentic.LAST_TTL[turn.stop]
        else:  # the pause, rounded up to a step a harness picks from
            assert lease.ttl >= min(turn.pause, agentic.TTL_STEPS[-1])
            assert lease.ttl in agentic.TTL_STEPS
    assert sum(h.ttl == 60.0 for h in hints) and sum(h.ttl == 3600.0 for h in hints)
    # sooner back, kept first: a tool call's one-minute lease above any
    # five-minute one, and an end of turn's hour below every other
    order = sorted({(h.ttl, h.priority) for h in hints}, key=lambda tp: -tp[1])
    assert [ttl for ttl, _ in order] == sorted(ttl for ttl, _ in order)


def test_the_busy_prompt_is_the_mean_prompt_of_the_sessions_busy_at_each_arrival() -> None:
    def turn(at: float, session: int, size: int) -> agentic.Turn:
        return agentic.Turn(at, session, list(range(size)), "tool_use", None)

    turns = [turn(0, 0, 10), turn(10, 1, 30), turn(400, 0, 20)]
    # at 0: {10}; at 10: {10, 30}; at 400: session 1 is idle past 300 s: {20}
    assert agentic.busy_prompt(turns) == pytest.approx((10 + 20 + 20) / 3)


def _brute_optimum(chains: list[list[int]], capacity: int) -> int:
    """Belady's MIN by its definition, in O(N * C) per request: the block
    used again furthest ahead goes, the deepest in that request first (never
    used again: not kept)."""
    hits, cache, never = 0, set(), len(chains)
    for r, chain in enumerate(chains):
        for b in chain:
            if b not in cache:
                break
            hits += 1
        cache.update(chain)
        ahead = {b: next((q for q in range(r + 1, never) if b in chains[q]), never) for b in cache}
        cache = {b for b in cache if ahead[b] < never}
        while len(cache) > capacity:
            cache.remove(max(cache, key=lambda b: (ahead[b], chains[ahead[b]].index(b))))
    return hits


def test_belady_is_the_optimum_and_no_policy_beats_it() -> None:
    import random

    from kvtier import replay as rp

    for seed in range(8):
        rng = random.Random(seed)
        fresh = iter(range(10**9))
        chains: list[list[int]] = []
        for _ in range(60):  # a chain: an earlier one's prefix, extended by new blocks
            base = rng.choice(chains) if chains and rng.random() < 0.8 else []
            cut = rng.randint(0, len(base))
            chains.append(base[:cut] + [next(fresh) for _ in range(rng.randint(1, 4))])
        for capacity in (3, 8, 20):
            best = rp.belady(chains, ("c", capacity))
            assert best.hits == _brute_optimum(chains, capacity), (seed, capacity)
            for policy in ("lru", "harc"):
                assert rp.replay(chains, policy, ("c", capacity)).hits <= best.hits
            assert rp.plain_lru(chains, ("c", capacity)).hits <= best.hits


def test_leases_keep_the_sessions_that_come_back_soon(tmp_path: Path) -> None:
    """With the hints, the default policy gets more of the returning turns'
    prefixes than without, and than LRU as a chain-blind cache keeps them,
    and never more than the optimum."""
    from kvtier import replay as rp

    turns = agentic.load(agents_folder(tmp_path / "a", 24), concurrency=8, seed=3)
    chains, times = [t.chain for t in turns], [t.at for t in turns]
    capacity = ("2p", round(2 * agentic.busy_prompt(turns)))
    plain = rp.plain_lru(chains, capacity)
    bare = rp.replay(chains, "harc", capacity)
    hinted = rp.replay(
        chains, "harc", capacity, retentions=agentic.retention_hints(turns), times=times
    )
    best = rp.belady(chains, capacity)
    assert plain.hits <= bare.hits < hinted.hits <= best.hits


def test_kvtier_replay_with_hints_prompts_and_the_optimum(tmp_path: Path) -> None:
    folder = agents_folder(tmp_path / "a", 6)
    out = replay_cli(
        str(folder),
        "--capacity",
        "1p,3p",
        "--policy",
        "harc",
        "--hints",
        "--optimum",
        "--concurrency",
        "4",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    rows = {(r["policy"], r["capacity"]): r for r in json.loads(out.stdout)["results"]}
    assert set(rows) == {
        (p, c) for p in ("harc+hints", "plain-lru", "belady") for c in ("1p", "3p")
    }
    for c in ("1p", "3p"):
        assert (
            rows[("harc+hints", c)]["prefix_hit_ratio"] <= rows[("belady", c)]["prefix_hit_ratio"]
        )
        assert "returning_prefix_hit_ratio" in rows[("harc+hints", c)]
    lines = tmp_path / "trace.jsonl"
    lines.write_text('{"hash_ids": [1, 2, 3]}\n')
    bad = replay_cli(str(lines), "--capacity", "2p")
    assert bad.returncode != 0 and "prompts are agent sessions' unit" in bad.stderr


def test_with_a_disk_below_returning_turns_load_from_it_and_start_sooner(tmp_path: Path) -> None:
    """The replay's modelled time to first token: with a tier below a small
    RAM, the returning turns' blocks load from it rather than being
    recomputed, and they start sooner than with RAM alone."""
    from kvtier import replay as rp

    turns = agentic.load(agents_folder(tmp_path / "a", 24), concurrency=8, seed=3)
    chains, times = [t.chain for t in turns], [t.at for t in turns]
    hints = agentic.retention_hints(turns)
    prompt = agentic.busy_prompt(turns)
    costs = rp.parse_tier_costs("ram=20us/5GB,disk=150us/1.5GB")
    ram = ("1p", round(prompt))

    def ttft(lower: int) -> rp.TTFTResult:
        return rp.replay_ttft(
            chains,
            "harc",
            ram,
            costs,
            block_bytes=1 << 20,
            recompute_seconds_per_block=0.05,
            retentions=hints,
            times=times,
            lower_blocks=lower,
        )

    tiny, disk = ttft(1), ttft(round(20 * prompt))
    assert disk.from_lower > 0 and tiny.from_lower <= disk.from_lower
    assert sum(disk.returning) < sum(tiny.returning)
    assert disk.as_dict()["blocks_from_lower_tier"] == disk.from_lower
