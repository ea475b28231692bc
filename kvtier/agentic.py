"""Agent sessions as a workload: the agentic trace format read, sessions
interleaved as concurrent users, and the retention an engine would send.

A trace is a folder, or a tarball, of one JSON file per session (the format
of the coding-agent sessions kvtier replays): ``requests[]``, each with
``t`` (seconds from the session's start), ``hash_ids`` (its prompt's block
ids, a chain) and ``stop`` (``tool_use``: the model called a tool and the
session comes back when it has run; ``end_turn``: the model answered and
the session waits for its user); a sub-agent's nested ``requests`` count
as its session's. Block ids are local to a session (``hash_id_scope``
local): each session's are moved into a range of their own.

The arrival model: the sessions, in an order drawn from ``seed``, start one
after another with exponential gaps (a Poisson process) whose rate keeps
``concurrency`` sessions in progress on average (Little's law, over the
sessions' mean length); each request arrives at its session's start plus
its ``t``.

The hints an engine (its agent harness) would send, per request
(:func:`retention_hints`): the session's id; a time to keep (TTL) from the
pause before the session's next request, rounded up to one of the lengths
harnesses choose between (1 minute, 5 minutes, an hour), a session's last
request, whose pause nobody knows, getting its stop's default; and a
priority from when the session is expected back: the shorter its TTL, the
higher, and at one TTL a tool call (``stop``) above the end of a turn.
"""

from __future__ import annotations

import json
import random
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.model import Retention

#: the TTLs a harness picks from (seconds), shortest first
TTL_STEPS = (60.0, 300.0, 3600.0)
#: the TTL of a session's last request, by its stop
LAST_TTL = {"tool_use": 300.0, "end_turn": 3600.0}
#: the priority of a request's lease by its TTL: a session expected back
#: sooner is kept before one expected later (Belady's order, as far as the
#: harness can tell it)
PRIORITY_BY_TTL = {60.0: 80, 300.0: 60, 3600.0: 20}
#: a request that ended in a tool call (the session comes back when the
#: tool has run) is kept before one that ended its turn, at the same TTL
TOOL_CALL_BONUS = 5
#: a session is busy while its last request is at most this old (seconds)
BUSY_WINDOW = 300.0


@dataclass(slots=True, frozen=True)
class Turn:
    """One request of a session, as the server sees it arrive."""

    at: float
    session: int
    chain: list[int]
    #: "tool_use", "end_turn", or "" when the trace does not say
    stop: str
    #: seconds until the session's next request; None for its last
    pause: float | None


def load(path: Path, concurrency: float = 16.0, seed: int = 1) -> list[Turn]:
    """Every session's requests at ``path``, interleaved by the arrival
    model (see the module's docstring), in the order they arrive."""
    if concurrency <= 0:
        raise ConfigError(f"--concurrency must be positive, got {concurrency}")
    sessions = [_session_requests(name, data) for name, data in _session_files(path)]
    sessions = [s for s in sessions if s]
    if not sessions:
        raise ConfigError(f"{path}: no session with requests")
    rng = random.Random(seed)
    order = list(range(len(sessions)))
    rng.shuffle(order)
    mean_length = sum(max(t for t, _, _ in s) for s in sessions) / len(sessions)
    rate = concurrency / max(mean_length, 1e-9)
    timed: list[tuple[float, int, int, Turn]] = []
    start = 0.0
    for i in order:
        start += rng.expovariate(rate)
        base = (i + 1) << 32
        requests = sessions[i]
        for n, (t, ids, stop) in enumerate(requests):
            pause = requests[n + 1][0] - t if n + 1 < len(requests) else None
            turn = Turn(start + t, i, [base + b for b in ids], stop, pause)
            timed.append((turn.at, i, n, turn))
    timed.sort(key=lambda r: (r[0], r[1], r[2]))
    return [turn for _, _, _, turn in timed]


def load_sessions(path: Path, concurrency: float = 16.0, seed: int = 1) -> list[list[int]]:
    """The chains of :func:`load`, in arrival order."""
    return [turn.chain for turn in load(path, concurrency, seed)]


def retention_hints(turns: Sequence[Turn]) -> list[Retention]:
    """Per request, the lease its engine would send (see the module's docstring)."""
    out = []
    for turn in turns:
        tool = turn.stop != "end_turn"
        if turn.pause is None:
            ttl = LAST_TTL["tool_use" if tool else "end_turn"]
        else:
            ttl = next((s for s in TTL_STEPS if turn.pause <= s), TTL_STEPS[-1])
        priority = PRIORITY_BY_TTL[ttl] + (TOOL_CALL_BONUS if tool else 0)
        out.append(Retention(b"s%d" % turn.session, ttl, priority))
    return out


def busy_prompt(turns: Sequence[Turn], window: float = BUSY_WINDOW) -> float:
    """The busy sessions' average prompt, in blocks: at each arrival, the
    mean of the latest prompt of every session that sent a request in the
    last ``window`` seconds, averaged over arrivals. Capacities stated in
    these prompts mean the same on any trace."""
    latest: dict[int, tuple[float, int]] = {}
    total = 0.0
    for turn in turns:
        latest[turn.session] = (turn.at, len(turn.chain))
        busy = [n for at, n in latest.values() if turn.at - at <= window]
        total += sum(busy) / len(busy)
        if len(latest) > 4 * len(busy) + 64:  # sessions long idle drop out
            latest = {s: v for s, v in latest.items() if turn.at - v[0] <= window}
    return total / len(turns) if turns else 0.0


def _session_files(path: Path) -> list[tuple[str, bytes]]:
    try:
        if path.is_dir():
            return [(p.name, p.read_bytes()) for p in sorted(path.glob("*.json"))]
        with tarfile.open(path, "r:*") as tar:
            out = []
            for member in sorted(tar.getmembers(), key=lambda m: m.name):
                if member.isfile() and member.name.endswith(".json"):
                    fh = tar.extractfile(member)
                    if fh is not None:
                        out.append((member.name, fh.read()))
            return out
    except (OSError, tarfile.TarError) as exc:
        raise ConfigError(f"cannot read sessions {path}: {exc}") from exc


def _session_requests(name: str, data: bytes) -> list[tuple[float, list[int], str]]:
    """(``t``, ``hash_ids``, ``stop``) of each request of one session, sub-agents' included."""
    try:
        doc = json.loads(data)
        out: list[tuple[float, list[int], str]] = []
        stack = list(reversed(doc["requests"]))
        while stack:
            r = stack.pop()
            if isinstance(r.get("requests"), list):  # a sub-agent's run
                stack.extend(reversed(r["requests"]))
            ids = r.get("hash_ids")
            if ids:
                if not all(isinstance(b, int) and 0 <= b < 1 << 32 for b in ids):
                    raise ValueError("hash_ids must be integers below 2**32")
                stop = r.get("stop")
                out.append((float(r["t"]), list(ids), stop if isinstance(stop, str) else ""))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{name}: not a session of the agentic trace format: {exc}") from None
    out.sort(key=lambda r: r[0])
    return out
