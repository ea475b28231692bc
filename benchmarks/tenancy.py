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
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

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
            rows = asyncio.run(measure(str(off.socket_path), str(on.socket_path)))
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
