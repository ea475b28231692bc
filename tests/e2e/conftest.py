"""Fixtures for the end-to-end engine tests: a tiny model made here, a real
kvtier daemon, and vLLM engines each in a process of their own.

These tests run in .venv-e2e (``make test-e2e``), where vLLM's CPU build is
installed and kvtier only as a client; the daemon is the main venv's
``kvtier serve`` (``KVTIER_SERVE``). Nothing is downloaded: the model is a
2-layer Llama made with transformers from a fixed seed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.engine import BLOCK, MARK
from tests.e2e.model import make_model
from tests.enginedaemon import EngineDaemon, start

ROOT = Path(__file__).resolve().parents[2]

#: The prompts: A is 300 tokens, 9 full blocks of 32; 30 other prompts of
#: 300 tokens push it out of the engine's own KV cache (128 blocks) and of the
#: CPU cache in front of kvtier (64 blocks: vLLM's CPU tier, LMCache's local CPU).
A = list(range(3, 303))
#: shares only A's first 4 blocks
SHARES_4 = A[: 4 * BLOCK] + [7] * (len(A) - 4 * BLOCK)


def others(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(300)] for _ in range(n)]


def hits(d: EngineDaemon, at_least: float = 0) -> float:
    """Keys kvtier's lookups answered HIT, once it has counted ``at_least``."""
    return d.total_reaching("kvtier_lookup_keys_total", at_least, state="hit")


@pytest.fixture(scope="session")
def model() -> Iterator[Path]:
    tmp = Path(tempfile.mkdtemp(prefix="kvt-model-", dir="/tmp"))
    yield make_model(tmp / "tiny-llama")
    shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class Answer:
    tokens: list[int]
    #: prompt tokens vLLM did not compute (its own caches or kvtier)
    cached: int
    #: seconds its ``generate`` took (not compared)
    seconds: float = field(default=0.0, compare=False)


class Engine:
    """A vLLM engine process (tests/e2e/engine.py) running ``prompts``."""

    def __init__(
        self,
        model: Path,
        socket: Path | None,
        prompts: list[list[int]],
        *,
        root: Path = ROOT,
        **spec: Any,
    ):
        """``root``: the checkout whose kvtier the engine imports (benchmarks'
        A/B); ``spec``: the engine's (tests/e2e/engine.py)."""
        # (closed in finish, or with the object: the engine reads it first)
        self.spec = tempfile.NamedTemporaryFile("w", prefix="kvt-engine-", suffix=".json")  # noqa: SIM115
        json.dump(
            {"model": str(model), "socket": str(socket) if socket else None, "prompts": prompts}
            | spec,
            self.spec,
        )
        self.spec.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.e2e.engine", self.spec.name],
            cwd=root,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL if not os.environ.get("E2E_VERBOSE") else None,
            text=True,
        )
        self.answers: list[Answer] = []

    def read(self) -> dict[str, Any] | None:
        """The engine's next line of JSON; None once it has ended."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                break
        else:
            return None
        out: dict[str, Any] = json.loads(line[len(MARK) :])
        if "tokens" in out:
            self.answers.append(Answer(out["tokens"], out["cached"], out["seconds"]))
        return out

    def go_on(self) -> None:
        """Past a pause (``pause_after``)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self) -> list[Answer]:
        while self.read() is not None:
            pass
        assert self.proc.wait(120) == 0, "the engine failed (E2E_VERBOSE=1 shows its log)"
        self.spec.close()
        return self.answers


def run(model: Path, socket: Path | None, prompts: list[list[int]], **spec: Any) -> list[Answer]:
    """Each prompt's answer from one fresh engine process."""
    return Engine(model, socket, prompts, **spec).finish()


def keeps_generating_through_a_daemon_restart(model: Path, tmp: Path, **spec: Any) -> None:
    """The daemon killed after an engine's first prompt: the engine keeps
    generating, recomputing what it cannot load, the same tokens as without
    kvtier; with the daemon started again, a returning prompt's blocks come
    from kvtier again. ``spec``: the engine's (the way to kvtier)."""
    C = list(range(100, 400))
    control = run(model, None, [A, C])
    d = start(tmp, "--no-disk", "--ram-capacity", "256MiB")
    prompts = [A, *others(30, seed=2), A, C, *others(30, seed=3), C, *others(30, seed=4), C]
    engine = Engine(model, d.socket_path, prompts, pause_after=[0, 31], **spec)
    try:
        assert engine.read() is not None and engine.read() == {"paused": 0}
        d.proc.kill()
        d.proc.wait()
        engine.go_on()
        for _ in range(31):  # the others, then A, with no daemon to ask
            assert engine.read() is not None
        assert engine.answers[-1] == Answer(control[0].tokens, 0)  # recomputed, the same
        assert engine.read() == {"paused": 31}
        d = start(tmp, "--no-disk", "--ram-capacity", "256MiB")
        engine.go_on()
        answers = engine.finish()
    finally:
        engine.proc.kill()
        d.stop()
    assert all(a.tokens == control[1].tokens for a in answers[-63::31])
    # (the first C may be computed before the engine has dialled again; by
    # the last, it had stored C's blocks and loads them)
    assert answers[-1] == Answer(control[1].tokens, 9 * BLOCK)


@pytest.fixture
def kvtier() -> Iterator[EngineDaemon]:
    """A daemon with 256 MiB of RAM, no disk, stopped after the test."""
    tmp = Path(tempfile.mkdtemp(prefix="kvt-e2e-", dir="/tmp"))
    d = start(tmp, "--no-disk", "--ram-capacity", "256MiB")
    try:
        yield d
    finally:
        d.stop()
        shutil.rmtree(tmp, ignore_errors=True)
