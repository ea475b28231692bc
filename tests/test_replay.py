"""Trace replay: the reference LRU figures, the default beating LRU, and a daemon
reaching the offline figure at the same byte capacity."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

from kvtier import replay as rp
from kvtier.cli import main
from kvtier.client.aio import Client
from kvtier.core.costs import Costs
from kvtier.daemon import Daemon
from kvtier.errors import ConfigError
from kvtier.model import LookupMode
from kvtier.tiers.shares import Quota
from tests.helpers import running_daemon
from tests.test_lookup_process import answered

TRACE = Path(__file__).resolve().parent.parent / "traces" / "mooncake_synthetic.jsonl.gz"
#: published LRU prefix-hit ratios of this trace at 5%, 10%, 20% of its blocks
REFERENCE_LRU = {"5%": 0.155, "10%": 0.260, "20%": 0.391}
#: and Belady's OPT's, as published
REFERENCE_OPT = {"5%": 0.396, "20%": 0.608}


@pytest.fixture(scope="module")
def chains() -> list[rp.Chain]:
    return rp.load_trace(TRACE)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """The trace's first 300 requests, as a file of their own."""
    path = tmp_path / "small.jsonl"
    with gzip.open(TRACE, "rt") as fh:
        path.write_text("".join(next(fh) for _ in range(300)))
    return path


def test_the_trace_is_the_published_one(chains: list[rp.Chain]) -> None:
    assert len(chains) == 3993
    assert rp.unique_blocks(chains) == 43924


def test_the_references_reproduce_the_published_figures(chains: list[rp.Chain]) -> None:
    # (harc against LRU on this trace and every workload: tests/test_hit_rate.py)
    for capacity in rp.parse_capacities("5%,10%,20%", rp.unique_blocks(chains)):
        plain = rp.plain_lru(chains, capacity)
        assert abs(plain.ratio - REFERENCE_LRU[capacity[0]]) < 0.0005, (capacity, plain.ratio)
        # the tier's LRU (a chain's head its most recent block) reads a little above
        lru = rp.replay(chains, "lru", capacity)
        assert plain.ratio <= lru.ratio < plain.ratio + 0.005, (capacity, lru.ratio)
    for capacity in rp.parse_capacities("5%,20%", rp.unique_blocks(chains)):
        best = rp.belady(chains, capacity)
        assert abs(best.ratio - REFERENCE_OPT[capacity[0]]) < 0.0005, (capacity, best.ratio)


@pytest.mark.parametrize("policy", ["lru", "harc"])
async def test_a_daemon_reaches_the_offline_figure(
    chains: list[rp.Chain], sock_dir: Path, policy: str
) -> None:
    part = chains[:1200]
    blocks = rp.unique_blocks(part) // 10
    async with running_daemon(
        sock_dir, ram={"capacity": blocks * 1024, "policy": policy}, disk={"enabled": False}
    ) as d:
        online = await rp.replay_daemon(part, d.socket_path, block_size=1024)
    offline = rp.replay(part, policy, ("10%", blocks), block_size=1024)
    assert online.blocks == offline.blocks == blocks
    assert online.requested == offline.requested
    assert online.hits > 0
    if policy == "lru":
        assert online.hits == offline.hits
    else:
        # The client stages a PUT of many blocks in chunks of shared-memory
        # rooms, each making its room in one pass; the replay makes a
        # request's room at once. ARC's lists adapt between the passes (the
        # blocks its lookup hit wait, unevicted, until its writes are done):
        # the two may part by a few hits.
        assert abs(online.hits - offline.hits) <= offline.hits // 200


SIZE = 4096
#: two sessions' prompts: ``a`` comes back with 3 blocks more, then ``b``
A = [b"a%d" % i for i in range(6)]
B = [b"b%d" % i for i in range(4)]


async def two_sessions(d: Daemon, client: Client, mode: LookupMode, lookup_process: bool) -> None:
    """Each turn looks its prompt up (``mode``) and stores the blocks it
    missed; ``a`` returns with 3 blocks more, then ``b``'s next turn fills a
    RAM of 10 blocks."""
    looked = 0

    async def turn(keys: list[bytes]) -> int:
        nonlocal looked
        reply = await client.lookup(keys, mode=mode)
        looked += 1
        if lookup_process:  # (its report reaches the daemon before the PUT, as
            await answered(d, looked)  # it does before an engine's store)
        rest = keys[reply.prefix_hits :]
        await client.put_many(rest, [bytes(SIZE)] * len(rest))
        return reply.prefix_hits

    assert await turn(A[:3]) == 0
    assert await turn(B[:3]) == 0
    assert await turn(A) == 3
    assert await turn(B) == 3


@pytest.mark.parametrize("mode", [LookupMode.PREFIX, LookupMode.KEYS], ids=["prefix", "keys"])
@pytest.mark.parametrize("lookup_process", [False, True], ids=["daemon", "lookup-process"])
async def test_a_returning_prompt_loses_its_new_tail_before_its_head(
    sock_dir: Path, lookup_process: bool, mode: LookupMode
) -> None:
    """A small RAM and no disk to hold what it lets go (its lookups answered
    by the daemon or by the lookup process, which reports them to it; of
    the prompt's prefix, or of each key as vLLM's tier asks): a session
    looks its prompt up and stores the blocks it missed; under pressure
    RAM lets those go first, then the hits tail first, and keeps no block
    behind a missing one."""
    async with (
        running_daemon(
            sock_dir,
            ram={"capacity": 10 * SIZE},
            disk={"enabled": False},
            server={"lookup_process": lookup_process},
        ) as d,
        await Client.connect(d.socket_path) as client,
    ):
        await two_sessions(d, client, mode, lookup_process)
        held = []
        for i in range(6):  # pressure, one block at a time
            await client.put_many([b"z%d" % i], [bytes(SIZE)])
            reply = await client.lookup(A, mode=LookupMode.PREFIX, peek=True)
            held.append(reply.prefix_hits)
    # a's new tail first, then its hits tail first (were the hits shown
    # before the writes, they would go first, stranding the new tail: 2, 1, 0, 0, 0, 0)
    assert held == [5, 4, 3, 2, 1, 0]


@pytest.mark.parametrize("mode", [LookupMode.PREFIX, LookupMode.KEYS], ids=["prefix", "keys"])
async def test_on_the_defaults_a_returning_prompt_keeps_its_head_in_ram(
    sock_dir: Path, mode: LookupMode
) -> None:
    """The same on the defaults (but a small RAM): the lookup process
    answers, the disk below keeps what RAM lets go. After three blocks of
    pressure RAM still holds the prompt's head, and only its new tail is
    read from the disk."""
    async with (
        running_daemon(sock_dir, ram={"capacity": 10 * SIZE}, server={"lookup_process": True}) as d,
        await Client.connect(d.socket_path) as client,
    ):
        await two_sessions(d, client, mode, lookup_process=True)
        await client.put_many([b"z%d" % i for i in range(3)], [bytes(SIZE)] * 3)
        await d.settle()  # (the disk has every block written through)
        from_disk = []
        for key in A:  # head first: a block read from RAM is then its most recent
            before = (await client.stats())["tiers"]["disk"]["reads"]
            assert await client.get(key) is not None
            from_disk.append((await client.stats())["tiers"]["disk"]["reads"] - before)
    # (were the hits shown before the writes, the head would be on the disk)
    assert from_disk == [0, 0, 0, 1, 1, 1]


def test_tail_hints_come_from_partial_last_blocks_and_help_lru(chains: list[rp.Chain]) -> None:
    tails = rp.tail_hints(TRACE)
    assert len(tails) == len(chains)
    # 512-token blocks, as Mooncake's: the first request, 40160 tokens, ends partial.
    assert rp.block_tokens([(40160, 79), (512, 1), (1024, 2)]) == 512
    assert tails[0] and 0.5 < sum(tails) / len(tails) < 1.0
    for capacity in rp.parse_capacities("5%,10%,20%", rp.unique_blocks(chains)):
        plain = rp.replay(chains, "lru", capacity)
        hinted = rp.replay(chains, "lru", capacity, tails=tails)
        assert hinted.policy == "lru+hints" and hinted.ratio > plain.ratio, capacity


async def test_a_daemon_takes_the_same_hints_as_the_offline_replay(
    chains: list[rp.Chain], sock_dir: Path
) -> None:
    part = chains[:600]
    tails = rp.tail_hints(TRACE)[:600]
    blocks = rp.unique_blocks(part) // 10
    async with running_daemon(
        sock_dir, ram={"capacity": blocks * 1024, "policy": "lru"}, disk={"enabled": False}
    ) as d:
        online = await rp.replay_daemon(part, d.socket_path, block_size=1024, tails=tails)
        sent = d.metrics.registry.get_sample_value("kvtier_put_hints_total", {"hint": "tail"})
    offline = rp.replay(part, "lru", ("10%", blocks), block_size=1024, tails=tails)
    assert (online.hits, online.requested) == (offline.hits, offline.requested)
    assert sent is not None and sent > 0


def test_capacities_parse_as_percentages_or_counts() -> None:
    assert rp.parse_capacities("5%, 2000", 10_000) == [("5%", 500), ("2000", 2000)]
    with pytest.raises(ConfigError, match="percentage or a block count"):
        rp.parse_capacities("lots", 100)
    with pytest.raises(ConfigError, match="less than one block"):
        rp.parse_capacities("0.001%", 100)


def test_the_command_prints_a_table_and_json(
    small: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(small), "--capacity", "10%", "--policy", "lru"]) == 0
    out = capsys.readouterr().out
    assert "lru" in out and "10%" in out
    assert main(["replay", str(small), "--capacity", "10%,20%", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["policy"] for r in doc["results"]} == {"lru", "harc"}
    assert all(0 <= r["prefix_hit_ratio"] <= 1 for r in doc["results"])
    ceiling = doc["infinite_prefix_hit_ratio"]
    for r in doc["results"]:
        lru = next(
            x for x in doc["results"] if x["policy"] == "lru" and x["capacity"] == r["capacity"]
        )
        assert r["vs_lru"] == round(r["prefix_hit_ratio"] / lru["prefix_hit_ratio"], 4)
        assert r["vs_infinite"] == round(r["prefix_hit_ratio"] / ceiling, 4) <= 1
    # Every policy in one sweep, with the ratios under the figures.
    assert main(["replay", str(small), "--capacity", "5%,10%", "--policy", "all"]) == 0
    out = capsys.readouterr().out
    assert all(p in out for p in ("harc", "lru", "arc", "s3fifo", "infinite"))
    assert "ratio to lru" in out and "share of the infinite cache's" in out


def test_the_infinite_cache_is_a_cache_that_never_evicts(chains: list[rp.Chain]) -> None:
    part = chains[:800]
    unique = rp.unique_blocks(part)
    never_full = rp.replay(part, "lru", ("all", unique))
    ceiling = rp.infinite(part)
    assert (ceiling.hits, ceiling.requested) == (never_full.hits, never_full.requested)
    assert rp.infinite(chains).ratio == pytest.approx(0.640, abs=0.001)  # as published


def test_a_bad_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1, 2]}\n{"nope": 1}\n')
    assert main(["replay", str(bad)]) == 2
    assert "bad.jsonl:2: not a JSON object with hash_ids" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "missing.jsonl")]) == 2


def test_a_fleet_of_one_is_the_single_cache(chains: list[rp.Chain]) -> None:
    part = chains[:1000]
    capacity = rp.parse_capacities("5%", rp.unique_blocks(part))[0]
    alone = rp.replay(part, "harc", capacity)
    for routing in rp.Routing:
        fleet = rp.replay_fleet(part, "harc", capacity, 1, routing)
        assert (fleet.hits, fleet.requested, fleet.loads) == (alone.hits, alone.requested, (1000,))


def test_a_kv_aware_router_finds_prefixes_random_placement_scatters(
    chains: list[rp.Chain],
) -> None:
    part = chains[:1200]
    capacity = rp.parse_capacities("5%", rp.unique_blocks(part))[0]
    runs = {routing: rp.replay_fleet(part, "harc", capacity, 4, routing) for routing in rp.Routing}
    rr = runs[rp.Routing.ROUND_ROBIN]
    assert rr.loads == (300, 300, 300, 300) and rr.spread == 1.0
    kv, rnd = runs[rp.Routing.KV_AWARE], runs[rp.Routing.RANDOM]
    assert kv.ratio > 1.5 * rnd.ratio  # what knowing where the prefixes are buys
    assert max(kv.loads) <= rp.LOAD_CAP * 1200 / 4 + 1  # and no node is flooded
    # Seeded: the same placement every run.
    assert rp.replay_fleet(part, "harc", capacity, 4, rp.Routing.RANDOM).loads == rnd.loads
    # Peers turn the four caches into one pool for a router that knows nothing.
    pooled = rp.replay_fleet(part, "harc", capacity, 4, rp.Routing.RANDOM, peers=True)
    assert pooled.ratio > 1.5 * rnd.ratio


def test_the_fleet_command_prints_and_refuses_bad_counts(
    small: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", str(small), "--capacity", "10%", "--nodes", "1,4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {(f["nodes"], f["routing"]) for f in doc["fleets"]} == {
        (n, r) for n in (1, 4) for r in ("random", "round-robin", "kv-aware")
    }
    assert all(f["load_spread"] >= 1.0 for f in doc["fleets"])
    assert main(["replay", str(small), "--nodes", "4", "--routing", "kv-aware", "--peers"]) == 0
    assert "kv-aware +peers" in capsys.readouterr().out
    assert main(["replay", str(small), "--nodes", "four"]) == 2
    assert "--nodes 'four'" in capsys.readouterr().err
    assert main(["replay", str(small), "--nodes", "0"]) == 2


def tenants() -> tuple[list[rp.Chain], list[rp.Chain]]:
    """A quiet workload that keeps coming back to 50 prefixes of 8 blocks (a
    working set of 400 blocks), and a noisy one that reads each of its
    prefixes twice (so a frequency-aware policy keeps it too) and never again."""
    rng = random.Random(3)
    quiet = [[p * 100 + i for i in range(8)] for p in (rng.randrange(50) for _ in range(600))]
    noisy = [[10_000 + r * 8 + i for i in range(8)] for r in range(50) for _ in range(2)]
    return quiet, noisy


@pytest.mark.parametrize("policy", ["lru", "harc"])
def test_a_quiet_namespace_keeps_its_hit_ratio_under_a_noisy_one_with_its_ram_min(
    policy: str,
) -> None:
    quiet, noisy = tenants()
    capacity = ("1000 blocks", 1000)
    alone = rp.replay_tenants(quiet, noisy, policy, capacity, rate=0)
    shared = rp.replay_tenants(quiet, noisy, policy, capacity, rate=10)
    quotas = {rp.QUIET: Quota(min=500 * 4096)}
    kept = rp.replay_tenants(quiet, noisy, policy, capacity, rate=10, quotas=quotas)
    assert alone.quiet > 0.85 and alone.noisy is None
    assert shared.quiet < alone.quiet - 0.5  # the noisy one's stream evicts it
    assert abs(kept.quiet - alone.quiet) < 0.01  # with its ram_min: unchanged
    assert shared.noisy is not None and kept.noisy is not None
    # The noisy one hits its second reads either way.
    assert kept.noisy == shared.noisy == 0.5


def test_a_noisy_namespace_over_its_max_gives_way_first() -> None:
    quiet, noisy = tenants()
    capacity = ("1000 blocks", 1000)
    capped = {rp.NOISY: Quota(max=300 * 4096)}
    kept = rp.replay_tenants(quiet, noisy, "lru", capacity, rate=10, quotas=capped)
    alone = rp.replay_tenants(quiet, noisy, "lru", capacity, rate=0)
    assert abs(kept.quiet - alone.quiet) < 0.01


def test_the_tenants_command_reports_each_namespace_alone_shared_and_with_quotas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    quiet, noisy = tenants()
    for name, chains in (("quiet", quiet), ("noisy", noisy)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(json.dumps({"hash_ids": c}) + "\n" for c in chains)
        )
    args = [str(tmp_path / "quiet.jsonl"), "--noisy", str(tmp_path / "noisy.jsonl")]
    args += ["--capacity", "1000", "--ram-min", "50%", "--policy", "lru"]
    assert main(["replay", *args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by = {r["setup"]: r for r in doc["results"]}
    assert list(by) == ["alone", "floor", "shared", "quotas"]
    assert by["floor"]["capacity_blocks"] == 500
    assert by["quotas"]["quiet_prefix_hit_ratio"] >= by["floor"]["quiet_prefix_hit_ratio"]
    assert by["shared"]["quiet_prefix_hit_ratio"] < by["floor"]["quiet_prefix_hit_ratio"]
    assert main(["replay", *args]) == 0
    assert "quotas" in capsys.readouterr().out
    assert main(["replay", *args[:-4], "--ram-min", "half"]) == 2
    assert "expected a percentage" in capsys.readouterr().err


def test_budgeted_answers_recompute_what_a_slow_tier_would_only_delay() -> None:
    """Two requests of one chain: the second finds its blocks below RAM (a
    RAM of one block). Where the tier below loads a block slower than the
    engine recomputes it, budgeted answers recompute it; where faster,
    they load it as yes/no answers do."""
    chains = [[1, 2, 3], [4], [1, 2, 3]]
    slow = rp.parse_tier_costs("ram=0us/1000GB,s3=30ms/100MB")
    fast = rp.parse_tier_costs("ram=0us/1000GB,disk=100us/2GB")

    def replayed(costs: Costs) -> rp.TTFTResult:
        return rp.replay_ttft(
            chains,
            "lru",
            ("1 block", 1),
            costs,
            block_bytes=2 << 20,
            recompute_seconds_per_block=0.010,
        )

    r = replayed(slow)
    assert r.plain[:2] == [pytest.approx(0.030), pytest.approx(0.010)]  # nothing found: recomputed
    # the third: 3 blocks from S3 (30 ms + 3 x 21 ms) against 30 ms to recompute them
    assert r.plain[2] == pytest.approx(0.030 + 3 * (2 << 20) / 100e6)
    assert r.budgeted[2] == pytest.approx(0.030) and r.cut == 3
    r = replayed(fast)
    assert r.budgeted == r.plain and r.cut == 0
    assert r.plain[2] == pytest.approx(100e-6 + 3 * (2 << 20) / 2e9)


@pytest.mark.parametrize(
    "text",
    ["ram=20us/5GB", "ram=20/5GB,s3=1ms/1MB", "ram=20us/5GB,s3=1ms/0MB", "=1us/1GB,x=1s/1GB"],
)
def test_tier_costs_that_do_not_parse_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="--tier-cost"):
        rp.parse_tier_costs(text)
