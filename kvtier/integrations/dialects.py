"""The engines' retention hints, each dialect mapped to one lease.

Every engine says "keep this session's cache" its own way; this module is
the one place that knows how, and turns each into a
:class:`~kvtier.model.Retention` (session, ttl, priority; docs/retention.md
has the table). Pure: it imports no engine and reads the engines' objects
by their documented attributes, or the same shapes as plain mappings.

- **KV-hint envelopes** (vLLM's ``KvHintsEnvelope``, the same envelope
  Dynamo passes as ``kv_transfer_params["kv_hint"]`` and SGLang's
  ``kv_hints``): an action of type ``kv.retain`` (version 1.x) whose
  payload has ``session_id``, ``ttl_seconds`` (or ``ttl``: "5m") and
  ``priority``.
- **vLLM**: the envelope on the request (``ReqContext.kv_hints``), else in
  ``kv_transfer_params["kv_hint"]``, else ``kv_transfer_params["retention"]``
  (``{"session_id", "ttl_seconds", "priority"}``).
- **SGLang**: ``HiCacheStorageExtraInfo.extra_info``: ``priority`` and
  ``retention_seconds`` (its soft retention), ``session_id`` (or ``rid``),
  or a ``kv_hints`` envelope.
- **LMCache**: the request's tags (``request_configs["lmcache.tag.<name>"]``,
  which LMCache keeps on each key as ``tags``): ``session_id``,
  ``retention_seconds`` (or ``ttl``), ``priority``.
- **Dynamo**: ``nvext.cache_control = {"type": "ephemeral", "ttl": "5m"}``
  (the TTL defaults to 5 minutes, as Dynamo's own).
- **TensorRT-LLM**: ``KvCacheRetentionConfig``: the highest priority of its
  token ranges (0..100) and their longest ``duration_ms``, or its decode
  priority and duration.

A hint without a session id leases under the anonymous session (ended by
its TTL only); a priority is clamped into 0..100; a TTL past a week is a
week; a session id longer than 64 bytes is kept as its digest. A hint that
says nothing of retention maps to None; one that is malformed raises
ValueError naming what is wrong.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from kvtier.model import (
    DEFAULT_RETENTION_PRIORITY,
    MAX_RETENTION_PRIORITY,
    MAX_RETENTION_SECONDS,
    MAX_SESSION_BYTES,
    Retention,
)

#: the action type kvtier reads in a KV-hint envelope
RETAIN_ACTION = "kv.retain"
#: the TTL of a hint that names none (Dynamo's ephemeral default)
DEFAULT_TTL = 300.0
#: the priority TensorRT-LLM gives a range that names none
TRTLLM_DEFAULT_PRIORITY = 35

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")
_UNIT = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, None: 1.0}


def retention(session: object, ttl: object = None, priority: object = None) -> Retention:
    """A lease from loosely typed values (a session id as str or bytes, a
    TTL as seconds or "5m", a priority as a number), normalised as the
    module's docstring says."""
    return Retention(
        _session(session),
        min(seconds(ttl) if ttl is not None else DEFAULT_TTL, MAX_RETENTION_SECONDS),
        _priority(priority),
    )


def seconds(value: object) -> float:
    """A duration: a number of seconds, or a string such as "5m", "1h", "90s"."""
    if isinstance(value, bool):
        raise ValueError(f"a duration, not {value!r}")
    if isinstance(value, int | float):
        out = float(value)
    elif isinstance(value, str) and (m := _DURATION.match(value)):
        out = float(m.group(1)) * _UNIT[m.group(2)]
    else:
        raise ValueError(f"a duration is seconds or a string like '5m', not {value!r}")
    if not math.isfinite(out) or out <= 0:
        raise ValueError(f"a retention ttl must be positive, not {value!r}")
    return out


def from_kv_hints(envelope: object) -> Retention | None:
    """The lease of a KV-hint envelope's ``kv.retain`` action (the last one
    wins), or None when it has none."""
    if envelope is None:
        return None
    found = None
    for action in _get(envelope, "actions") or ():
        kind = _get(action, "action_type")
        version = str(_get(action, "action_version") or "1")
        if kind != RETAIN_ACTION:
            continue
        if not version.split(".")[0] == "1":
            raise ValueError(f"{RETAIN_ACTION} version {version}: this kvtier reads 1.x")
        payload = _get(action, "payload") or {}
        found = retention(
            _first(payload, "session_id", "session"),
            _first(payload, "ttl_seconds", "ttl"),
            _get(payload, "priority"),
        )
    return found


def from_vllm(
    kv_transfer_params: Mapping[str, Any] | None, kv_hints: object = None
) -> Retention | None:
    """A vLLM request's lease: its KV-hint envelope, else the one Dynamo
    passes in ``kv_transfer_params["kv_hint"]``, else
    ``kv_transfer_params["retention"]``."""
    found = from_kv_hints(kv_hints)
    if found is not None or not kv_transfer_params:
        return found
    found = from_kv_hints(kv_transfer_params.get("kv_hint"))
    if found is not None:
        return found
    spec = kv_transfer_params.get("retention")
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise ValueError("kv_transfer_params['retention'] must be an object")
    return retention(
        _first(spec, "session_id", "session"),
        _first(spec, "ttl_seconds", "ttl"),
        spec.get("priority"),
    )


def from_sglang(extra_info: object) -> Retention | None:
    """An SGLang HiCache call's lease (``HiCacheStorageExtraInfo``)."""
    info = _get(extra_info, "extra_info") if extra_info is not None else None
    if not info:
        return None
    found = from_kv_hints(_get(info, "kv_hints"))
    if found is not None:
        return found
    ttl, priority = _get(info, "retention_seconds"), _get(info, "priority")
    if ttl is None and priority is None:
        return None
    return retention(_first(info, "session_id", "rid"), ttl, priority)


def from_lmcache_tags(
    tags: Iterable[tuple[str, object]] | Mapping[str, object] | None,
) -> Retention | None:
    """An LMCache request's lease, from its tags (``CacheEngineKey.tags``,
    or ``request_configs`` with the ``lmcache.tag.`` prefix)."""
    if not tags:
        return None
    items = tags.items() if isinstance(tags, Mapping) else tags
    named = {str(k).removeprefix("lmcache.tag."): v for k, v in items}
    ttl = _first(named, "retention_seconds", "ttl")
    priority = named.get("priority")
    if ttl is None and priority is None:
        return None
    return retention(_first(named, "session_id", "session"), ttl, priority)


def from_dynamo_cache_control(cache_control: object, session: object = None) -> Retention | None:
    """Dynamo's ``nvext.cache_control`` (``{"type": "ephemeral", "ttl": "5m"}``)
    for ``session``; None when absent or of another type."""
    if not cache_control:
        return None
    kind = _get(cache_control, "type")
    if kind != "ephemeral":
        raise ValueError(f"cache_control type {kind!r}: only 'ephemeral' is a retention")
    return retention(session, _get(cache_control, "ttl") or DEFAULT_TTL)


def from_trtllm(config: object, session: object = None) -> Retention | None:
    """TensorRT-LLM's ``KvCacheRetentionConfig`` for ``session``: its token
    ranges' highest priority and longest duration (a range's
    ``duration_ms``), or the decode priority and duration; None without one."""
    if config is None:
        return None
    ranges = list(_get(config, "token_range_retention_configs") or ())
    priorities = [_get(r, "priority") for r in ranges]
    durations = [_get(r, "duration_ms") for r in ranges]
    priorities.append(_get(config, "decode_retention_priority"))
    durations.append(_get(config, "decode_duration_ms"))
    known = [p for p in priorities if p is not None]
    lasting = [d for d in durations if d is not None]
    priority = max(known) if known else TRTLLM_DEFAULT_PRIORITY
    ttl = max(seconds(d) / 1000 for d in lasting) if lasting else None
    return retention(session, ttl, priority)


def _session(value: object) -> bytes:
    if value is None:
        return b""
    raw = value if isinstance(value, bytes) else str(value).encode()
    if len(raw) > MAX_SESSION_BYTES:
        return hashlib.blake2b(raw, digest_size=MAX_SESSION_BYTES // 2).hexdigest().encode()
    return raw


def _priority(value: object) -> int:
    if value is None:
        return DEFAULT_RETENTION_PRIORITY
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"a retention priority is a number, not {value!r}")
    return max(0, min(MAX_RETENTION_PRIORITY, round(value)))


def _get(obj: object, name: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name)
    return getattr(obj, name, None)


def _first(obj: object, *names: str) -> Any:
    for name in names:
        value = _get(obj, name)
        if value is not None:
            return value
    return None
