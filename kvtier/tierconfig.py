"""The configuration of the remote tiers: S3 (and the in-memory stand-in) and the peers.

Sections of :class:`kvtier.config.Config`, in a module of their own; the
peers' TLS contexts are built here from the paths they name.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, SecretStr, model_validator

from kvtier.configtypes import ByteCount, Section
from kvtier.errors import ConfigError
from kvtier.sizes import MiB

WritePolicy = Literal["write-through", "write-back", "none"]
#: a remote tier's compression of the blocks it sends
Codec = Literal["none", "zstd"]


class MemoryTierConfig(Section):
    """An in-memory remote tier, for demos and tests of the probe path."""

    kind: Literal["memory"] = "memory"
    name: str = "memory"
    write_policy: WritePolicy = "none"
    max_pending_write_bytes: ByteCount = Field(default=256 * MiB, ge=0)


class S3TierConfig(Section):
    """Any S3-compatible object store (AWS S3, MinIO, Ceph RGW)."""

    kind: Literal["s3"] = "s3"
    #: the tier's name in metrics and logs (unique among tiers)
    name: str = "s3"
    #: the bucket blocks are stored in
    bucket: str = Field(min_length=3, max_length=63)
    #: namespaces a deployment or a model inside the bucket
    prefix: str = "kvtier/"
    #: the bucket's region; unset: the standard AWS chain decides
    region: str | None = None
    #: e.g. http://minio:9000 ; unset for AWS
    endpoint_url: str | None = None
    #: "path" for MinIO and most self-hosted stores; "auto" lets botocore choose
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    #: explicit credentials; unset uses the standard AWS chain (env, profile, IMDS)
    access_key_id: str | None = None
    #: with access_key_id; never logged
    secret_access_key: SecretStr | None = None
    #: for temporary credentials; never logged
    session_token: SecretStr | None = None
    #: HTTP connections kept to the endpoint
    max_pool_connections: int = Field(default=64, ge=1)
    #: S3 requests in flight at once from this tier
    max_concurrency: int = Field(default=64, ge=1)
    #: seconds to connect to the endpoint
    connect_timeout: float = Field(default=2.0, gt=0)
    #: seconds to wait for a response's bytes
    read_timeout: float = Field(default=10.0, gt=0)
    #: overall bound of one operation, retries included
    op_timeout: float = Field(default=20.0, gt=0)
    #: tries per request (botocore retries) within op_timeout
    max_attempts: int = Field(default=3, ge=1, le=20)
    #: botocore's retry mode
    retry_mode: Literal["standard", "adaptive", "legacy"] = "standard"
    #: how blocks reach the tier: write-through (every PUT, in the background), write-back (RAM
    #: evictions), none
    write_policy: WritePolicy = "write-through"
    #: upload a block only if the bucket has no object of its key yet
    #: (If-None-Match: *): of daemons writing one block at once, one stores
    #: it and the others' PUTs are no-ops; off for a store that refuses the
    #: header (the tier also turns it off by itself when one does)
    conditional_put: bool = True
    #: with max_backlog_bytes 0 only: background writes in flight at most,
    #: in bytes (each counts its block plus 8 KiB); past it they are dropped
    max_pending_write_bytes: ByteCount = Field(default=256 * MiB, ge=0)
    #: bytes of blocks the store may be owed: each block written through is
    #: owed until the store has it (64 sent at once, oldest first), and one
    #: it fails (an outage) is sent again once it takes writes. The keys are
    #: kept on the disk tier and read back at start, so a crash loses none;
    #: a block's bytes stay in memory only where no disk copy exists (no
    #: disk tier). Past it the oldest waiting are dropped and counted; 0: no
    #: backlog, a failed write is dropped at once
    max_backlog_bytes: ByteCount = Field(default=1024 * MiB, ge=0)
    #: consecutive failures that open the circuit breaker
    breaker_failures: int = Field(default=5, ge=1)
    #: seconds the breaker stays open before one trial request
    breaker_reset: float = Field(default=5.0, gt=0)
    #: compress blocks before they are sealed and sent ("zstd"; each block
    #: stays as it is where it does not shrink): worth it only where the
    #: link is slower than the codec (docs/security.md has the figures)
    codec: Codec = "none"
    #: seconds a GET may go unanswered before the object is asked for again
    #: (the first complete answer wins; a second request usually reaches
    #: another server); unset: the tier's p95 over its recent GETs
    hedge_after: float | None = Field(default=None, ge=0)
    #: hedges are at most this share of GETs (a token bucket; 0: none)
    hedge_max_ratio: float = Field(default=0.05, ge=0, le=1)


RemoteTierConfig = Annotated[MemoryTierConfig | S3TierConfig, Field(discriminator="kind")]


def _address(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected host:port, got {value!r}")
    return value


#: ``host:port`` (an IPv6 host in brackets: ``[::1]:7070``)
Address = Annotated[str, BeforeValidator(_address)]


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` as (host, port); brackets around an IPv6 host dropped."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


class PeerConfig(Section):
    """Daemons on other nodes sharing blocks over TCP (off unless configured).

    ``listen`` serves peers; ``members`` or ``dns`` name the peers this
    daemon asks. Both need the shared ``token``.
    """

    #: host:port to serve peers on, e.g. "0.0.0.0:7070"; unset: no listener
    listen: Address | None = None
    #: the address peers dial for this daemon (its name in the hash ring);
    #: default: ``listen`` when it names a host
    advertise: Address | None = None
    #: static peer addresses (this daemon's own address may be listed: it is
    #: recognised and skipped)
    members: list[Address] = Field(default_factory=list)
    #: "name:port": every address the name resolves to is a peer (a
    #: Kubernetes headless service), re-resolved every ``dns_interval``
    dns: Address | None = None
    #: seconds between re-resolutions of peer.dns
    dns_interval: float = Field(default=10.0, gt=0)
    #: the shared secret, from ``KVTIER_PEER__TOKEN`` or here; never logged
    token: SecretStr | None = None
    #: or a file holding it (read at start; surrounding whitespace ignored)
    token_file: Path | None = None
    #: TLS between hosts: this daemon's certificate and key, and the CA that
    #: signed every peer's certificate (peers must present one: mutual TLS)
    tls_cert: Path | None = None
    #: this daemon's TLS key (with tls_cert and tls_ca)
    tls_key: Path | None = None
    #: the CA that signs every peer's certificate (mutual TLS)
    tls_ca: Path | None = None
    #: "owner": a block stored here is also pushed to its owners in the
    #: background; "none": blocks stay where they were stored
    push: Literal["owner", "none"] = "owner"
    #: live nodes that own each key: a block is pushed to each of them, and a
    #: lookup asks them all at once (it survives replicas - 1 lost nodes)
    replicas: int = Field(default=2, ge=1, le=8)
    #: pushes beyond this many bytes in flight are dropped and counted; each
    #: counts its block plus 8 KiB (the push's own memory)
    max_pending_push_bytes: ByteCount = Field(default=256 * MiB, ge=0)
    #: seconds a GET from a peer may go unanswered before the block's next
    #: owner is asked too (the first to deliver wins); unset: the peer's p95
    #: over its recent loads. Needs replicas >= 2 (a next owner) or a
    #: remote tier below that may hold the block too (an S3 tier)
    hedge_after: float | None = Field(default=None, ge=0)
    #: hedges are at most this share of reads from peers (a token bucket)
    hedge_max_ratio: float = Field(default=0.05, ge=0, le=1)
    #: compress blocks sent to and from peers before they are sealed
    #: ("zstd"; a block that does not shrink is sent as it is): worth it only
    #: where links are slower than the codec (docs/security.md)
    codec: Codec = "none"
    #: seconds to connect and authenticate (HELLO) to a peer
    connect_timeout: float = Field(default=1.0, gt=0)
    #: bound of one request to a peer (a GET of one block included)
    request_timeout: float = Field(default=5.0, gt=0)
    #: consecutive failures that mark a peer down (its keys go to the next peer)
    breaker_failures: int = Field(default=3, ge=1)
    #: seconds a down peer is left alone before one trial request
    breaker_reset: float = Field(default=2.0, gt=0)
    #: whether peers may DELETE blocks here
    allow_delete: bool = False
    #: seconds a connection to the peer port has to complete an accepted HELLO
    #: before it is closed
    handshake_timeout: float = Field(default=5.0, gt=0)
    #: connections to the peer port still before their HELLO, at most: past
    #: it, the oldest is closed
    max_unauthenticated: int = Field(default=64, ge=1)

    @model_validator(mode="after")
    def _complete(self) -> PeerConfig:
        if (self.listen or self.members or self.dns) and not (self.token or self.token_file):
            raise ValueError(
                "peering needs a shared secret: set peer.token (or KVTIER_PEER__TOKEN) "
                "or peer.token_file"
            )
        if self.token and self.token_file:
            raise ValueError("set peer.token or peer.token_file, not both")
        tls = [self.tls_cert, self.tls_key, self.tls_ca]
        if any(tls) and not all(tls):
            raise ValueError("TLS needs all of peer.tls_cert, peer.tls_key and peer.tls_ca")
        return self

    @property
    def enabled(self) -> bool:
        """Whether this daemon asks peers (a peer tier exists)."""
        return bool(self.members or self.dns)

    def self_address(self) -> str | None:
        """This daemon's name among peers, when the config says it."""
        if self.advertise:
            return self.advertise
        if self.listen:
            host, _ = split_address(self.listen)
            if host not in ("0.0.0.0", "::", ""):
                return self.listen
        return None

    def server_tls(self) -> ssl.SSLContext | None:
        """The peer listener's TLS: this daemon's certificate; peers must present
        one signed by ``tls_ca`` (mutual TLS)."""
        if self.tls_cert is None or self.tls_key is None or self.tls_ca is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(self.tls_ca))
        ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def client_tls(self) -> ssl.SSLContext | None:
        """TLS for dialling peers: verify their certificate against ``tls_ca`` and
        present ours. Peers are dialled by address, so any certificate the
        fleet's CA signed is a peer (the name in it is not checked)."""
        if self.tls_cert is None or self.tls_key is None or self.tls_ca is None:
            return None
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(self.tls_ca))
        ctx.load_cert_chain(str(self.tls_cert), str(self.tls_key))
        ctx.check_hostname = False
        return ctx

    def secret(self) -> bytes:
        """The shared token's bytes (read from ``token_file`` if that is how it is given)."""
        if self.token is not None:
            return self.token.get_secret_value().encode()
        if self.token_file is None:
            return b""
        try:
            raw = self.token_file.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read peer.token_file {self.token_file}: {exc}") from exc
        if not raw:
            raise ConfigError(f"peer.token_file {self.token_file} is empty")
        return raw
