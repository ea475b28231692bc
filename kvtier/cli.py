"""The ``kvtier`` command line.

The top of the house: imports the client, the config and (for ``serve``) the
daemon; nothing imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier import loops
from kvtier._version import __version__
from kvtier.client import Client
from kvtier.defaults import DEFAULT_TIMEOUT
from kvtier.errors import ConfigError, KvtierError
from kvtier.model import LookupMode, Retention, State
from kvtier.tiers.policy import POLICIES

if TYPE_CHECKING:
    from kvtier.config import Config

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_MISS = 0, 1, 2, 3

T = TypeVar("T")


def _hex_key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a hex key") from None
    if not key:
        raise argparse.ArgumentTypeError("a key needs at least one byte")
    return key


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, dict[str, Any]] = {}

    def put(section: str, key: str, value: Any) -> None:
        if value is not None:
            out.setdefault(section, {})[key] = value

    put("server", "socket_path", getattr(args, "socket", None))
    put("metrics", "port", getattr(args, "metrics_port", None))
    put("metrics", "host", getattr(args, "metrics_host", None))
    put("ram", "capacity", getattr(args, "ram_capacity", None))
    put("disk", "path", getattr(args, "data_dir", None))
    put("disk", "capacity", getattr(args, "disk_capacity", None))
    if getattr(args, "no_disk", False):
        put("disk", "enabled", False)
    put("log", "level", getattr(args, "log_level", None))
    return out


def _config(args: argparse.Namespace) -> Config:
    # (pydantic is imported by the commands that read a config file only: a
    # put, get or ping given its --socket starts in half the time)
    from kvtier.config import load_config

    return load_config(getattr(args, "config", None), _overrides(args))


def _socket(args: argparse.Namespace) -> Path:
    if args.socket is not None:
        return Path(args.socket)
    return _config(args).server.socket_path


def _run_client(args: argparse.Namespace, fn: Callable[[Client], Coroutine[Any, Any, int]]) -> int:
    async def main() -> int:
        async with await Client.connect(_socket(args), timeout=args.timeout) as client:
            return await fn(client)

    return loops.run(main())


# -- commands


def cmd_serve(args: argparse.Namespace) -> int:
    config = _config(args)
    logging.basicConfig(
        level=config.log.level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from kvtier.daemon import run

    run(config, lambda: _config(args))
    return EXIT_OK


def cmd_ping(args: argparse.Namespace) -> int:
    async def go(client: Client) -> int:
        started = time.perf_counter()
        await client.ping()
        elapsed = (time.perf_counter() - started) * 1e3
        name = client.server.server_name if client.server else "?"
        print(f"pong from {name} at {client.path} in {elapsed:.3f} ms")
        return EXIT_OK

    return _run_client(args, go)


def _table(stats: dict[str, Any]) -> str:
    rows: list[tuple[str, str]] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for key in sorted(node):
                walk(f"{prefix}.{key}" if prefix else key, node[key])
        elif prefix.endswith("bytes") and isinstance(node, int):
            rows.append((prefix, _human_bytes(node)))
        else:
            rows.append((prefix, str(node)))

    walk("", stats)
    width = max((len(k) for k, _ in rows), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024
        if value < 1024 or unit == "PiB":
            return f"{value:.1f} {unit} ({n})"
    raise AssertionError("unreachable")


def cmd_stats(args: argparse.Namespace) -> int:
    async def go(client: Client) -> int:
        stats = await client.stats()
        if args.namespace is not None:
            rows = stats.get("namespaces", {})
            if args.namespace:
                if args.namespace not in rows:
                    print(f"kvtier: no namespace {args.namespace!r} here", file=sys.stderr)
                    return EXIT_MISS
                rows = {args.namespace: rows[args.namespace]}
            print(json.dumps(rows, indent=2, sort_keys=True) if args.json else _namespaces(rows))
            return EXIT_OK
        print(json.dumps(stats, indent=2, sort_keys=True) if args.json else _table(stats))
        return EXIT_OK

    return _run_client(args, go)


def _namespaces(rows: dict[str, dict[str, Any]]) -> str:
    """One line per namespace: what it holds, its quota, how its lookups go."""
    head = ("namespace", "ram", "blocks", "disk", "ram_min", "ram_max", "hits", "misses", "hit%")
    lines = [head]
    for name, n in rows.items():
        asked = n["hits"] + n["misses"]
        lines.append(
            (
                name,
                _short_bytes(n["bytes"]),
                str(n["blocks"]),
                _short_bytes(n["disk_bytes"]),
                _short_bytes(n["ram_min"]),
                _short_bytes(n["ram_max"]) if n["ram_max"] is not None else "-",
                str(n["hits"]),
                str(n["misses"]),
                f"{100 * n['hits'] / asked:.1f}" if asked else "-",
            )
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in lines
    )


def _short_bytes(n: int) -> str:
    return _human_bytes(n).split(" (")[0].replace(" ", "")


def cmd_put(args: argparse.Namespace) -> int:
    data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()

    async def go(client: Client) -> int:
        status = await client.put(args.key, data, durable=args.durable)
        print(f"{status.name.lower()} {args.key.hex()} ({len(data)} bytes)")
        return EXIT_OK

    return _run_client(args, go)


def cmd_get(args: argparse.Namespace) -> int:
    async def go(client: Client) -> int:
        value = await client.get(args.key)
        if value is None:
            print(f"kvtier: {args.key.hex()}: not found", file=sys.stderr)
            return EXIT_MISS
        out.append(bytes(value))
        return EXIT_OK

    out: list[bytes] = []
    code = _run_client(args, go)
    if out:
        if args.output:
            Path(args.output).write_bytes(out[0])
        else:
            sys.stdout.buffer.write(out[0])
            sys.stdout.buffer.flush()
    return code


def cmd_lookup(args: argparse.Namespace) -> int:
    mode = LookupMode.KEYS
    if args.window:
        mode = LookupMode.SLIDING_WINDOW
    elif args.prefix:
        mode = LookupMode.PREFIX

    async def go(client: Client) -> int:
        reply = await client.lookup(args.keys, mode=mode, window=args.window or 0, wait=args.wait)
        for key, state in zip(args.keys, reply.raw_states, strict=True):
            print(f"{key.hex()}  {State(state).name}")
        if mode != LookupMode.KEYS:
            print(f"prefix hits: {reply.prefix_hits}  defer: {'yes' if reply.defer else 'no'}")
        return EXIT_OK

    return _run_client(args, go)


def cmd_bench(args: argparse.Namespace) -> int:
    from kvtier.bench import BLOCK_SIZES, format_table, run_against_daemon

    figures = loops.run(run_against_daemon(str(_socket(args)), quick=args.quick, sizes=BLOCK_SIZES))
    print(format_table(figures))
    if args.json:
        Path(args.json).write_text(json.dumps([f.as_dict() for f in figures], indent=2))
    return EXIT_OK


def _replay_fleet(args: argparse.Namespace, chains: list[list[int]], unique: int) -> int:
    """``kvtier replay --nodes``: a fleet of caches behind a router."""
    from kvtier import replay as rp

    try:
        counts = [int(n) for n in args.nodes.split(",") if n.strip()]
    except ValueError:
        raise ConfigError(f"--nodes {args.nodes!r}: expected node counts, e.g. 1,4,16") from None
    if not counts or min(counts) < 1:
        raise ConfigError("--nodes needs node counts of at least 1")
    routings = [rp.Routing(r) for r in dict.fromkeys(args.routing or [r.value for r in rp.Routing])]
    capacities = rp.parse_capacities(args.capacity, unique)
    policy = (args.policy or ["harc"])[0]
    if policy == "all":
        raise ConfigError("--nodes replays one policy at a time")
    results = [
        rp.replay_fleet(chains, policy, capacity, n, routing, peers=args.peers)
        for n in counts
        for routing in routings
        for capacity in capacities
    ]
    if args.json:
        doc = {"trace": args.trace, "unique_blocks": unique, "policy": policy}
        print(json.dumps({**doc, "fleets": [r.as_dict() for r in results]}, indent=2))
    else:
        print(
            f"{args.trace}: {len(chains)} requests, {unique} unique blocks; fleet prefix-hit "
            f"ratio ({policy}, capacity per node{', peers' if args.peers else ''})"
        )
        print(rp.fleet_table(results))
    return EXIT_OK


def _percent(text: str | None) -> float | None:
    """``"50%"`` as 0.5."""
    if text is None:
        return None
    try:
        value = float(text.removesuffix("%")) / 100
    except ValueError:
        value = -1.0
    if not text.endswith("%") or not 0 <= value <= 1:
        raise ConfigError(f"{text!r}: expected a percentage of the capacity, e.g. 50%")
    return value


def _replay_tenants(args: argparse.Namespace, chains: list[list[int]], unique: int) -> int:
    """``kvtier replay --noisy``: two workloads as two namespaces of one tier."""
    from kvtier import replay as rp
    from kvtier.tiers.shares import Quota

    noisy = rp.load_trace(Path(args.noisy))
    policy = (args.policy or ["harc"])[0]
    if policy == "all":
        raise ConfigError("--noisy replays one policy at a time")
    ram_min, noisy_max = _percent(args.ram_min), _percent(args.noisy_max)
    results = []
    for label, blocks in rp.parse_capacities(args.capacity, unique):
        total = blocks * args.block_size
        quotas = {
            rp.QUIET: Quota(min=round(total * (ram_min or 0.0))),
            rp.NOISY: Quota(max=None if noisy_max is None else round(total * noisy_max)),
        }
        setups: list[tuple[str, tuple[str, int], int, dict[bytes, Quota] | None]] = [
            ("alone", (label, blocks), 0, None),
            ("shared", (label, blocks), args.noisy_rate, None),
            ("quotas", (label, blocks), args.noisy_rate, quotas),
        ]
        if ram_min:  # the guarantee: the quiet one alone in a tier of its ram_min
            setups.insert(1, ("floor", (label, max(1, round(blocks * ram_min))), 0, None))
        results += [
            rp.replay_tenants(
                chains,
                noisy,
                policy,
                capacity,
                rate=rate,
                quotas=q,
                setup=setup,
                block_size=args.block_size,
            )
            for setup, capacity, rate, q in setups
        ]
    if args.json:
        doc = {"trace": args.trace, "noisy": args.noisy, "noisy_rate": args.noisy_rate}
        print(json.dumps({**doc, "results": [r.as_dict() for r in results]}, indent=2))
    else:
        print(
            f"{args.trace} (quiet) with {args.noisy} (noisy, {args.noisy_rate} requests per quiet "
            f"one), {policy}; quotas: quiet ram_min {args.ram_min or 0}, noisy ram_max "
            f"{args.noisy_max or 'none'}; prefix-hit ratio of each"
        )
        print(rp.tenant_table(results))
    return EXIT_OK


def _replay_ttft(
    args: argparse.Namespace,
    chains: list[list[int]],
    unique: int,
    prompt: float,
    retentions: list[Retention] | None,
    times: list[float] | None,
) -> int:
    """``kvtier replay --tier-cost``: modelled time to first token, with
    yes/no answers and with budgeted ones (agent sessions' leases with
    ``--hints``)."""
    from kvtier import replay as rp

    if args.nodes or args.socket or args.noisy or (args.hints and retentions is None):
        raise ConfigError("--tier-cost models one offline cache")
    if args.recompute_tokens_per_second <= 0 or args.block_tokens <= 0:
        raise ConfigError("--tier-cost needs --recompute-tokens-per-second and --block-tokens > 0")
    costs = rp.parse_tier_costs(args.tier_cost)
    per_block = args.block_tokens / args.recompute_tokens_per_second
    policies = args.policy or ["harc"]
    if "all" in policies:
        policies = list(rp.POLICIES)
    lower = None
    if args.lower_capacity:
        ((_, lower),) = rp.parse_capacities(args.lower_capacity, unique, prompt)
    results = [
        rp.replay_ttft(
            chains,
            policy,
            capacity,
            costs,
            block_bytes=args.block_bytes,
            recompute_seconds_per_block=per_block,
            retentions=retentions,
            times=times,
            lower_blocks=lower,
        )
        for policy in dict.fromkeys(policies)
        for capacity in rp.parse_capacities(args.capacity, unique, prompt)
    ]
    if args.json:
        print(json.dumps({"trace": args.trace, "results": [r.as_dict() for r in results]}))
    else:
        print(
            f"{args.trace}: {len(chains)} requests; modelled time to first token, "
            f"{per_block * 1e3:.2f} ms to recompute a block of {args.block_bytes} bytes"
        )
        print(rp.ttft_table(results))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from kvtier import agentic
    from kvtier import replay as rp

    trace = Path(args.trace)
    retentions = times = None
    prompt = 0.0
    if trace.is_dir() or trace.name.endswith((".tar.gz", ".tgz", ".tar")):
        turns = agentic.load(trace, args.concurrency, args.seed)
        chains = [t.chain for t in turns]
        prompt = agentic.busy_prompt(turns)
        if args.hints:  # the leases an engine would send (kvtier/agentic.py)
            retentions = agentic.retention_hints(turns)
            times = [t.at for t in turns]
        del turns
    else:
        chains = rp.load_trace(trace)
    unique = rp.unique_blocks(chains)
    if args.noisy:
        if args.nodes or args.socket or args.hints:
            raise ConfigError("--noisy replays two namespaces of one offline tier")
        return _replay_tenants(args, chains, unique)
    if args.nodes:
        if args.hints:
            raise ConfigError("--hints replays one cache; fleets replay without hints")
        return _replay_fleet(args, chains, unique)
    if args.tier_cost:
        return _replay_ttft(args, chains, unique, prompt, retentions, times)
    if args.socket and retentions is not None:
        raise ConfigError("--hints with agent sessions replays offline: drop --socket")
    tails = rp.tail_hints(Path(args.trace)) if args.hints and retentions is None else None
    show = sys.stderr.isatty() and not args.json
    results: list[rp.Result] = []
    if args.socket:
        bar = rp.progress_bar("daemon") if show else None
        daemon = loops.run(
            rp.replay_daemon(
                chains, Path(args.socket), block_size=args.block_size, tails=tails, progress=bar
            )
        )
        results.append(daemon)
        capacities = [(f"{daemon.blocks} blocks", daemon.blocks)]
    else:
        capacities = rp.parse_capacities(args.capacity, unique, prompt)
    policies = args.policy or ["lru", "harc"]
    if "all" in policies:
        policies = list(rp.POLICIES)
    ceiling = rp.infinite(chains)
    for policy in dict.fromkeys(policies):
        for capacity in capacities:
            bar = rp.progress_bar(f"{policy} {capacity[0]}") if show else None
            results.append(
                rp.replay(
                    chains,
                    policy,
                    capacity,
                    block_size=args.block_size,
                    tails=tails,
                    retentions=retentions,
                    times=times,
                    progress=bar,
                )
            )
    if args.optimum:  # the references: a chain-blind LRU, and Belady's optimum
        for capacity in capacities:
            results.append(rp.plain_lru(chains, capacity))
            results.append(rp.belady(chains, capacity))
    if show:
        sys.stderr.write("\r" + " " * 70 + "\r")
    if args.json:
        print(
            json.dumps(
                {
                    "trace": args.trace,
                    "unique_blocks": unique,
                    "infinite_prefix_hit_ratio": round(ceiling.ratio, 6),
                    "results": rp.compared(results, ceiling),
                },
                indent=2,
            )
        )
    else:
        print(f"{args.trace}: {len(chains)} requests, {unique} unique blocks; prefix-hit ratio")
        print(rp.table(results, ceiling))
    if args.plot:
        rp.plot(results, Path(args.plot), Path(args.trace).name, ceiling)
    return EXIT_OK


def cmd_config_check(args: argparse.Namespace) -> int:
    from kvtier.config import load_config, render_toml

    config = load_config(args.path or getattr(args, "config", None))
    sys.stdout.write(render_toml(config))
    print(f"# ram capacity in effect: {config.ram.capacity_bytes()} bytes", file=sys.stderr)
    return EXIT_OK


def cmd_disk_check(args: argparse.Namespace) -> int:
    from kvtier.tiers.disk.check import check_data_dir

    root = Path(args.data_dir)
    if not root.is_dir():
        print(f"kvtier: {root} is not a directory", file=sys.stderr)
        return EXIT_USAGE
    report = check_data_dir(root)
    print("\n".join(report.lines()))
    return EXIT_OK if report.ok else EXIT_ERROR


def cmd_config_reference(args: argparse.Namespace) -> int:
    from kvtier.configdoc import render

    sys.stdout.write(render())
    return EXIT_OK


# -- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="Tiered KV-cache block sidecar.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(p: argparse.ArgumentParser, client: bool = True) -> None:
        p.add_argument("--socket", help="daemon socket path (default: from config)")
        p.add_argument("--config", help="TOML config file (default: $KVTIER_CONFIG)")
        if client:
            p.add_argument(
                "--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per request"
            )

    p = sub.add_parser("serve", help="run the daemon")
    common(p, client=False)
    p.add_argument("--metrics-host")
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--ram-capacity", help="bytes or a size such as 8GiB; 'auto' by default")
    p.add_argument("--data-dir", help="disk tier directory (default: ~/.cache/kvtier)")
    p.add_argument("--disk-capacity", help="bytes or a size such as 100GiB; 'auto' by default")
    p.add_argument("--no-disk", action="store_true", help="serve from RAM only")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("ping", help="check that the daemon answers")
    common(p)
    p.set_defaults(func=cmd_ping)

    p = sub.add_parser("stats", help="show daemon statistics")
    common(p)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument(
        "--namespace",
        nargs="?",
        const="",
        metavar="NAME",
        help="one line per namespace (or NAME's only): what it holds, its quota, its hit ratio",
    )
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("put", help="store FILE (or - for stdin) under a hex KEY")
    common(p)
    p.add_argument("key", type=_hex_key, metavar="KEY")
    p.add_argument("file", metavar="FILE")
    p.add_argument("--durable", action="store_true", help="acknowledge once durable")
    p.set_defaults(func=cmd_put)

    p = sub.add_parser("get", help="print the block under a hex KEY")
    common(p)
    p.add_argument("key", type=_hex_key, metavar="KEY")
    p.add_argument("-o", "--output", help="write to this file instead of stdout")
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("lookup", help="per-key states of hex KEYs")
    common(p)
    p.add_argument("keys", type=_hex_key, nargs="+", metavar="KEY")
    p.add_argument("--prefix", action="store_true", help="report the leading hit count")
    p.add_argument("--window", type=int, default=0, help="sliding-window size")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for keys to settle")
    p.set_defaults(func=cmd_lookup)

    p = sub.add_parser("bench", help="benchmark a running daemon (make bench compares)")
    common(p)
    p.add_argument("--quick", action="store_true", help="fewer, shorter runs")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser(
        "replay", help="replay a request trace through the eviction policies (hit ratio)"
    )
    p.add_argument(
        "trace",
        metavar="TRACE",
        help="JSON lines with hash_ids (Mooncake format), or agent sessions: a folder or "
        "tarball of one JSON file per session (the agentic trace format)",
    )
    p.add_argument(
        "--concurrency",
        type=float,
        default=16.0,
        help="agent sessions: how many are in progress at once on average (arrivals are "
        "a seeded Poisson process)",
    )
    p.add_argument("--seed", type=int, default=1, help="agent sessions: the arrival order's seed")
    p.add_argument(
        "--capacity",
        default="5%,10%,20%",
        help="comma-separated capacities: percent of the unique blocks, block counts, or "
        "(agent sessions) busy prompts such as 3p",
    )
    p.add_argument(
        "--policy",
        action="append",
        choices=[*POLICIES, "all"],
        help="policy to replay (repeatable, or all; default: lru and harc)",
    )
    p.add_argument("--block-size", type=int, default=4096, help="bytes per block")
    p.add_argument(
        "--hints",
        action="store_true",
        help="JSON lines: put each request's partial last block (from input_length) with the "
        "TAIL hint; agent sessions: send the retention lease an engine would (docs/retention.md)",
    )
    p.add_argument(
        "--optimum",
        action="store_true",
        help="add the references: LRU as a chain-blind cache orders blocks (plain-lru) and "
        "Belady's optimum",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="PNG", help="draw hit ratio against capacity")
    p.add_argument(
        "--nodes",
        metavar="N,N",
        help="simulate fleets of this many nodes (comma-separated), each with a cache "
        "of --capacity, behind a router",
    )
    p.add_argument(
        "--routing",
        action="append",
        choices=["random", "round-robin", "kv-aware"],
        help="how the router places requests (repeatable; default: all three)",
    )
    p.add_argument(
        "--peers",
        action="store_true",
        help="with --nodes: nodes load missing blocks from their owner (rendezvous hashing)",
    )
    p.add_argument(
        "--socket",
        help="replay against the daemon on this socket too (LOOKUP PREFIX + PUT), and "
        "offline at the daemon's RAM capacity",
    )
    p.add_argument(
        "--noisy",
        metavar="TRACE",
        help="replay this trace too, as a second namespace sharing the tier (docs/tenancy.md): "
        "each namespace's hit ratio alone, shared, and with quotas",
    )
    p.add_argument(
        "--noisy-rate", type=int, default=10, help="noisy requests per quiet one (default 10)"
    )
    p.add_argument(
        "--tier-cost",
        metavar="COSTS",
        help="model time to first token: RAM and the tier below it (holding every block "
        "written), each NAME=LATENCY/RATE, e.g. ram=20us/5GB,s3=30ms/200MB; with "
        "--recompute-tokens-per-second: yes/no answers against budgeted ones",
    )
    p.add_argument(
        "--lower-capacity",
        metavar="CAPACITY",
        help="with --tier-cost: the tier below RAM holds this much (as --capacity), written "
        "through, instead of every block",
    )
    p.add_argument(
        "--recompute-tokens-per-second",
        type=float,
        default=0.0,
        help="with --tier-cost: the engine's prefill rate",
    )
    p.add_argument("--block-tokens", type=int, default=16, help="with --tier-cost: tokens a block")
    p.add_argument(
        "--block-bytes",
        type=int,
        default=2 << 20,
        help="with --tier-cost: a block's KV bytes (default 2 MiB)",
    )
    p.add_argument("--ram-min", metavar="PCT", help="the quiet namespace's ram_min, e.g. 50%%")
    p.add_argument("--noisy-max", metavar="PCT", help="the noisy namespace's ram_max, e.g. 40%%")
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("config", help="configuration tools")
    csub = p.add_subparsers(dest="config_command", required=True, metavar="SUBCOMMAND")
    c = csub.add_parser("check", help="print the effective config or the error")
    c.add_argument("path", nargs="?", help="TOML file (default: --config or $KVTIER_CONFIG)")
    c.set_defaults(func=cmd_config_check)
    r = csub.add_parser("reference", help="print the configuration reference (Markdown)")
    r.set_defaults(func=cmd_config_reference)

    p = sub.add_parser("disk", help="disk tier tools")
    dsub = p.add_subparsers(dest="disk_command", required=True, metavar="SUBCOMMAND")
    d = dsub.add_parser(
        "check",
        help="verify a data directory offline: its index files against its block files, "
        "and every block's checksum (exit 1 if anything is wrong)",
    )
    d.add_argument("data_dir", metavar="DATA_DIR", help="the disk tier's directory (disk.path)")
    d.set_defaults(func=cmd_disk_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KvtierError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except OSError as exc:
        print(f"kvtier: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
