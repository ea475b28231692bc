"""Hedged reads end to end through the vLLM tier: three real daemons share
blocks as peers (two owners a block); the owner the engine's daemon asks
first hangs after saying it holds the block, and the engine's load still
lands, from the next owner, past ``hedge_after``."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

from kvtier import BlockingClient, State
from kvtier.tiers.rendezvous import ranked
from tests.enginedaemon import EngineDaemon, start
from tests.ports import free_port
from tests.vllm.test_manager import BLOCK, engine, load, load_until_hit

TOKEN = "vllm-hedge-token"


@pytest.fixture
def fleet(workdir: Path) -> Iterator[tuple[list[EngineDaemon], list[str]]]:
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    members = ", ".join(f'"{a}"' for a in addresses)
    daemons: list[EngineDaemon] = []
    try:
        for i, address in enumerate(addresses):
            home = workdir / "abc"[i]
            home.mkdir()
            config = home / "kvtier.toml"
            config.write_text(
                f'[peer]\nlisten = "{address}"\nmembers = [{members}]\ntoken = "{TOKEN}"\n'
                "replicas = 2\nrequest_timeout = 5.0\nhedge_after = 0.05\n"
                'hedge_max_ratio = 1.0\n[lookup]\nremote_hit = "hit"\nverdict_ttl = 60.0\n'
            )
            daemons.append(start(home, "--config", str(config), "--ram-capacity", "64MiB"))
        yield daemons, addresses
    finally:
        for d in daemons:
            d.proc.send_signal(signal.SIGCONT)
            d.stop()


def test_a_load_through_the_vllm_tier_is_hedged_past_a_hung_owner(
    fleet: tuple[list[EngineDaemon], list[str]],
) -> None:
    (a, b, c), addresses = fleet
    names = [x.encode() for x in addresses]
    key = next(
        k
        for n in range(100_000)
        if ranked(bytes(k := make_offload_key(b"hedged%d" % n, 0)), names)[:2] == names[1:]
    )  # owned by B, then C
    with BlockingClient(b.socket_path) as cb:
        cb.put(bytes(key), bytes([77]) * BLOCK)  # kept by B, pushed to C
    deadline = time.monotonic() + 30
    with BlockingClient(c.socket_path) as cc:  # the push has landed at C
        while cc.stats()["tiers"]["ram"]["blocks"] != 1:
            assert time.monotonic() < deadline, "the push never reached C"
    c.proc.send_signal(signal.SIGSTOP)  # B alone answers A's probe: A asks B first
    try:
        with BlockingClient(a.socket_path) as ca:
            assert ca.lookup([bytes(key)], wait=5.0).states == [State.HIT]
    finally:
        c.proc.send_signal(signal.SIGCONT)
    b.proc.send_signal(signal.SIGSTOP)  # ...and B hangs before the engine loads
    manager, rows = engine(a)
    try:
        reader = ReqContext("reader")
        manager.on_new_request(reader)
        assert load_until_hit(manager, reader, key)[-1] is LookupResult.HIT
        load(manager, rows, reader, key, 77)  # the bytes C delivered
        manager.on_request_finished(reader)
    finally:
        manager.shutdown()
        b.proc.send_signal(signal.SIGCONT)
    assert a.total("kvtier_hedged_reads_total", tier="peers", outcome="won") == 1
    assert a.total("kvtier_hedged_reads_total", tier="peers", outcome="lost") == 0
