"""The loop's idle poller alone: one callback a loop step while the window
lasts, none after it, and never in the way of the loop's other work; then
its wiring into the daemon and the client.

Loop steps are counted by yielding to the loop once each (this task resumes
one step later) against a clock the test moves by hand.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvtier import Client, State
from kvtier.config import load_config
from kvtier.daemon import Daemon
from kvtier.defaults import IDLE_POLL
from kvtier.errors import BadArgumentError
from kvtier.loops import POLL_MISSES, POLL_REST, IdlePoll
from kvtier.tiers.memory import MemoryRemoteTier
from tests.helpers import running_daemon, wait_until


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def steps(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)  # allow-sleep: one loop step, no wait (steps are what is counted)


async def test_it_polls_once_a_step_until_the_window_has_passed() -> None:
    clock = Clock()
    poll = IdlePoll(1.0, clock=clock)
    assert repr(poll) == "<IdlePoll window=1000000us idle polls=0 rests=0>"
    poll.touch()
    assert poll.polling
    await steps(5)
    assert poll.polls == 5
    assert repr(poll) == "<IdlePoll window=1000000us polling polls=5 rests=0>"
    clock.now = 0.999
    await steps(1)
    assert poll.polls == 6
    clock.now = 1.0  # the window has passed: the next poll is the last
    await steps(3)
    assert not poll.polling
    assert poll.polls == 6
    assert repr(poll) == "<IdlePoll window=1000000us idle polls=6 rests=0>"


async def test_a_touch_while_polling_extends_the_window_without_a_second_poller() -> None:
    clock = Clock()
    poll = IdlePoll(1.0, clock=clock)
    poll.touch()
    await steps(2)
    clock.now = 0.8
    poll.touch()  # now until 1.8
    poll.touch()
    await steps(4)
    assert poll.polls == 6  # still one poll a step
    clock.now = 1.5
    await steps(1)
    assert poll.polls == 7
    clock.now = 1.8
    await steps(2)
    assert not poll.polling
    assert poll.polls == 7
    poll.touch()  # a later touch starts it again
    await steps(1)
    assert poll.polling
    assert poll.polls == 8


async def test_it_stops_once_nothing_is_awaited() -> None:
    clock = Clock()
    awaited = [1]
    poll = IdlePoll(1.0, busy=lambda: bool(awaited), clock=clock)
    poll.touch()
    await steps(3)
    assert poll.polls == 3
    awaited.clear()  # the reply came, well inside the window
    await steps(2)
    assert not poll.polling
    assert poll.polls == 3


async def test_each_poll_offers_the_cpu_unless_told_to_keep_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    yielded: list[None] = []
    monkeypatch.setattr("kvtier.loops.os.sched_yield", lambda: yielded.append(None))
    clock = Clock()
    offers, keeps = IdlePoll(1.0, clock=clock), IdlePoll(1.0, clock=clock, yields=False)
    assert "keeps-cpu" in repr(keeps) and "keeps-cpu" not in repr(offers)
    keeps.touch()
    await steps(3)
    assert (keeps.polls, len(yielded)) == (3, 0)
    offers.touch()
    await steps(3)
    assert (offers.polls, len(yielded)) == (3, 3)


async def test_a_window_of_zero_never_polls() -> None:
    poll = IdlePoll(0)
    poll.touch()
    assert not poll.polling
    await steps(3)
    assert poll.polls == 0


@pytest.mark.parametrize("window", [-1e-6, float("nan")])
def test_a_window_below_zero_is_refused(window: float) -> None:
    with pytest.raises(ValueError, match="0 or more seconds"):
        IdlePoll(window)


async def missed(poll: IdlePoll, clock: Clock) -> None:
    """One touch whose poll runs out of window with nothing caught."""
    poll.touch()
    await steps(1)
    clock.now += 1.0
    await steps(1)
    assert not poll.polling


async def test_after_polls_that_catch_nothing_it_rests_then_tries_again() -> None:
    clock = Clock()
    awaited = [1]  # a reply that never comes within the window
    poll = IdlePoll(1.0, busy=lambda: bool(awaited), clock=clock)
    for _ in range(POLL_MISSES):
        await missed(poll, clock)
    assert poll.rests == 1
    assert repr(poll) == f"<IdlePoll window=1000000us resting={POLL_REST} polls=3 rests=1>"
    for left in range(POLL_REST - 1, -1, -1):
        poll.touch()  # the loop sleeps at once: no poll
        assert not poll.polling
        assert (f" resting={left} " if left else " idle ") in repr(poll)
    await steps(2)
    assert poll.polls == POLL_MISSES
    assert repr(poll) == "<IdlePoll window=1000000us idle polls=3 rests=1>"
    poll.touch()  # rested: it tries again
    assert poll.polling
    await steps(1)
    awaited.clear()  # and this time the reply comes within the window
    await steps(1)
    assert not poll.polling
    # A catch ends the run of misses: it takes POLL_MISSES more to rest again.
    awaited.append(1)
    for _ in range(POLL_MISSES - 1):
        await missed(poll, clock)
    assert poll.rests == 1
    poll.touch()
    assert poll.polling
    await missed(poll, clock)
    assert poll.rests == 2


async def test_a_poller_waiting_for_requests_never_rests() -> None:
    # The daemon's side: were it to rest as well, a client's sleeping would
    # make its polls miss, and the other way round, on an idle machine.
    clock = Clock()
    poll = IdlePoll(1.0, clock=clock)
    for _ in range(4 * POLL_MISSES):  # requests further apart than the window
        await missed(poll, clock)
    assert poll.rests == 0
    poll.touch()
    assert poll.polling


async def test_other_callbacks_run_between_polls() -> None:
    clock = Clock()
    poll = IdlePoll(1.0, clock=clock)
    poll.touch()
    ran: list[int] = []
    loop = asyncio.get_running_loop()
    for i in range(3):
        loop.call_soon(ran.append, i)
    await steps(1)
    assert ran == [0, 1, 2]
    assert poll.polling


async def test_the_daemon_and_the_client_take_their_windows(sock_dir: Path) -> None:
    sock = sock_dir / "d.sock"
    assert load_config(None, {}).server.idle_poll == IDLE_POLL
    async with running_daemon(sock_dir, server={"idle_poll": 0.001}) as daemon:
        assert daemon.server.idle_poll.window == 0.001
        assert "<IdlePoll window=1000us" in repr(daemon.server)
        async with (
            await Client.connect(sock) as default,
            await Client.connect(sock, idle_poll=0) as sleeper,
        ):
            assert default.idle_poll.window == IDLE_POLL
            assert "<IdlePoll window=200us" in repr(default)
            await sleeper.ping()
            assert sleeper.idle_poll.polls == 0
            assert not sleeper.idle_poll.polling


async def test_the_daemon_polls_from_its_answer_not_from_the_request(sock_dir: Path) -> None:
    """A request answered late (a lookup waiting on a remote tier) starts a
    new window when its answer goes: the caller's next request follows the
    answer, however long the answer took."""
    key = b"k" * 32
    tier = MemoryRemoteTier("mem")
    tier.blocks[key] = b"v" * 4096
    gate = tier.lookup_gate = asyncio.Event()
    async with running_daemon(sock_dir, remote_tiers=[tier]) as daemon:
        clock = Clock()
        daemon.server.idle_poll = poll = IdlePoll(1.0, clock=clock)
        async with await Client.connect(sock_dir / "d.sock", idle_poll=0) as client:
            lookup = asyncio.create_task(client.lookup([key], wait=30.0))
            await tier.lookup_started.wait()
            assert poll.polling  # from the request's arrival, until 1.0
            clock.now = 5.0
            await wait_until(lambda: not poll.polling)
            polls = poll.polls
            gate.set()
            (state,) = (await lookup).states
            assert state is State.HIT
            assert poll.polling  # from the answer, until 6.0
            await steps(2)
            assert poll.polls > polls
            clock.now = 6.0
            await wait_until(lambda: not poll.polling)


async def test_a_client_refuses_a_window_below_zero_before_connecting(daemon: Daemon) -> None:
    connections = len(daemon.server.connections)
    with pytest.raises(BadArgumentError, match="idle_poll"):
        await Client.connect(daemon.config.server.socket_path, idle_poll=-0.001)
    with pytest.raises(BadArgumentError, match="idle_poll"):
        await Client.connect_tcp("127.0.0.1", 1, token=b"t", idle_poll=float("nan"))
    assert len(daemon.server.connections) == connections
