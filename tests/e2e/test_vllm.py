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
from tests.enginedaemon import EngineDaemon, start


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


def test_a_leased_session_comes_back_to_its_prefix_after_other_traffic(
    model: Path, tmp_path: Path
) -> None:
    """7. A multi-turn session with a pause: turn 1 (A) carries a retention
    lease in its kv_transfer_params (docs/retention.md), 30 other prompts
    fill kvtier's RAM (RAM only, room for about 40 blocks) in the pause, and
    turn 2 extends A. With the lease, turn 2 gets A's 9 blocks from kvtier;
    without it, none are left. Tokens are the same either way."""
    turn_2 = A + list(range(400, 440))  # the session's next prompt extends A
    prompts = [A, *others(30), turn_2]
    lease = {"retention": {"session_id": "agent-1", "ttl_seconds": 600, "priority": 70}}
    control = run(model, None, [turn_2])
    answers = {}
    for leased in (True, False):
        d = start(tmp_path / str(leased), "--no-disk", "--ram-capacity", "3MiB")
        try:
            spec = {"kv_transfer_params": {"0": lease, "31": lease}} if leased else {}
            answers[leased] = run(model, d.socket_path, prompts, **spec)
            retained = d.stats()["retention"]
        finally:
            d.stop()
        if leased:
            assert retained["leased_blocks"] >= 9 and retained["returns_asked"] > 0
        else:
            assert retained["leased_blocks"] == 0
    assert answers[True][-1].tokens == answers[False][-1].tokens == control[0].tokens
    assert answers[True][-1].cached == 9 * BLOCK
    assert answers[False][-1].cached == 0
