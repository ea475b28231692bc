"""vLLM generates on the CPU with kvtier under it: the same tokens as
without, and a returning prompt's blocks come from kvtier.

Each engine is a real vLLM process (tests/e2e/engine.py) running a tiny
Llama made in the test, greedy; the offload path is vLLM's OffloadingConnector,
tiering manager and CPU primary tier, with kvtier's tier as its secondary
tier (tests/e2e/offload.py is the test's own part: block copies without CUDA).
The prompts are conftest's: A's 9 full blocks, pushed out of the engine's KV
cache (128 blocks) and its CPU tier (64 blocks) by 30 others."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.conftest import (
    SHARES_4,
    A,
    Answer,
    hits,
    keeps_generating_through_a_daemon_restart,
    others,
    run,
)
from tests.e2e.engine import BLOCK
from tests.enginedaemon import EngineDaemon


def test_vllm_generates_the_same_tokens_with_prefixes_served_from_kvtier(
    model: Path, kvtier: EngineDaemon
) -> None:
    # 5. The control: the same sequence without kvtier gets nothing back.
    control = run(model, None, [A, *others(30), A, SHARES_4])
    assert control[-2].tokens == control[0].tokens
    assert control[-2].cached == 0  # pushed out of vLLM's own cache
    # 1. With kvtier: A's 9 full blocks come back from it, the same tokens.
    served = run(model, kvtier.socket_path, [A, *others(30), A])
    assert [a.tokens for a in served] == [a.tokens for a in control[:-1]]
    assert served[0].cached == 0
    assert served[-1].cached == 9 * BLOCK
    before = hits(kvtier, 9)
    assert before >= 9
    # 2. A fresh engine process: A's prefix is what the first one stored.
    fresh = run(model, kvtier.socket_path, [A])
    assert fresh == [Answer(control[0].tokens, 9 * BLOCK)]
    assert hits(kvtier, before + 9) >= before + 9
    # 3. Another fresh one, with a prompt sharing only A's first 4 blocks.
    partial = run(model, kvtier.socket_path, [SHARES_4])
    assert partial == [Answer(control[-1].tokens, 4 * BLOCK)]
    # 6. The engines are gone: the daemon holds no request state,
    #    reservation or lease for them.
    maps = kvtier.stats()["maps"]
    assert (maps["request_states"], maps["reservations"]) == (0, 0), maps


def test_an_engine_keeps_generating_while_kvtier_is_down(model: Path, tmp_path: Path) -> None:
    """4. The daemon killed after the engine's first prompt: the engine
    keeps generating, recomputing what it cannot load, the same tokens; with
    the daemon started again, it stores and loads through kvtier again."""
    keeps_generating_through_a_daemon_restart(model, tmp_path)
