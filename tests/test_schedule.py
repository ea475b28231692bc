"""The scheduler slice alone: a thread asks for its own and reads it back;
the others keep theirs; then the lookup process running with the one its
daemon was configured with."""

from __future__ import annotations

import asyncio
import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from kvtier.schedule import MAX_SLICE, MIN_SLICE, request_slice, slice_of
from tests.helpers import running_daemon

T = TypeVar("T")


def _release() -> tuple[int, int]:
    major, minor = platform.release().split(".")[:2]
    return int(major), int(minor)


pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or _release() < (6, 12),
    reason="custom scheduler slices came with Linux 6.12",
)


def in_a_thread(fn: Callable[[], T]) -> T:
    """``fn``'s result, run on a thread of its own (what it asks changes only
    that thread)."""
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_a_thread_asks_for_its_slice_and_the_kernel_reports_it() -> None:
    def ask() -> list[float | None]:
        default = slice_of()
        seen = [default]
        for seconds in (0.0005, 0.00001, 5.0, 0):
            assert request_slice(seconds)
            seen.append(slice_of())
        return seen

    default, half_ms, least, most, restored = in_a_thread(ask)
    assert default is not None and default >= MIN_SLICE
    assert half_ms == pytest.approx(0.0005)
    assert (least, most) == (pytest.approx(MIN_SLICE), pytest.approx(MAX_SLICE))  # clamped
    assert restored == default  # 0: the kernel's default again


def test_a_slice_is_the_asking_threads_alone() -> None:
    mine = slice_of()
    assert in_a_thread(lambda: request_slice(0.0002) and slice_of()) == pytest.approx(0.0002)
    assert slice_of() == mine


async def test_the_lookup_process_runs_with_the_configured_slice(sock_dir: Path) -> None:
    for seconds in (MIN_SLICE, 0.003):
        server = {"lookup_process": True, "lookup_slice": seconds}
        async with running_daemon(sock_dir, server=server, disk={"enabled": False}) as d:
            assert d.lookups is not None and d.lookups.feed is not None
            async with asyncio.timeout(60):
                await d.lookups.feed.listening.wait()
            assert d.lookup_process is not None
            assert slice_of(d.lookup_process.pid) == pytest.approx(seconds)
            assert slice_of() != pytest.approx(seconds)  # the daemon's own is left alone
