"""make bench: what namespaces cost (docs/tenancy.md).

Two RAM-only daemons side by side in the same run: one with no namespaces
configured, its client in the default namespace ("off"), and one with
``[namespaces]`` quotas (the tiers then account and evict per namespace),
its client naming a namespace at HELLO, so every key carries the
namespace's prefix on the wire and in every tier ("on"). Against each in
turn, six times (off, on, on, off, ...: drift on this noisy machine falls
on both): a prefix LOOKUP of a 512-block chain (ops/s), and 1 MiB PUT and
GET from one client (GB/s), as ``kvtier bench`` measures them. Prints each
turn's figures and the median ratio of on to off.

Then a named namespace's lookups while blocks stream in: a full RAM-only
daemon of 512 MiB, a 512-block chain of the namespace's, and its prefix
LOOKUP's p99, idle and while 8 writers of another process stream 1 MiB
blocks in place (as ``benchmarks.streaming``), through the lookup process
(the client's default) and through the daemon's socket, in turn, three
rounds: each round's idle and busy p99 and their ratio.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks import streaming
from kvtier import loops
from kvtier.bench import KvtierStore, MiB, block_key, ops_for, prefix_lookup, put_get
from kvtier.client.aio import Client
from tests.enginedaemon import start

QUOTAS = """\
[namespaces.bench]
ram_min = "256MiB"
weight = 2.0
[namespaces.others]
ram_max = "128MiB"
"""


async def turn(client: Client) -> dict[str, float]:
    lookup = await prefix_lookup(client, runs=3)
    put, get = await put_get(KvtierStore([client]), MiB, 1, runs=3)
    await client.delete_many([block_key(i) for i in range(ops_for(MiB, False))])
    return {"lookup": lookup.rate, "put": put.rate, "get": get.rate}


async def measure(off: str, on: str) -> list[tuple[bool, dict[str, float]]]:
    clients = {
        False: await Client.connect(off),
        True: await Client.connect(on, namespace="bench"),
    }
    try:
        return [(o, await turn(clients[o])) for o in (False, True, True, False) * 3]
    finally:
        for c in clients.values():
            await c.close()


#: rounds of the streaming part (each: both lookup paths, idle and busy)
STREAM_ROUNDS = 3


async def while_streaming(sock: str) -> dict[bool, list[tuple[float, float]]]:
    """Per lookup path (through the lookup process or not), each round's
    idle and busy p99 (µs) of a named namespace's prefix LOOKUP."""
    chain = await streaming.fill(sock, namespace="bench")
    rounds: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(STREAM_ROUNDS):
        for lookup_process, out in rounds.items():
            async with await Client.connect(
                sock, namespace="bench", lookup_process=lookup_process
            ) as client:
                assert client.lookups_process == lookup_process
                idle = await streaming.idle_lookups(client, chain)
                busy, _, _ = await streaming.under_writers(sock, client, chain, "in-place")
                out.append((streaming.percentiles(idle)[1], streaming.percentiles(busy)[1]))
    return rounds


def main() -> int:
    args = ["--no-disk", "--ram-capacity", "1GiB"]
    with (
        tempfile.TemporaryDirectory(prefix="kvt-ns-", dir="/tmp") as a,
        tempfile.TemporaryDirectory(prefix="kvt-ns-", dir="/tmp") as b,
    ):
        (Path(b) / "kvtier.toml").write_text(QUOTAS)
        off = start(Path(a), *args)
        on = start(Path(b), *args, "--config", str(Path(b) / "kvtier.toml"))
        try:
            rows = loops.run(measure(str(off.socket_path), str(on.socket_path)))
        finally:
            off.stop()
            on.stop()
    print("namespaces   prefix LOOKUP 512 ops/s   1 MiB PUT GB/s   1 MiB GET GB/s")
    for o, f in rows:
        print(
            f"{'on ' if o else 'off'}          {f['lookup']:>23,.0f}   {f['put']:>14.2f}"
            f"   {f['get']:>14.2f}"
        )
    for name in ("lookup", "put", "get"):
        ratio = statistics.median(f[name] for o, f in rows if o) / statistics.median(
            f[name] for o, f in rows if not o
        )
        print(f"{name}: on / off {ratio:.3f}x")
    with tempfile.TemporaryDirectory(prefix="kvt-ns-", dir="/tmp") as c:
        daemon = start(Path(c), "--no-disk", "--ram-capacity", str(streaming.RAM))
        try:
            paths = loops.run(while_streaming(str(daemon.socket_path)))
        finally:
            daemon.stop()
    print("named namespace, prefix LOOKUP 512 p99 us   idle    busy   busy/idle   (per round)")
    for lookup_process, measured in paths.items():
        path = "lookup process" if lookup_process else "daemon socket"
        for idle_p99, busy_p99 in measured:
            print(f"{path:40s} {idle_p99:7.0f} {busy_p99:7.0f} {busy_p99 / idle_p99:8.2f}x")
        ratio = statistics.median(b / i for i, b in measured)
        print(f"{path}: busy / idle p99, median {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
