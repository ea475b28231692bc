"""LMCache's own vLLM connector generates with kvtier under it: the same
tokens as without, and a returning prompt's chunks come from kvtier.

The path is vLLM's ``LMCacheConnectorV1``, LMCache's cache engine and its
local CPU cache, and kvtier's LMCache backend as LMCache's storage plugin
(loads read in the engine's thread); the test's own part is the copy between vLLM's CPU KV cache and
LMCache's chunks (tests/e2e/lmcache_cpu.py), which LMCache 0.5.6 ships for
accelerators only. The prompts are conftest's, one chunk per vLLM block.
"""

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

LMCACHE = {"via": "lmcache"}


def test_lmcache_generates_the_same_tokens_with_chunks_served_from_kvtier(
    model: Path, kvtier: EngineDaemon
) -> None:
    control = run(model, None, [A, *others(30), A, SHARES_4])
    assert control[-2].cached == 0  # the control gets nothing back
    # A returning prompt: its 9 full chunks come back from kvtier (LMCache's
    # local CPU cache, 64 chunks, lost them to the 30 others).
    served = run(model, kvtier.socket_path, [A, *others(30), A], **LMCACHE)
    assert [a.tokens for a in served] == [a.tokens for a in control[:-1]]
    assert served[-1].cached == 9 * BLOCK
    before = hits(kvtier, 9)
    assert before >= 9
    # A fresh engine process loads what the first one stored.
    assert run(model, kvtier.socket_path, [A], **LMCACHE) == [Answer(control[0].tokens, 9 * BLOCK)]
    assert hits(kvtier, before + 9) >= before + 9
    # A prompt sharing only A's first 4 chunks gets exactly those.
    partial = run(model, kvtier.socket_path, [SHARES_4], **LMCACHE)
    assert partial == [Answer(control[-1].tokens, 4 * BLOCK)]
    maps = kvtier.stats()["maps"]
    assert (maps["request_states"], maps["reservations"]) == (0, 0), maps


def test_lmcache_keeps_generating_while_kvtier_is_down(model: Path, tmp_path: Path) -> None:
    """The daemon killed after the first prompt: LMCache's lookups answer
    nothing, the engine recomputes, the same tokens; with the daemon back,
    a returning prompt's chunks come from kvtier again."""
    keeps_generating_through_a_daemon_restart(model, tmp_path, **LMCACHE)
