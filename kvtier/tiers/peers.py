"""Who the peers are and which one owns a key: a picker, and its null object.

:class:`PeerPicker` is the interface the peer tier asks (groupcache's
``PeerPicker`` shape): ``owners(key, count)`` names the live peers among the
``count`` live nodes that own ``key`` (its replicas), in rank order, this
daemon excluded. :class:`NoPeers` always answers none.

:class:`RendezvousPicker` holds the member addresses (a static list, or
what a DNS name resolves to, refreshed by :meth:`RendezvousPicker.resolve`)
and this daemon's own address when known. Every daemon ranks the same
names the same way (:mod:`kvtier.tiers.rendezvous`), so they agree on each
key's owners without talking. A peer that is down (its breaker open) is
skipped: its keys go to the next name in their ranking.

Invariants: this daemon's own address is never a peer to dial; it stays in
the ranking, so keys it owns are not asked of anyone; a member list change
keeps the peers (and their connections) of addresses still listed.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar

from kvtier.tiers import rendezvous


class Node(Protocol):
    """What the picker needs of a peer."""

    address: str

    def is_down(self) -> bool: ...


N = TypeVar("N", bound=Node)


class PeerPicker(Protocol[N]):
    def owners(self, key: bytes, count: int) -> list[N]:
        """The live peers among the first ``count`` live nodes of ``key``'s
        ranking, in rank order; this daemon fills its place and is left out."""
        ...

    def peers(self) -> list[N]:
        """Every peer this daemon may dial (itself excluded)."""
        ...

    async def resolve(self) -> list[N]:
        """Refresh the member list; returns the peers dropped."""
        ...


class NoPeers(Generic[N]):
    """The picker of a daemon without peers: every key is its own."""

    def __repr__(self) -> str:
        return "<NoPeers>"

    def owners(self, key: bytes, count: int) -> list[N]:
        return []

    def peers(self) -> list[N]:
        return []

    async def resolve(self) -> list[N]:
        return []


class RendezvousPicker(Generic[N]):
    def __init__(
        self,
        make_peer: Callable[[str], N],
        *,
        members: Iterable[str] = (),
        dns: str | None = None,
        self_address: str | None = None,
    ) -> None:
        self._make_peer = make_peer
        #: "name:port" resolved into members by resolve(); None: members are static
        self.dns = dns
        #: this daemon's own address, when the config or a HELLO has told it
        self.self_address = self_address
        #: dialable peers by address (never self)
        self._peers: dict[str, N] = {}
        #: every ranked name: the peers and, when known, self
        self._names: list[bytes] = []
        self.set_members(members)

    def __repr__(self) -> str:
        down = sum(p.is_down() for p in self._peers.values())
        return (
            f"<RendezvousPicker peers={len(self._peers)} down={down} "
            f"self={self.self_address or '?'}>"
        )

    def set_members(self, addresses: Iterable[str]) -> list[N]:
        """Make ``addresses`` the member list; returns the peers dropped (to close)."""
        wanted = {a for a in addresses if a != self.self_address}
        dropped = [p for a, p in self._peers.items() if a not in wanted]
        self._peers = {a: self._peers.get(a) or self._make_peer(a) for a in sorted(wanted)}
        self._rank()
        return dropped

    def is_self(self, address: str) -> N | None:
        """``address`` turned out to be this daemon (its HELLO had our node id):
        rank it as self from now on; returns its peer object (to close)."""
        self.self_address = address
        peer = self._peers.pop(address, None)
        self._rank()
        return peer

    def _rank(self) -> None:
        names = set(self._peers)
        if self.self_address is not None:
            names.add(self.self_address)
        self._names = sorted(n.encode() for n in names)

    def owners(self, key: bytes, count: int) -> list[N]:
        own = self.self_address.encode() if self.self_address is not None else None
        out: list[N] = []
        live = 0
        for name in rendezvous.ranked(key, self._names):
            if live == count:
                break
            if name == own:
                live += 1
                continue
            peer = self._peers[name.decode()]
            if not peer.is_down():
                out.append(peer)
                live += 1
        return out

    def peers(self) -> list[N]:
        return list(self._peers.values())

    async def resolve(self) -> list[N]:
        """Re-read the DNS name's addresses; returns the peers dropped (to close).

        A failed lookup keeps the current members (DNS blips are common)."""
        if self.dns is None:
            return []
        host, _, port = self.dns.rpartition(":")
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        addresses = set()
        for family, _, _, _, sockaddr in infos:
            ip = str(sockaddr[0])
            addresses.add(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
        return self.set_members(addresses)
