"""Replay a request trace through the RAM tier's real eviction policies.

A trace is JSON lines with ``hash_ids``: one id per block, a request's ids
forming a chain (block i is usable only if blocks 0..i-1 are), as in
Mooncake's FAST'25 traces; or agent sessions, one JSON file each, in a
folder or a tarball (:func:`load_sessions`), interleaved as concurrent
users. The metric is the *prefix-hit ratio*: the blocks each request
finds as a leading run in the cache, over all blocks requested, replaying
requests in order and then inserting or touching every block of the
request.

Offline, each request runs through a :class:`~kvtier.tiers.ram.RamTier`
built with the named policy (the daemon's own classes, not a model of
them): ``contains`` for the leading run, then ``get`` (a touch) or ``put``
for each block. Against a running daemon, each request is one LOOKUP in
prefix mode (its hits are touched, as for any engine) and one PUT of the
blocks after the leading run; the daemon's RAM capacity sets the offline
replay it is compared with.

With hints (``--hints``), each request's last block carries the TAIL hint
a writer would give it when it is partial: the trace's ``input_length``
does not fill its blocks, the block size (in tokens) being the power of two
that makes the block counts of most requests match their lengths. An
engine knows this of its own blocks (LMCache stores a partial last chunk);
the trace says it too.
"""

from __future__ import annotations

import enum
import gzip
import heapq
import json
import random
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kvtier.core.costs import Costs, Estimate, budget_cut, load_seconds
from kvtier.errors import ConfigError
from kvtier.model import NAMESPACE_ESCAPE, NAMESPACE_MARK, Buffer, Retention, namespace_prefix
from kvtier.tiers.policy import POLICIES, EvictionPolicy, make_policy
from kvtier.tiers.ram import RamTier
from kvtier.tiers.rendezvous import owner
from kvtier.tiers.shares import Quota, Shares

Chain = list[int]
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class Result:
    policy: str
    #: capacity as asked ("5%") and in blocks
    capacity: str
    blocks: int
    hits: int
    requested: int
    #: of the returning turns (a request whose first block an earlier one
    #: had): prefix hits, blocks
    returning_hits: int = 0
    returning: int = 0

    @property
    def ratio(self) -> float:
        return self.hits / self.requested if self.requested else 0.0

    @property
    def returning_ratio(self) -> float | None:
        return self.returning_hits / self.returning if self.returning else None

    def as_dict(self) -> dict[str, Any]:
        out = {
            "policy": self.policy,
            "capacity": self.capacity,
            "capacity_blocks": self.blocks,
            "prefix_hits": self.hits,
            "blocks_requested": self.requested,
            "prefix_hit_ratio": round(self.ratio, 6),
        }
        if self.returning:
            out["returning_prefix_hit_ratio"] = round(self.returning_hits / self.returning, 6)
        return out


def load_trace(path: Path) -> list[Chain]:
    """The chains of a JSON-lines trace, gzipped if named ``.gz`` (each line
    needs ``hash_ids``)."""
    chains: list[Chain] = []
    try:
        with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    ids = json.loads(line)["hash_ids"]
                except (ValueError, KeyError, TypeError):
                    raise ConfigError(f"{path}:{n}: not a JSON object with hash_ids") from None
                if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                    raise ConfigError(f"{path}:{n}: hash_ids must be a list of integers")
                chains.append(ids)
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc}") from exc
    return chains


def tail_hints(path: Path) -> list[bool]:
    """Per request of the trace at ``path``: whether its last block is partial
    (a TAIL hint), from ``input_length``; all False when the trace has none."""
    lengths: list[tuple[int, int]] = []
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                lengths.append((int(row.get("input_length") or 0), len(row["hash_ids"])))
    tokens = block_tokens(lengths)
    if tokens is None:
        return [False] * len(lengths)
    return [n > 0 and tokens_in % tokens != 0 for tokens_in, n in lengths]


def block_tokens(lengths: Sequence[tuple[int, int]]) -> int | None:
    """The block size in tokens (a power of two, 1..64 Ki) under which most
    requests' (input_length, blocks) agree; None when none fits most."""
    best, best_fit = None, 0
    for shift in range(17):
        size = 1 << shift
        fit = sum(1 for tokens, n in lengths if tokens and -(-tokens // size) == n)
        if fit > best_fit:
            best, best_fit = size, fit
    return best if best_fit * 2 > len(lengths) else None


def unique_blocks(chains: Iterable[Chain]) -> int:
    return len({i for chain in chains for i in chain})


def parse_capacities(text: str, unique: int, prompt: float = 0.0) -> list[tuple[str, int]]:
    """``"5%,10%,2000,3p"`` as (label, blocks): percentages of the unique
    blocks, counts, or (with ``prompt``, the busy sessions' average prompt
    in blocks) a number of prompts."""
    out = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            if part.endswith("p"):
                if prompt <= 0:
                    raise ConfigError(f"capacity {part!r}: prompts are agent sessions' unit")
                blocks = round(float(part[:-1]) * prompt)
            else:
                blocks = round(unique * float(part[:-1]) / 100) if part.endswith("%") else int(part)
        except ValueError:
            raise ConfigError(
                f"capacity {part!r}: expected a percentage or a block count"
            ) from None
        if blocks < 1:
            raise ConfigError(f"capacity {part!r} is less than one block")
        out.append((part, blocks))
    if not out:
        raise ConfigError("no capacity given")
    return out


def key_of(block_id: int) -> bytes:
    """A block id as a stored key of the default namespace (escaped as the
    daemon escapes one that starts with the namespace mark)."""
    key = block_id.to_bytes(8, "little", signed=True)
    return NAMESPACE_ESCAPE + key if key[0] == NAMESPACE_MARK else key


Progress = Callable[[int, int], None]


def leading_run(chain: Sequence[T], held: Callable[[T], bool]) -> int:
    """How many of ``chain``'s first blocks ``held`` holds, up to the first it does not."""
    run = 0
    for block in chain:
        if not held(block):
            break
        run += 1
    return run


def _store_rest(tier: RamTier, keys: list[bytes], run: int, value: Buffer, cold: int = -1) -> None:
    """A PUT of ``keys[run:]`` as the daemon serves one: one eviction pass for
    the batch, then the blocks admitted tail first (``cold``: the index of a
    block put with the TAIL hint, or -1)."""
    if len(keys) - run > 1:
        rest = keys[run:]
        tier.make_room(rest, [value] * len(rest))
    for i in range(len(keys) - 1, run - 1, -1):
        tier.put(keys[i], value, cold=i == cold)


def replay(
    chains: Sequence[Chain],
    policy: str,
    capacity: tuple[str, int],
    *,
    block_size: int = 4096,
    tails: Sequence[bool] | None = None,
    retentions: Sequence[Retention | None] | None = None,
    times: Sequence[float] | None = None,
    retained_share: float = 0.8,
    progress: Progress | None = None,
) -> Result:
    """Replay ``chains`` through a RAM tier of ``capacity`` blocks under
    ``policy``, as the daemon serves an engine: a prefix lookup (its hits
    touched), then a PUT of the blocks after the leading run (tail first, as
    the daemon admits a batch). ``tails``: per chain, whether its new last
    block is put with the TAIL hint; ``retentions``: per chain, the lease its
    engine sends with both (None: none), at ``times`` (seconds; the lease
    clock), its lookup naming the session's whole prompt (``whole``: the
    session's leases on a prompt it left end)."""
    label, blocks = capacity
    ram = RamTier(blocks * block_size, make_policy(policy), retained_share=retained_share)
    value = memoryview(bytes(block_size))  # every block shares one buffer
    contains, touch_later = ram.contains, ram.touch_later
    book = ram.retention
    heads: set[int] = set()
    leases: dict[bytes, Retention] = {}  # each session's latest
    hits = requested = returning_hits = returning = 0
    step = max(1, len(chains) // 100)
    for n, chain in enumerate(chains):
        keys = [key_of(i) for i in chain]
        lease = retentions[n] if retentions is not None else None
        now = times[n] if times is not None else float(n)
        if book:
            ram.expire_leases(now)
        run = leading_run(keys, contains)
        hits += run
        requested += len(keys)
        if chain and chain[0] in heads:  # a returning turn
            returning += len(keys)
            returning_hits += run
        elif chain:
            heads.add(chain[0])
        if lease is not None:  # the lookup renews what the session said last
            said = leases.get(lease.session)
            if said is not None and run:
                ram.retain(keys[:run], said, now)
            if said is not None:  # (it names the whole prompt: a prompt left ends)
                ram.supersede(lease.session, keys)
        touch_later(keys, run)  # (after the lease's renewal, as the daemon answers)
        _store_rest(ram, keys, run, value, len(keys) - 1 if tails is not None and tails[n] else -1)
        if lease is not None:  # the store says how long, and how much it matters
            ram.retain(keys, lease, now)
            leases[lease.session] = lease
        if progress is not None and n % step == 0:
            progress(n, len(chains))
    name = policy + ("+hints" if tails is not None or retentions is not None else "")
    return Result(name, label, blocks, hits, requested, returning_hits, returning)


def plain_lru(chains: Sequence[Chain], capacity: tuple[str, int]) -> Result:
    """LRU as a cache that knows no chains orders blocks (vLLM's CPU offload
    tier, a Redis sidecar): each request's blocks touched or added in the
    request's order, so a chain's head is its least recent block. The
    reference the policies are compared with."""
    label, blocks = capacity
    order: OrderedDict[int, None] = OrderedDict()
    hits = requested = 0
    for chain in chains:
        hits += leading_run(chain, order.__contains__)
        requested += len(chain)
        for b in chain:
            if b in order:
                order.move_to_end(b)
            else:
                order[b] = None
                if len(order) > blocks:
                    order.popitem(last=False)
    return Result("plain-lru", label, blocks, hits, requested)


def belady(chains: Sequence[Chain], capacity: tuple[str, int]) -> Result:
    """Belady's optimum (MIN, with bypass) at ``capacity`` blocks: at each
    eviction the block used again furthest in the future goes (a block
    never used again is not kept; of a chain's blocks used next by the same
    request the deepest goes first). Knows the future: the reference no
    policy can beat. Time O(N log C) and memory O(N) for N blocks requested
    (4 bytes each) and C blocks of capacity."""
    label, blocks = capacity
    never = len(chains)
    future: list[array[int] | None] = [None] * len(chains)
    last: dict[int, int] = {}
    for r in range(len(chains) - 1, -1, -1):
        chain = chains[r]
        future[r] = array("i", [last.get(b, never) for b in chain])
        for b in chain:
            last[b] = r
    del last
    cache: dict[int, tuple[int, int]] = {}  # block -> (next use, depth)
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, block); stale ones skipped
    hits = requested = 0
    for r, chain in enumerate(chains):
        hits += leading_run(chain, cache.__contains__)
        requested += len(chain)
        uses = future[r]
        future[r] = None
        assert uses is not None
        for depth, (b, u) in enumerate(zip(chain, uses, strict=True)):
            if u == never:
                cache.pop(b, None)
                continue
            cache[b] = (u, depth)
            heapq.heappush(heap, (-u, -depth, b))
        while len(cache) > blocks:
            u, d, b = heapq.heappop(heap)
            if cache.get(b) == (-u, -d):
                del cache[b]
        if len(heap) > 4 * len(cache) + 4096:
            heap = [(-u, -d, b) for b, (u, d) in cache.items()]
            heapq.heapify(heap)
    return Result("belady", label, blocks, hits, requested)


# -- what an engine waits for: time to first token with plain and budgeted answers

_DURATION = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE = {"KB": 1e3, "MB": 1e6, "GB": 1e9}


def parse_tier_costs(text: str) -> Costs:
    """``ram=20us/5GB,disk=150us/1.5GB,s3=30ms/200MB``: each tier's time to
    first byte and throughput (bytes a second); raises ConfigError."""
    costs = Costs()
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, spec = part.partition("=")
        latency, _, rate = spec.partition("/")
        try:
            unit = next(u for u in ("us", "ms", "s") if latency.endswith(u))
            scale = next(u for u in _RATE if rate.endswith(u))
            ttfb = float(latency[: -len(unit)]) * _DURATION[unit]
            throughput = float(rate[: -len(scale)]) * _RATE[scale]
        except (StopIteration, ValueError):
            raise ConfigError(
                f"--tier-cost {part!r}: NAME=LATENCY/RATE, e.g. disk=150us/1.5GB"
            ) from None
        if not name or ttfb < 0 or throughput <= 0:
            raise ConfigError(f"--tier-cost {part!r}: a name, a latency >= 0 and a rate > 0")
        costs.sources[name] = Estimate(ttfb, throughput)
    if "ram" not in costs.sources or len(costs.sources) < 2:
        raise ConfigError("--tier-cost names ram and the tier below it, e.g. ram=...,disk=...")
    return costs


@dataclass(slots=True, frozen=True)
class TTFTResult:
    """Modelled time to first token per request, with yes/no answers (every
    block found is loaded) and with budgeted ones (the prefix that saves
    the most time is loaded, the rest recomputed)."""

    policy: str
    capacity: str
    plain: list[float]
    budgeted: list[float]
    #: blocks loaded, and blocks the budget sent to be recomputed instead
    loaded: int
    cut: int
    #: blocks found (yes/no answers) in RAM, and in the tier below it
    from_ram: int = 0
    from_lower: int = 0
    #: the returning turns' times (a request whose first block an earlier one had)
    returning: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "capacity": self.capacity,
            "requests": len(self.plain),
            "ttft_plain": _quantiles(self.plain),
            "ttft_budgeted": _quantiles(self.budgeted),
            "ttft_returning_turns": _quantiles(self.returning),
            "blocks_loaded": self.loaded,
            "blocks_cut": self.cut,
            "blocks_from_ram": self.from_ram,
            "blocks_from_lower_tier": self.from_lower,
        }


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    if not ordered:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.50), "p99": at(0.99)}


def replay_ttft(
    chains: Sequence[Chain],
    policy: str,
    capacity: tuple[str, int],
    costs: Costs,
    *,
    block_bytes: int,
    recompute_seconds_per_block: float,
    retentions: Sequence[Retention | None] | None = None,
    times: Sequence[float] | None = None,
    lower_blocks: int | None = None,
) -> TTFTResult:
    """Each request's time to first token, modelled: its leading run of
    blocks found anywhere is loaded (RAM's from RAM, under ``policy`` at
    ``capacity`` blocks, served as :func:`replay` serves it, leases
    included; a block not in RAM from the tier below it, the second of
    ``costs``, which holds every block written, or, with ``lower_blocks``,
    that many under ``policy``, written through and kept the longer for a
    lease), the rest recomputed at ``recompute_seconds_per_block``. With
    budgeted answers, the loaded prefix is the one
    :func:`~kvtier.core.costs.budget_cut` keeps. Costs are
    :func:`~kvtier.core.costs.load_seconds`' model."""
    label, blocks = capacity
    lower_name = next(name for name in costs.sources if name != "ram")
    ram = RamTier(blocks * 4096, make_policy(policy))
    below = RamTier(lower_blocks * 4096, make_policy(policy)) if lower_blocks else None
    value = memoryview(bytes(4096))
    seen: set[int] = set()
    heads: set[int] = set()
    plain: list[float] = []
    budgeted: list[float] = []
    returning: list[float] = []
    loaded = cut_blocks = from_ram = from_lower = 0
    for n, chain in enumerate(chains):
        keys = [key_of(i) for i in chain]
        lease = retentions[n] if retentions is not None else None
        now = times[n] if times is not None else float(n)
        for tier in (ram, below):
            if tier is not None and tier.retention:
                tier.expire_leases(now)
        sources: list[str | None] = []
        for block, key in zip(chain, keys, strict=True):
            if ram.contains(key):
                sources.append("ram")
            elif below.contains(key) if below is not None else block in seen:
                sources.append(lower_name)
            else:
                break
        n_keys, found = len(chain), len(sources)
        sizes = [block_bytes] * found
        loads = [0.0, *load_seconds(sources, sizes, costs)]  # loads[p]: the first p blocks
        keep = budget_cut(sources, sizes, costs, found * recompute_seconds_per_block)
        plain.append(loads[found] + (n_keys - found) * recompute_seconds_per_block)
        budgeted.append(loads[keep] + (n_keys - keep) * recompute_seconds_per_block)
        if chain and chain[0] in heads:
            returning.append(plain[-1])
        elif chain:
            heads.add(chain[0])
        loaded += found
        cut_blocks += found - keep
        ram_found = sum(1 for s in sources if s == "ram")
        from_ram += ram_found
        from_lower += found - ram_found
        if lease is not None:  # (its lookup names the whole prompt: a prompt left ends)
            for tier in (ram, below):
                if tier is not None:
                    tier.supersede(lease.session, keys)
        _serve(ram, keys, value)
        if below is not None:  # (written through)
            _serve(below, keys, value)
        if lease is not None:
            for tier in (ram, below):
                if tier is not None:
                    tier.retain(keys, lease, now)
        seen.update(chain)
    return TTFTResult(
        policy + ("+hints" if retentions is not None else ""),
        label,
        plain,
        budgeted,
        loaded,
        cut_blocks,
        from_ram,
        from_lower,
        returning,
    )


def _serve(tier: RamTier, keys: list[bytes], value: memoryview) -> None:
    """A request as the daemon serves it: the lookup's leading hits touched,
    then a PUT of the rest (one eviction pass, tail first)."""
    lead = leading_run(keys, tier.contains)
    tier.touch_later(keys, lead)
    _store_rest(tier, keys, lead, value)


def ttft_table(results: Sequence[TTFTResult]) -> str:
    lines = [
        f"{'policy':12}{'capacity':>10}{'':>4}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}"
        f"{'  blocks loaded / cut':>22}  {'ram / below':>16}  {'returning p50':>15}"
    ]
    for r in results:
        for how, values, cut in (("yes/no", r.plain, 0), ("budget", r.budgeted, r.cut)):
            q = _quantiles(values)
            extra = f"{r.loaded - cut:>12} / {cut}"
            where = f"{r.from_ram:>8} / {r.from_lower}" if how == "yes/no" else ""
            back = f"{_quantiles(r.returning)['p50'] * 1e3:>12.1f} ms" if how == "yes/no" else ""
            lines.append(
                f"{r.policy:12}{r.capacity:>10} {how:>6}{q['mean'] * 1e3:>10.1f}"
                f"{q['p50'] * 1e3:>10.1f}{q['p99'] * 1e3:>10.1f}  {extra:>20}"
                f"  {where:>16}  {back:>15}"
            )
    return "\n".join(lines)


# -- two tenants: a quiet workload and a noisy one, as two namespaces

QUIET, NOISY = b"quiet", b"noisy"


@dataclass(slots=True, frozen=True)
class TenantResult:
    """Both namespaces' prefix-hit ratios in one RAM tier, for one setup."""

    #: "alone" (the quiet workload by itself), "floor" (by itself in a tier of
    #: its ram_min: what the quota guarantees), "shared" (both, no quotas),
    #: "quotas" (both, with the quiet one's ram_min and the noisy one's ram_max)
    setup: str
    capacity: str
    blocks: int
    quiet: float
    noisy: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "setup": self.setup,
            "capacity": self.capacity,
            "capacity_blocks": self.blocks,
            "quiet_prefix_hit_ratio": round(self.quiet, 6),
            "noisy_prefix_hit_ratio": None if self.noisy is None else round(self.noisy, 6),
        }


def replay_tenants(
    quiet: Sequence[Chain],
    noisy: Sequence[Chain],
    policy: str,
    capacity: tuple[str, int],
    *,
    rate: int = 10,
    quotas: dict[bytes, Quota] | None = None,
    setup: str = "",
    block_size: int = 4096,
) -> TenantResult:
    """Replay ``quiet`` and, after each of its requests, ``rate`` requests of
    ``noisy`` (its trace cycled, each pass under new block ids: a stream that
    never comes back), each in its own namespace of one RAM tier of
    ``capacity`` blocks. ``quotas``: the namespaces' quotas (the tier then
    shares itself among them, as a daemon with ``[namespaces]`` does); None:
    one policy for every block, as without. ``rate`` 0: the quiet one alone."""
    label, blocks = capacity
    total = blocks * block_size
    order: EvictionPolicy[bytes] = (
        make_policy(policy)
        if quotas is None
        else Shares(total, quotas, lambda: make_policy(policy))
    )
    ram = RamTier(total, order)
    value = memoryview(bytes(block_size))
    counts = {QUIET: [0, 0], NOISY: [0, 0]}
    span = 1 + max((i for chain in noisy for i in chain), default=0)

    def request(ns: bytes, chain: Chain, offset: int = 0) -> None:
        prefix = namespace_prefix(ns)
        keys = [prefix + key_of(i + offset) for i in chain]
        run = leading_run(keys, ram.contains)
        counts[ns][0] += run
        counts[ns][1] += len(keys)
        for key in keys:
            if ram.contains(key):
                ram.get(key)
            else:
                ram.put(key, value)

    n = 0
    for chain in quiet:
        request(QUIET, chain)
        for _ in range(rate if noisy else 0):
            cycle, i = divmod(n, len(noisy))
            request(NOISY, noisy[i], cycle * span)
            n += 1
    hits, asked = counts[NOISY]
    return TenantResult(
        setup,
        label,
        blocks,
        counts[QUIET][0] / max(1, counts[QUIET][1]),
        hits / asked if asked else None,
    )


def tenant_table(results: Sequence[TenantResult]) -> str:
    lines = [f"{'setup':10}{'capacity':>10}{'quiet':>10}{'noisy':>10}"]
    for r in results:
        noisy = f"{r.noisy:.3f}" if r.noisy is not None else "-"
        lines.append(f"{r.setup:10}{r.capacity:>10}{r.quiet:>10.3f}{noisy:>10}")
    return "\n".join(lines)


class Routing(enum.Enum):
    """How a fleet's router places a request."""

    RANDOM = "random"
    ROUND_ROBIN = "round-robin"
    #: on the node whose cache holds the request's longest prefix (what KV
    #: events let a router know), within the load cap
    KV_AWARE = "kv-aware"


#: a kv-aware router passes over a node that would then hold more than this
#: many times the mean number of requests
LOAD_CAP = 1.25


@dataclass(slots=True, frozen=True)
class FleetResult:
    policy: str
    routing: Routing
    nodes: int
    #: whether a node loads blocks it lacks from their owner (and pushes its own there)
    peers: bool
    #: each node's capacity, as asked and in blocks
    capacity: str
    blocks: int
    hits: int
    requested: int
    #: requests placed on each node
    loads: tuple[int, ...]

    @property
    def ratio(self) -> float:
        return self.hits / self.requested if self.requested else 0.0

    @property
    def spread(self) -> float:
        """The busiest node's requests over the mean (1.0: perfectly even)."""
        mean = sum(self.loads) / len(self.loads)
        return max(self.loads) / mean if mean else 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "routing": self.routing.value,
            "nodes": self.nodes,
            "peers": self.peers,
            "capacity": self.capacity,
            "capacity_blocks_per_node": self.blocks,
            "prefix_hits": self.hits,
            "blocks_requested": self.requested,
            "prefix_hit_ratio": round(self.ratio, 6),
            "load_spread": round(self.spread, 4),
        }


def _kv_aware(tiers: Sequence[RamTier], keys: Sequence[bytes], loads: list[int]) -> int:
    """The node holding the longest prefix of ``keys`` (the least loaded on a
    tie) among those the request would not push past the load cap."""
    cap = LOAD_CAP * (sum(loads) + 1) / len(tiers)
    best, best_key = 0, (-1, 0)
    for i, tier in enumerate(tiers):
        if loads[i] + 1 > cap:
            continue
        rank = (leading_run(keys, tier.contains), -loads[i])
        if rank > best_key:
            best, best_key = i, rank
    if best_key[0] < 0:  # every node at the cap: the least loaded
        best = min(range(len(tiers)), key=loads.__getitem__)
    return best


def replay_fleet(
    chains: Sequence[Chain],
    policy: str,
    capacity: tuple[str, int],
    nodes: int,
    routing: Routing,
    *,
    peers: bool = False,
    block_size: int = 4096,
    seed: int = 0,
) -> FleetResult:
    """Replay ``chains`` through ``nodes`` RAM tiers of ``capacity`` blocks each,
    a router placing each request by ``routing``.

    With ``peers``, a block has an owner among the nodes (rendezvous hashing,
    as kvtier's peer tier picks one): a node that lacks a block reads it from
    its owner when the owner holds it (a hit, and the block is kept locally
    as well), and a block it had to compute is pushed to its owner.
    """
    label, blocks = capacity
    tiers = [RamTier(blocks * block_size, make_policy(policy)) for _ in range(nodes)]
    names = [b"node-%d" % i for i in range(nodes)]
    number = {name: i for i, name in enumerate(names)}
    rng = random.Random(seed)
    value = memoryview(bytes(block_size))
    loads = [0] * nodes
    hits = requested = 0
    for n, chain in enumerate(chains):
        keys = [key_of(i) for i in chain]
        if routing is Routing.RANDOM:
            at = rng.randrange(nodes)
        elif routing is Routing.ROUND_ROBIN:
            at = n % nodes
        else:
            at = _kv_aware(tiers, keys, loads)
        loads[at] += 1
        tier = tiers[at]
        owners = (
            [number[owner(key, names) or names[0]] for key in keys]
            if peers and nodes > 1
            else [at] * len(keys)
        )
        run = 0
        for key, o in zip(keys, owners, strict=True):
            if not (tier.contains(key) or tiers[o].contains(key)):
                break
            run += 1
        hits += run
        requested += len(keys)
        for key, o in zip(keys, owners, strict=True):
            if tier.contains(key):
                tier.get(key)
            elif tiers[o].contains(key):
                tiers[o].get(key)  # read from its owner
                tier.put(key, value)
            else:
                tier.put(key, value)
                if o != at:
                    tiers[o].put(key, value)  # pushed to its owner
    return FleetResult(policy, routing, nodes, peers, label, blocks, hits, requested, tuple(loads))


def fleet_table(results: Sequence[FleetResult]) -> str:
    """One row per fleet and routing: the prefix-hit ratio at each capacity,
    and the load spread."""
    capacities = list(dict.fromkeys(r.capacity for r in results))
    by = {(r.nodes, r.routing, r.peers, r.capacity): r for r in results}
    rows = list(dict.fromkeys((r.nodes, r.routing, r.peers) for r in results))
    head = f"{'nodes':>5}  {'routing':18}" + "".join(f"{c:>10}" for c in capacities)
    lines = [head + f"{'spread':>10}"]
    for nodes, routing, peers in rows:
        name = routing.value + (" +peers" if peers else "")
        cells = "".join(f"{by[(nodes, routing, peers, c)].ratio:>10.3f}" for c in capacities)
        spread = max(by[(nodes, routing, peers, c)].spread for c in capacities)
        lines.append(f"{nodes:>5}  {name:18}{cells}{spread:>10.2f}")
    return "\n".join(lines)


async def replay_daemon(
    chains: Sequence[Chain],
    socket: Path,
    *,
    block_size: int = 4096,
    tails: Sequence[bool] | None = None,
    progress: Progress | None = None,
) -> Result:
    """Replay ``chains`` against the daemon on ``socket`` (LOOKUP PREFIX, then
    PUT; ``tails``: the last block of a chain marked so carries the TAIL hint)."""
    from kvtier.client.aio import Client
    from kvtier.model import PutHint

    value = bytes(block_size)
    hits = requested = 0
    step = max(1, len(chains) // 100)
    async with await Client.connect(socket, timeout=60.0) as client:
        stats = await client.stats()
        ram = stats["tiers"]["ram"]
        blocks = int(ram["capacity_bytes"]) // block_size
        for n, chain in enumerate(chains):
            keys = [key_of(i) for i in chain]
            if not keys:
                continue
            reply = await client.lookup_prefix(keys)
            hits += reply.prefix_hits
            requested += len(keys)
            rest = keys[reply.prefix_hits :]
            if rest:
                hints = None
                if tails is not None and tails[n]:
                    hints = [PutHint.NONE] * (len(rest) - 1) + [PutHint.TAIL]
                await client.put_many(rest, [value] * len(rest), hints=hints)
            if progress is not None and n % step == 0:
                progress(n, len(chains))
    return Result("daemon", f"{blocks} blocks", blocks, hits, requested)


def progress_bar(label: str) -> Progress:
    """A one-line progress bar on stderr."""

    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(1, total)
        sys.stderr.write(f"\r{label:24} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
        sys.stderr.flush()

    return show


def infinite(chains: Sequence[Chain]) -> Result:
    """The prefix-hit ratio of a cache that never evicts: every other figure's ceiling."""
    seen: set[int] = set()
    hits = requested = 0
    for chain in chains:
        hits += leading_run(chain, seen.__contains__)
        requested += len(chain)
        seen.update(chain)
    return Result("infinite", "all", len(seen), hits, requested)


#: the rows others are compared with: LRU, with hints when the run has them
LRU_ROWS = ("lru", "lru+hints")


def compared(results: Sequence[Result], ceiling: Result) -> list[dict[str, Any]]:
    """Each result as a dict, with its ratio to LRU's at the same capacity
    (when LRU was replayed) and to the infinite cache's."""
    lru = {r.capacity: r.ratio for r in results if r.policy in LRU_ROWS}
    out: list[dict[str, Any]] = []
    for r in results:
        row = r.as_dict()
        base = lru.get(r.capacity)
        row["vs_lru"] = round(r.ratio / base, 4) if base else None
        row["vs_infinite"] = round(r.ratio / ceiling.ratio, 4) if ceiling.ratio else None
        out.append(row)
    return out


def table(results: Sequence[Result], ceiling: Result | None = None) -> str:
    """Policies as rows, capacities as columns; with the infinite cache's
    figure, each policy's ratio to LRU's and to it below."""
    capacities = list(dict.fromkeys(r.capacity for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    by = {(r.policy, r.capacity): r for r in results}

    def rows(cell: Callable[[Result], str]) -> list[str]:
        out = []
        for p in policies:
            cells = "".join(
                f"{cell(by[(p, c)]):>10}" if (p, c) in by else f"{'':>10}" for c in capacities
            )
            out.append(f"{p:10}{cells}")
        return out

    lines = [f"{'policy':10}" + "".join(f"{c:>10}" for c in capacities)]
    lines += rows(lambda r: f"{r.ratio:.3f}")
    if any(r.returning for r in results):
        lines.append("returning turns (a request whose first block an earlier one had)")
        lines += rows(lambda r: f"{r.returning_ratio:.3f}" if r.returning_ratio is not None else "")
    if ceiling is None:
        return "\n".join(lines)
    lines.append(f"{'infinite':10}" + f"{ceiling.ratio:>10.3f}" * len(capacities))
    lru = {c: by[(p, c)].ratio for p in LRU_ROWS for c in capacities if (p, c) in by}
    if lru:
        lines.append("ratio to lru")
        lines += rows(lambda r: f"{r.ratio / lru[r.capacity]:.3f}" if lru.get(r.capacity) else "")
    if ceiling.ratio:
        lines.append("share of the infinite cache's")
        lines += rows(lambda r: f"{r.ratio / ceiling.ratio:.3f}")
    return "\n".join(lines)


def plot(results: Sequence[Result], out: Path, title: str, ceiling: Result | None = None) -> None:
    """Prefix-hit ratio against capacity, one line per policy (and the
    infinite cache's ceiling)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: run `make bench-deps`") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in results):
        rows = sorted((r.blocks, r.ratio) for r in results if r.policy == policy)
        ax.plot([b for b, _ in rows], [h for _, h in rows], marker="o", label=policy)
    if ceiling is not None:
        ax.axhline(ceiling.ratio, color="grey", linestyle="--", label="infinite cache")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("prefix-hit ratio")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


__all__ = [
    "POLICIES",
    "FleetResult",
    "Result",
    "Routing",
    "compared",
    "fleet_table",
    "infinite",
    "load_trace",
    "parse_capacities",
    "plot",
    "progress_bar",
    "replay",
    "replay_daemon",
    "replay_fleet",
    "table",
    "unique_blocks",
]
