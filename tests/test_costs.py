"""Lookups that know what a load costs: the sources' estimates, the budget's
cut (pure, table-driven), the wire field, and a daemon answering a budget."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import Client, State
from kvtier.core.costs import SMALL_LOAD, Costs, Estimate, Occupancy, budget_cut
from kvtier.model import Lookup, LookupMode
from kvtier.tiers.memory import MemoryRemoteTier
from kvtier.wire import CodecError, decode_lookup, encode_lookup
from tests.helpers import running_daemon, short_tmpdir
from tests.s3server import ProxiedS3

MiB = 1 << 20


def known() -> Costs:
    """RAM free, the disk 1 ms then 1 GB/s, S3 20 ms then 100 MB/s."""
    return Costs(
        {
            "ram": Estimate(ttfb=0.0, throughput=1e15),
            "disk": Estimate(ttfb=1e-3, throughput=1e9),
            "s3": Estimate(ttfb=20e-3, throughput=100e6),
        }
    )


def test_a_lookups_own_loads_are_neither_queued_ahead_of_it_nor_wait_a_first_byte() -> None:
    """S3 at 20 ms then 10.5 ms a MiB; 12 ms a block recomputed. Four blocks
    not loading yet never pay back S3's first byte (and less so behind four
    other loads); the same four already loading (their own four in flight)
    are worth waiting for."""
    s3, sizes, budget = ["s3"] * 4, [MiB] * 4, 4 * 12e-3
    assert budget_cut(s3, sizes, known(), budget) == 0
    assert budget_cut(s3, sizes, known(), budget, inflight={"s3": 4}) == 0
    assert budget_cut(s3, sizes, known(), budget, {"s3": 4}, loading={"s3": 4}) == 4
    # two of their own loading, two others' ahead of them: the queue counts again
    assert budget_cut(s3, sizes, known(), budget, {"s3": 4}, loading={"s3": 2}) == 0


def test_a_loads_sharing_is_the_mean_count_in_flight_while_it_ran() -> None:
    now = [0.0]
    occ = Occupancy(lambda: now[0])
    a = occ.begin("s3")  # alone for 1 s, then with b for 1 s, then with b and c for 2 s
    now[0] = 1.0
    b = occ.begin("s3")
    now[0] = 2.0
    c = occ.begin("s3")
    assert occ.inflight == {"s3": 3}
    now[0] = 4.0
    assert occ.end("s3", a) == (4.0, pytest.approx((1 + 2 + 3 * 2) / 4))
    now[0] = 5.0  # b: 1 s with a, 2 s with a and c, 1 s with c
    assert occ.end("s3", b) == (4.0, pytest.approx((2 + 3 * 2 + 2) / 4))
    assert occ.end("s3", c) == (3.0, pytest.approx((3 * 2 + 2) / 3))
    assert occ.inflight == {"s3": 0}
    d = occ.begin("disk")  # another source's count is its own
    assert occ.end("disk", d) == (0.0, 1.0)


def test_a_load_that_shared_its_source_teaches_the_sources_whole_rate() -> None:
    """Four loads of 1 MiB in flight together, each taking 100 ms: the
    source moved 4 MiB in that time, not 1."""
    alone, shared = Costs(), Costs()
    for _ in range(40):
        alone.observe("s3", 0.1, MiB, sharing=1)
        shared.observe("s3", 0.1, MiB, sharing=4)
    assert shared.of("s3").throughput == pytest.approx(4 * alone.of("s3").throughput, rel=0.05)


@pytest.mark.parametrize(
    ("sources", "budget", "cut"),
    [
        # no budget: nothing is cut
        (["disk"] * 4, 0.0, 4),
        # RAM (nearly free here): any budget keeps it
        (["ram"] * 8, 1e-3, 8),
        # the disk: 2.05 ms for the first MiB, 1.05 ms each after. At 2 ms a
        # block recomputed, the first barely loses, the rest win: all four.
        (["disk"] * 4, 8e-3, 4),
        # at 1 ms a block, no prefix saves anything: recompute them all
        (["disk"] * 4, 4e-3, 0),
        # RAM's head, then S3 (30.5 ms for its first MiB) at 5 ms a block: the head only
        (["ram", "ram", "s3", "s3"], 20e-3, 2),
        # a key that would not load (a MISS) costs nothing to load
        (["disk", None, "disk"], 9e-3, 3),
        # S3 pays its first byte once: at 20 ms a block it never makes up for it,
        # at 45 ms it does
        (["disk", "s3"], 40e-3, 1),
        (["disk", "s3"], 90e-3, 2),
    ],
)
def test_a_budget_cuts_where_loading_stops_saving_time(
    sources: list[str | None], budget: float, cut: int
) -> None:
    sizes = [MiB] * len(sources)
    assert budget_cut(sources, sizes, known(), budget) == cut


def test_loads_in_flight_and_unknown_sizes_count() -> None:
    costs = known()
    assert budget_cut(["disk"], [0], costs, 2.1e-3) == 1  # 0: the source's mean block (1 MiB)
    # four reads in flight: a new one waits behind their mean MiB each
    assert budget_cut(["disk"], [MiB], costs, 2.1e-3, {"disk": 4}) == 0
    assert budget_cut(["disk"], [MiB], costs, 6.3e-3, {"disk": 4}) == 1
    assert budget_cut(["disk"], [MiB], costs, 2.1e-3, {"s3": 4}) == 1


@given(
    st.lists(st.sampled_from(["ram", "disk", "s3", None]), max_size=30),
    st.floats(1e-9, 1),
    st.floats(1e-9, 1),
)
def test_a_larger_budget_never_cuts_earlier(
    sources: list[str | None], low: float, high: float
) -> None:
    low, high = sorted((low, high))
    sizes = [MiB] * len(sources)
    assert budget_cut(sources, sizes, known(), low) <= budget_cut(sources, sizes, known(), high)


def test_estimates_learn_from_loads_and_stay_sane() -> None:
    costs = Costs()
    prior = costs.of("disk").ttfb
    for _ in range(50):
        costs.observe("disk", 5e-3, SMALL_LOAD)  # small loads: time to first byte
    assert costs.of("disk").ttfb == pytest.approx(5e-3, rel=1e-3) and prior < 1e-3
    for _ in range(50):
        costs.observe("disk", 5e-3 + 8 * MiB / 2e9, 8 * MiB, 8)  # large ones: throughput
    assert costs.of("disk").throughput == pytest.approx(2e9, rel=0.05)
    assert costs.of("disk").block_bytes == pytest.approx(MiB, rel=0.01)
    before = costs.of("disk").ttfb, costs.of("disk").throughput
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        costs.observe("disk", bad, MiB)
    costs.observe("disk", 1.0, 0)  # a load that found nothing teaches nothing
    assert (costs.of("disk").ttfb, costs.of("disk").throughput) == before
    costs.observe("disk", 1e-12, 100 * MiB)  # a clock's glitch: bounded
    assert costs.of("disk").throughput <= 1e12
    assert costs.of("s3-west").ttfb >= 10e-3  # an unknown remote tier: an object store's prior


def test_a_probes_round_trip_teaches_the_time_to_first_byte_only() -> None:
    costs = Costs()
    throughput = costs.of("s3").throughput
    for _ in range(50):
        costs.round_trip("s3", 4e-3)
    assert costs.of("s3").ttfb == pytest.approx(4e-3, rel=1e-3)
    assert costs.of("s3").throughput == throughput and costs.of("s3").loads == 0
    for bad in (float("nan"), float("inf"), -1.0, 0.0):
        costs.round_trip("s3", bad)
    assert costs.of("s3").ttfb == pytest.approx(4e-3, rel=1e-3)


def test_the_budget_travels_in_the_lookup_and_bad_ones_are_refused() -> None:
    req = Lookup([b"a", b"b"], budget=0.25)
    assert decode_lookup(encode_lookup(req)) == req
    assert decode_lookup(encode_lookup(Lookup([b"a"]))).budget == 0.0
    meta = bytearray(encode_lookup(req))
    meta[22:30] = b"\xff" * 8  # a NaN where the budget is
    with pytest.raises(CodecError, match="positive number of seconds"):
        decode_lookup(bytes(meta))
    with pytest.raises(CodecError, match="truncated LOOKUP budget"):
        decode_lookup(bytes(meta[:25]))


async def test_a_daemon_answers_the_prefix_its_budget_can_load(sock_dir: Path) -> None:
    async with running_daemon(sock_dir, ram={"capacity": "5MiB"}) as daemon:
        keys = [b"block-%d" % i for i in range(8)]
        async with await Client.connect(daemon.socket_path) as c:
            for key in keys:  # on the disk, durably; RAM keeps the last four
                await c.put(key, b"x" * MiB, durable=True)
            in_ram = [k for k in keys if k in daemon.ram.budget]
            order = in_ram + [k for k in keys if k not in in_ram]  # RAM's, then the disk's
            assert 2 <= len(in_ram) <= 5
            costs = daemon.service.answers.c.costs
            costs.sources.update(known().sources)
            assert (await c.lookup(order, peek=True)).states == [State.HIT] * 8
            # 0.5 ms a block recomputed: RAM's blocks save time, the disk's never do
            reply = await c.lookup(order, budget=8 * 0.5e-3, peek=True)
            fits = len(in_ram)
            assert reply.states == [State.HIT] * fits + [State.MISS] * (8 - fits)
            assert reply.prefix_hits == fits
            # 3 ms a block: every disk block saves time too
            reply = await c.lookup(order, budget=8 * 3e-3, peek=True)
            assert reply.prefix_hits == 8
            stats = await c.stats()
        assert stats["sources"]["disk"]["ttfb_seconds"] == 1e-3
        assert stats["lookup_budget_cut"] == {"disk": 8 - fits}
        cut = daemon.metrics.registry.get_sample_value(
            "kvtier_lookup_budget_cut_total", {"tier": "disk"}
        )
        assert cut == 8 - fits


async def test_a_daemons_probes_teach_their_tiers_time_to_first_byte(sock_dir: Path) -> None:
    """A remote tier's estimate starts at an object store's prior (30 ms);
    probes that answer in microseconds bring it down before any load."""
    remote = MemoryRemoteTier("remote")
    async with (
        running_daemon(sock_dir, remote_tiers=[remote]) as daemon,
        await Client.connect(daemon.socket_path) as c,
    ):
        prior = (await c.stats())["sources"]["remote"]["ttfb_seconds"]
        for i in range(20):
            assert (await c.lookup([b"absent-%d" % i], wait=5.0)).states == [State.MISS]
        learnt = (await c.stats())["sources"]["remote"]["ttfb_seconds"]
    assert len(remote.lookup_calls) == 20 and not remote.load_calls
    assert learnt < prior / 2


def requests(s3: ProxiedS3, method: str, bucket: str) -> int:
    """Requests of ``method`` on ``bucket``'s objects (the store is the session's)."""
    return sum(
        n for (m, p), n in s3.proxy.counts.items() if m == method and p.startswith(f"/{bucket}/")
    )


@pytest.mark.parametrize("remote_hit", ["promote", "hit"])
async def test_a_budget_starts_no_s3_work_for_what_it_cuts(s3: ProxiedS3, remote_hit: str) -> None:
    """Blocks only in S3, a reader that knows S3 costs 20 ms a block: a
    budget too small for S3 (though RAM would fit it) answers MISS and
    sends no HEAD and no GET, whatever ``remote_hit``; keys a promotion
    is bringing from S3 are costed as S3's, and cut as S3's."""
    bucket = s3.new_bucket()
    keys = [b"s3-only-%d" % i for i in range(16)]
    async with running_daemon(
        short_tmpdir(), remote_tier_configs=[s3.tier_config(bucket)]
    ) as writer:
        async with await Client.connect(writer.socket_path) as c:
            await c.put_many(keys, [bytes([i]) * MiB for i in range(16)])
        await writer.settle()
    async with (
        running_daemon(
            short_tmpdir(),
            remote_tier_configs=[s3.tier_config(bucket)],
            lookup={"remote_hit": remote_hit},
        ) as daemon,
        await Client.connect(daemon.socket_path) as c,
    ):
        daemon.service.answers.c.costs.sources.update(known().sources)
        heads, gets = requests(s3, "HEAD", bucket), requests(s3, "GET", bucket)
        for budget in (1e-4, 16 * 0.5e-3):  # nothing fits; RAM would, S3 does not
            for _ in range(3):
                reply = await c.lookup(keys, mode=LookupMode.PREFIX, budget=budget, wait=1.0)
                assert reply.states == [State.MISS] * 16 and reply.prefix_hits == 0
        await daemon.settle()
        assert (requests(s3, "HEAD", bucket), requests(s3, "GET", bucket)) == (heads, gets)
        assert (await c.stats())["lookup_budget_cut"] == {"s3": 6 * 16}

        # A lookup without a budget finds them; with promote, loads start (held
        # at S3): the keys in flight cost what S3 costs.
        s3.proxy.hold("GET")
        try:
            for _ in range(200):  # until the probes have answered (each waits 50 ms at most)
                first = await c.lookup(keys, mode=LookupMode.PREFIX, wait=0.05)
                if State.RETRY not in first.states:
                    break
            if remote_hit == "promote":
                assert set(first.states) == {State.PENDING}
            else:
                assert first.states == [State.HIT] * 16
            reply = await c.lookup(keys, mode=LookupMode.PREFIX, budget=16 * 0.5e-3)
            assert reply.states == [State.MISS] * 16
            assert (await c.stats())["lookup_budget_cut"] == {"s3": 7 * 16}
            if remote_hit == "promote":
                # the keys' own loads in flight are neither queued ahead of them
                # nor wait a first byte again (whatever the probes taught S3's):
                # a budget that pays for their bytes once keeps them all
                reply = await c.lookup(keys, mode=LookupMode.PREFIX, budget=16 * 16e-3)
                assert State.MISS not in reply.states
            # a budget S3 fits keeps them all
            reply = await c.lookup(keys, mode=LookupMode.PREFIX, budget=16 * 1.0)
            assert State.MISS not in reply.states
        finally:
            s3.proxy.release()
        await daemon.settle()
