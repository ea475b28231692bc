"""Every engine's retention dialect mapped to one lease
(kvtier/integrations/dialects.py), with the shapes those projects send:
the engines' own classes are used where their venvs have them
(tests/vllm, tests/sglang, tests/lmcache); here, the same shapes as the
plain mappings and objects they serialise to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvtier.integrations import dialects
from kvtier.model import DEFAULT_RETENTION_PRIORITY, Retention


def envelope(*actions: dict[str, Any]) -> dict[str, Any]:
    """vLLM's KvHintsEnvelope (and Dynamo's kv_hint, SGLang's kv_hints) as JSON."""
    return {"protocol_version": "0.1", "message_id": "m-1", "actions": list(actions)}


def retain(payload: dict[str, Any], version: str = "1.0") -> dict[str, Any]:
    return {
        "action_id": "turn-3-retain",
        "action_type": "kv.retain",
        "action_version": version,
        "payload": payload,
    }


FETCH = {"action_id": "f", "action_type": "kv.fetch", "action_version": "1.0", "payload": {}}


def test_a_kv_hint_envelope_retains_by_its_retain_action() -> None:
    hints = envelope(FETCH, retain({"session_id": "agent-7", "ttl_seconds": 120, "priority": 80}))
    assert dialects.from_kv_hints(hints) == Retention(b"agent-7", 120.0, 80)
    assert dialects.from_kv_hints(envelope(FETCH)) is None
    assert dialects.from_kv_hints(None) is None
    with pytest.raises(ValueError, match=r"1\.x"):
        dialects.from_kv_hints(envelope(retain({"session_id": "s"}, version="2.0")))


def test_vllm_reads_the_envelope_then_dynamos_bridge_then_its_params() -> None:
    hints = envelope(retain({"session_id": "a", "ttl": "5m"}))
    params = {"retention": {"session_id": "b", "ttl_seconds": 30, "priority": 10}}
    assert dialects.from_vllm(params, hints) == Retention(b"a", 300.0, DEFAULT_RETENTION_PRIORITY)
    assert dialects.from_vllm({"kv_hint": hints, **params}) == Retention(b"a", 300.0, 50)
    assert dialects.from_vllm(params) == Retention(b"b", 30.0, 10)
    assert dialects.from_vllm(None) is None
    assert dialects.from_vllm({"do_remote_prefill": True}) is None
    with pytest.raises(ValueError, match="must be an object"):
        dialects.from_vllm({"retention": "forever"})


@dataclass
class HiCacheStorageExtraInfo:  # SGLang's fields (sglang/srt/mem_cache/hicache_storage.py)
    prefix_keys: list[str] | None = None
    extra_info: dict[str, Any] | None = None


def test_sglang_reads_its_soft_retention_from_the_extra_info() -> None:
    info = HiCacheStorageExtraInfo(["h0"], {"priority": 3, "retention_seconds": 90, "rid": "r-1"})
    assert dialects.from_sglang(info) == Retention(b"r-1", 90.0, 3)
    info = HiCacheStorageExtraInfo(None, {"session_id": "s", "priority": 250})
    assert dialects.from_sglang(info) == Retention(b"s", dialects.DEFAULT_TTL, 100)  # clamped
    hinted = HiCacheStorageExtraInfo(None, {"kv_hints": envelope(retain({"session_id": "e"}))})
    assert dialects.from_sglang(hinted) == Retention(b"e", dialects.DEFAULT_TTL, 50)
    assert dialects.from_sglang(HiCacheStorageExtraInfo()) is None
    assert dialects.from_sglang(HiCacheStorageExtraInfo(None, {"other": 1})) is None
    assert dialects.from_sglang(None) is None


def test_lmcache_reads_its_request_tags() -> None:
    configs = {"lmcache.tag.session_id": "u-9", "lmcache.tag.retention_seconds": "1h"}
    assert dialects.from_lmcache_tags(configs) == Retention(b"u-9", 3600.0, 50)
    # as CacheEngineKey keeps them: (name, value) pairs without the prefix
    tags = (("session_id", "u-9"), ("priority", 70), ("ttl", 45))
    assert dialects.from_lmcache_tags(tags) == Retention(b"u-9", 45.0, 70)
    assert dialects.from_lmcache_tags((("user", "x"),)) is None
    assert dialects.from_lmcache_tags(None) is None


def test_dynamos_cache_control_is_a_ttl_for_the_session() -> None:
    nvext = {"cache_control": {"type": "ephemeral", "ttl": "1h"}}
    assert dialects.from_dynamo_cache_control(nvext["cache_control"], "conv-2") == Retention(
        b"conv-2", 3600.0, 50
    )
    assert dialects.from_dynamo_cache_control({"type": "ephemeral"}, "c") == Retention(
        b"c", 300.0, 50
    )
    assert dialects.from_dynamo_cache_control(None) is None
    with pytest.raises(ValueError, match="ephemeral"):
        dialects.from_dynamo_cache_control({"type": "persistent"})


@dataclass
class TokenRangeRetentionConfig:  # TensorRT-LLM's (tensorrt_llm.bindings.executor)
    token_start: int
    token_end: int | None
    priority: int
    duration_ms: int | None = None


@dataclass
class KvCacheRetentionConfig:
    token_range_retention_configs: list[TokenRangeRetentionConfig] = field(default_factory=list)
    decode_retention_priority: int = 35
    decode_duration_ms: int | None = None


def test_trtllm_keeps_the_highest_priority_and_the_longest_duration() -> None:
    config = KvCacheRetentionConfig(
        [TokenRangeRetentionConfig(0, 1024, 90, 60_000), TokenRangeRetentionConfig(1024, None, 20)],
        decode_retention_priority=10,
        decode_duration_ms=5_000,
    )
    assert dialects.from_trtllm(config, "s") == Retention(b"s", 60.0, 90)
    assert dialects.from_trtllm(KvCacheRetentionConfig(), "s") == Retention(
        b"s", dialects.DEFAULT_TTL, 35
    )
    assert dialects.from_trtllm(None) is None


def test_values_are_normalised_or_refused_clearly() -> None:
    assert dialects.retention("x" * 200, 10).session == dialects.retention("x" * 200, 10).session
    assert len(dialects.retention("x" * 200, 10).session) == 64
    assert dialects.retention(None, 10).session == b""
    assert dialects.retention("s", 30 * 86400).ttl == 7 * 86400.0  # a week at most
    assert dialects.retention("s", "90s", -5).priority == 0
    for bad in ("soon", 0, -1, float("nan"), True):
        with pytest.raises(ValueError, match=r"duration|ttl"):
            dialects.seconds(bad)
    with pytest.raises(ValueError, match="priority"):
        dialects.retention("s", 10, "high")
