"""Where a returning prompt's time to first token goes, as the engine
process sees it: each engine step, what its scheduler asked of the
offloading tiers and what kvtier's tier answered and did, on one clock.

:func:`install` wraps the methods below (vLLM's and kvtier's, unchanged
otherwise) so each call records ``(seconds, what, detail)`` on
:data:`EVENTS`; the engine (tests/e2e/engine.py, ``"timeline": true``)
prints them after each prompt. ``seconds`` is ``time.perf_counter()``, the
clock of the prompt's own ``seconds`` too. For benchmarks
(benchmarks/ttft.py), never for tests.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

#: (perf_counter seconds, what, detail), in the order they happened
EVENTS: list[tuple[float, str, Any]] = []
_lock = threading.Lock()


def note(what: str, detail: Any = None) -> None:
    with _lock:
        EVENTS.append((time.perf_counter(), what, detail))


def take() -> list[tuple[float, str, Any]]:
    with _lock:
        out = EVENTS[:]
        EVENTS.clear()
    return out


def _wrap(
    cls: type, name: str, what: str, detail: Callable[..., Any] | None = None, end: bool = True
) -> None:
    inner = getattr(cls, name)

    @functools.wraps(inner)
    def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        note(what + (".start" if end else ""), detail(self, *args, **kwargs) if detail else None)
        out = inner(self, *args, **kwargs)
        if end:
            note(what + ".end", _result(out))
        return out

    setattr(cls, name, traced)


def _result(out: Any) -> Any:
    if isinstance(out, (int, float, str)) or out is None:
        return out
    if isinstance(out, (list, tuple, set)):
        return len(out)
    return type(out).__name__


def _wrap_async(cls: type, name: str, what: str) -> None:
    inner = getattr(cls, name)

    @functools.wraps(inner)
    async def traced(self: Any, *args: Any, **kwargs: Any) -> Any:
        note(what + ".start", len(args[1]) if len(args) > 1 else None)
        try:
            return await inner(self, *args, **kwargs)
        finally:
            note(what + ".end")

    setattr(cls, name, traced)


def install() -> None:
    """Trace the engine's steps, its scheduler's lookups, kvtier's tier and
    the copies into the engine's KV cache."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    from kvtier.integrations.engine import EngineTier
    from kvtier.integrations.vllm import KvtierTier
    from tests.e2e.offload import CopyWorker

    _wrap(EngineCore, "step", "step")
    _wrap(Scheduler, "schedule", "schedule")
    _wrap(CPUModelRunner, "execute_model", "forward", lambda s, out, *a, **k: _tokens(out))
    _wrap(KvtierTier, "lookup", "kvtier.lookup", end=False, detail=_answer_later)
    _wrap(KvtierTier, "on_schedule_end", "kvtier.flush", end=False)
    _wrap(KvtierTier, "submit_load", "kvtier.submit_load", lambda s, job: len(job.keys), False)
    _wrap(KvtierTier, "get_finished_jobs", "kvtier.finished", end=True)
    _wrap(CopyWorker, "submit_load", "copy_to_kv", lambda s, job, a, b: len(a.block_ids))
    _wrap_async(EngineTier, "_load", "kvtier.get_many_into")
    _wrap_async(EngineTier, "_lookup", "kvtier.LOOKUP")


def _answer_later(self: Any, key: Any, ctx: Any) -> None:
    return None


def _tokens(scheduler_output: Any) -> int:
    return int(getattr(scheduler_output, "total_num_scheduled_tokens", 0))


def summary(events: list[tuple[float, str, Any]], started: float) -> list[dict[str, Any]]:
    """The events as milliseconds since ``started``, with consecutive
    kvtier lookups folded into one line (their count)."""
    out: list[dict[str, Any]] = []
    for at, what, detail in events:
        ms = round((at - started) * 1000, 3)
        if what == "kvtier.lookup" and out and out[-1]["what"] == what:
            out[-1]["n"] += 1
            continue
        line: dict[str, Any] = {"ms": ms, "what": what}
        if what == "kvtier.lookup":
            line["n"] = 1
        elif detail is not None:
            line["detail"] = detail
        out.append(line)
    return out
