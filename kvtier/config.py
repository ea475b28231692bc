"""Configuration: one validated object built from defaults, a TOML file,
``KVTIER_*`` environment variables and command-line flags (in rising order
of precedence).

Environment variables name nested fields with ``__``:
``KVTIER_RAM__CAPACITY=8GiB``, ``KVTIER_SERVER__SOCKET_PATH=/run/kvtier.sock``.
``KVTIER_CONFIG`` names the TOML file when ``--config`` is not given.

The daemon's side only: this module loads pydantic, so the client and
``import kvtier`` never import it (the defaults they share live in
:mod:`kvtier.defaults`).
"""

from __future__ import annotations

import os
import tomllib
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ByteSize,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from kvtier.configtypes import ByteCount, Capacity, Section, SocketMode
from kvtier.defaults import (
    DEFAULT_METRICS_PORT,
    IDLE_POLL,
    default_data_dir,
    default_socket_path,
)
from kvtier.errors import ConfigError
from kvtier.model import STAGING_REUSE_SECONDS, namespace_id
from kvtier.schedule import MAX_SLICE, MIN_SLICE
from kvtier.sizes import (
    GiB,
    KiB,
    MiB,
    auto_disk_capacity,
    auto_ram_capacity,
    available_memory,
    free_disk_bytes,
)
from kvtier.tierconfig import PeerConfig, RemoteTierConfig, S3TierConfig, split_address

__all__ = [
    "GiB",
    "MiB",
    "PeerConfig",
    "RemoteTierConfig",
    "S3TierConfig",
    "auto_ram_capacity",
    "load_config",
    "render_toml",
    "split_address",
]


class ServerConfig(Section):
    #: the Unix socket clients connect to; its directory is created 0700 (0750 for a
    #: group-usable socket). Default: $XDG_RUNTIME_DIR/kvtier/kvtier.sock, else
    #: /tmp/kvtier-$UID/kvtier.sock
    socket_path: Path = Field(default_factory=default_socket_path)
    #: largest frame body (meta + data) accepted; a larger one closes the connection
    max_frame_bytes: ByteSize = Field(default=ByteSize(64 * MiB), ge=4096, le=0xFFFFFFFF)
    #: keys are 1..N opaque bytes
    max_key_bytes: int = Field(default=256, ge=1, le=4096)
    #: keys per LOOKUP, GET, PUT or DELETE request
    max_batch: int = Field(default=65536, ge=1, le=1 << 24)
    #: largest block; must fit in one frame
    max_block_bytes: ByteSize = Field(default=ByteSize(16 * MiB), ge=1)
    #: requests one connection may have running before reading from it pauses
    max_inflight_per_connection: int = Field(default=1024, ge=1)
    #: seconds the event loop keeps polling for the next request after one
    #: arrives and after each answer, instead of sleeping: a request that
    #: comes meanwhile is read at once, without the wake-up of a sleeping
    #: thread (tens of microseconds where idle CPUs halt, as a VM's do).
    #: Costs up to this much of one core's time after each request; 0
    #: turns it off
    idle_poll: float = Field(default=IDLE_POLL, ge=0, le=0.01)
    #: also answer LOOKUP from a process of its own, on the socket beside this
    #: one named ``<socket_path>.lookups``, from a replica of what the daemon
    #: holds (docs/lookup-process.md): a lookup does not queue behind the
    #: loop that stores blocks. Clients of the default namespace use it where
    #: it listens; what it cannot answer exactly, they ask the daemon
    lookup_process: bool = True
    #: seconds the lookup process asks the kernel's scheduler for as its
    #: slice (Linux 6.12 and later, no privilege; kvtier.schedule): woken by a
    #: lookup, it runs before a thread that has been streaming blocks instead
    #: of after that thread's slice (1.4 ms on 2 CPUs). Its CPU share does not
    #: change. 0 keeps the kernel's default; else 0.0001 (the kernel's
    #: least) to 0.1
    lookup_slice: float = Field(default=MIN_SLICE, ge=0, le=MAX_SLICE)
    #: seconds to finish in-flight requests on SIGTERM or SIGINT
    shutdown_grace: float = Field(default=10.0, ge=0)
    #: seconds background work (probes, loads, writes) gets to end once
    #: cancelled at shutdown; a task still running then is abandoned and logged
    shutdown_task_timeout: float = Field(default=5.0, gt=0)
    #: the socket file's mode: 0600 (the daemon's user only) or, for engines
    #: running as another user of a shared group, 0660; written as "0660" or 432
    socket_mode: SocketMode = 0o600
    #: peers allowed to connect, checked with SO_PEERCRED at accept (a peer
    #: passes if its uid or its gid is listed); unset with a group-readable
    #: socket: the daemon's own uid only
    allowed_uids: list[int] | None = None
    #: groups allowed to connect (see allowed_uids)
    allowed_gids: list[int] | None = None
    #: with allowed_uids or allowed_gids set: seconds a new connection has to
    #: send its first frame before it is closed
    handshake_timeout: float = Field(default=5.0, gt=0)
    #: seconds a request's frame may go without a byte arriving once it has
    #: begun: a client that stalls inside a frame (a PUT body half sent) has
    #: its connection closed, the room its body held given back and its
    #: reservations ended (counted: kvtier_protocol_errors_total{code="body_timeout"})
    body_timeout: float = Field(default=10.0, gt=0)
    #: a HELLO may name only a namespace of a [namespaces.<name>] table (off:
    #: any name, with the default share; docs/tenancy.md)
    configured_namespaces_only: bool = False

    @model_validator(mode="after")
    def _a_slice_the_kernel_grants(self) -> ServerConfig:
        if 0 < self.lookup_slice < MIN_SLICE:
            raise ValueError(f"lookup_slice is 0 or {MIN_SLICE} to {MAX_SLICE} seconds")
        return self

    @model_validator(mode="after")
    def _block_fits_frame(self) -> ServerConfig:
        if self.max_block_bytes + self.max_key_bytes + 64 > self.max_frame_bytes:
            raise ValueError(
                f"max_block_bytes ({self.max_block_bytes}) must fit in one frame "
                f"(max_frame_bytes {self.max_frame_bytes}, less key and header room)"
            )
        return self


class RamConfig(Section):
    #: bytes, or "auto": a quarter of available memory, capped at 16 GiB
    capacity: Capacity = "auto"
    #: eviction policy: "harc" (ARC with a long frequency history, see
    #: docs/eviction.md), "lru", "arc", "s3fifo"
    policy: Literal["harc", "lru", "arc", "s3fifo"] = "harc"
    #: the share of RAM (of a namespace's ram_max, where it has one), and
    #: of the disk (of its disk_max), that blocks under retention leases
    #: may hold; past it a namespace's lowest-priority, oldest leases there
    #: end (docs/retention.md). 0: no leases
    retained_share: float = Field(default=0.8, ge=0.0, le=1.0)

    def capacity_bytes(self) -> int:
        if self.capacity == "auto":
            return auto_ram_capacity(available_memory())
        return int(self.capacity)


class SharedConfig(Section):
    """Shared memory for clients on the same host (docs/shared-memory.md)."""

    #: keep RAM's blocks in a memory file that clients map and read in place
    #: (Linux; elsewhere, and when off, every block crosses the socket)
    enabled: bool = True
    #: blocks smaller than this stay ordinary objects and go over the socket
    min_block: ByteCount = Field(default=64 * KiB, ge=4096)
    #: a lease on a block read in place is revoked (and counted) after this long
    lease_timeout: float = Field(default=30.0, gt=0)
    #: the writable region clients stage blocks in before committing them
    staging_bytes: ByteCount = Field(default=256 * MiB, ge=1 * MiB)
    #: staging room a client has not committed to for this long is reclaimed
    #: (more than the 10 s a client reuses a room for)
    staging_timeout: float = Field(default=60.0, gt=STAGING_REUSE_SECONDS)
    #: clients of the daemon's own user get the arena writable and write large
    #: blocks straight into their RAM slots (no copy in the daemon); others,
    #: and all clients when off, write through the staging region
    write_in_place: bool = True
    #: allocate the memory of the arena's first ram.capacity bytes and of the
    #: staging region when the daemon starts (in the background, once it
    #: serves), and map it into the daemon: the first blocks stored then cost
    #: what later ones do; off: pages are allocated as blocks first land in
    #: them, and memory grows with use
    preallocate: bool = True
    #: threads the daemon copies blocks of clients' regions in (PUT_REGION,
    #: GET_REGION), 0 to 64; 0 copies them on the event loop, in turns of
    #: about 50 µs; "auto": 0 where the daemon may run on 2 CPUs or
    #: fewer, else half of them, up to 8
    copy_threads: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = "auto"

    def copy_thread_count(self) -> int:
        if self.copy_threads == "auto":
            return auto_copy_threads(usable_cpus())
        return int(self.copy_threads)


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def auto_copy_threads(cpus: int) -> int:
    """``shared.copy_threads = "auto"``: none on 2 CPUs or fewer (the copies
    run on the loop, docs/shared-memory.md), else half the CPUs, up to 8."""
    return 0 if cpus <= 2 else min(cpus // 2, 8)


class DiskConfig(Section):
    #: serve a disk tier below RAM
    enabled: bool = True
    #: the block directory (256 fan-out subdirectories are created). Default:
    #: $XDG_CACHE_HOME/kvtier, else ~/.cache/kvtier
    path: Path = Field(default_factory=default_data_dir)
    #: bytes, or "auto": a tenth of the free space at start, capped at 64 GiB
    capacity: Capacity = "auto"
    #: how PUTs reach the disk: "write-through" (every PUT, in the background),
    #: "write-back" (blocks evicted from RAM), "none" (only durable PUTs)
    write_policy: Literal["write-through", "write-back", "none"] = "write-through"
    #: "none": no fsync (survives a process crash, not power loss); "batch":
    #: grouped fsyncs, durable PUTs wait for theirs; "always": fsync per block
    fsync: Literal["none", "batch", "always"] = "batch"
    #: threads doing file I/O (block reads and writes never run on the event loop)
    io_threads: int = Field(default=4, ge=1, le=64)
    #: a lookup HIT on disk starts loading the block into RAM
    promote_on_lookup: bool = True
    #: /readyz answers 503 until the disk index scan at start has finished
    #: (the daemon serves meanwhile; blocks not yet scanned read RETRY)
    ready_after_scan: bool = False
    #: bytes of background writes (write-through, demotions) in flight to the
    #: disk before the writers are slowed: a connection whose store finds
    #: this many in flight is not read from again until they drain below it,
    #: so no block is dropped for want of room (past 4 times this, one is,
    #: counted and logged). Each write counts its block plus 8 KiB, what the
    #: write itself costs in memory
    max_pending_write_bytes: ByteCount = Field(default=256 * MiB, ge=0)
    #: eviction policy: "harc" (ARC with a long frequency history, see
    #: docs/eviction.md), "lru", "arc", "s3fifo"
    policy: Literal["harc", "lru", "arc", "s3fifo"] = "harc"

    def capacity_bytes(self) -> int:
        if self.capacity == "auto":
            return auto_disk_capacity(free_disk_bytes(self.path))
        return int(self.capacity)


class LookupConfig(Section):
    #: seconds a remote existence probe may take before it resolves as an error (MISS)
    probe_timeout: float = Field(default=2.0, gt=0)
    #: probes arriving within this window go to a tier in one batch_lookup call
    probe_batch_window: float = Field(default=0.001, ge=0)
    #: keys per batch_lookup call to a remote tier at most
    probe_max_batch: int = Field(default=1024, ge=1)
    #: how long a probe's verdict answers later lookups without a new probe
    verdict_ttl: float = Field(default=5.0, gt=0)
    #: how long a failed probe is remembered (short: errors are transient; 0 = not at all)
    error_ttl: float = Field(default=0.5, ge=0)
    #: probe verdicts kept per remote tier at most
    max_verdicts: int = Field(default=100_000, ge=1)
    #: write deadline of every PENDING block (reservations and promotions)
    pending_deadline: float = Field(default=30.0, gt=0)
    #: seconds a promotion's load from a remote tier may take
    load_timeout: float = Field(default=10.0, gt=0)
    #: "promote": a remote hit starts a promotion into RAM and reads PENDING
    #: until it lands; "hit": it reads HIT and GET loads it on demand
    remote_hit: Literal["promote", "hit"] = "promote"
    #: idle per-request lookup state (max_pending_wait) is dropped after this
    request_state_ttl: float = Field(default=60.0, gt=0)
    #: request tags tracked at most (oldest dropped first)
    max_request_states: int = Field(default=100_000, ge=1)
    #: how often stale verdicts and idle request state are swept
    sweep_interval: float = Field(default=1.0, gt=0)


class MetricsConfig(Section):
    #: serve /metrics, /healthz and /readyz over HTTP
    enabled: bool = True
    #: address to bind; a non-loopback address exposes the metrics and probes (no block data) to
    #: that network
    host: str = "127.0.0.1"
    #: 0 picks a free port (logged at startup)
    port: int = Field(default=DEFAULT_METRICS_PORT, ge=0, le=65535)
    #: namespaces with series of their own at most; the rest are summed in
    #: one series labelled "other" (bounded cardinality)
    max_namespaces: int = Field(default=32, ge=0, le=10_000)


class EventsConfig(Section):
    """KV events for routers, published in vLLM's format (docs/routing.md).
    The keys are named as vLLM's ``KVEventsConfig`` names them."""

    #: ZMQ PUB address the daemon publishes KV event batches on, e.g.
    #: "tcp://*:5557" or "ipc:///run/kvtier/events"; none: not published
    endpoint: str | None = None
    #: ZMQ ROUTER address that serves missed batches by sequence number; none: no replay
    replay_endpoint: str | None = None
    #: batches kept for replay
    buffer_steps: int = Field(default=10_000, ge=1)
    #: the PUB socket's high-water mark (messages queued per subscriber)
    hwm: int = Field(default=100_000, ge=0)
    #: the topic of every message; default: each namespace's own,
    #: "kv@<node>@<namespace>" (the default namespace's: "kv@<node>@default")
    topic: str = ""
    #: the medium string of the events (Dynamo maps CPU_TIER2, DISK, NVME and
    #: STORAGE to its disk tier; EXTERNAL, NETWORK, REMOTE and SHARED to external)
    medium: str = "STORAGE"
    #: this node's name in the topic; default: the host name
    node: str = ""
    #: tokens per block, as the engine's (the events' block_size)
    block_size: int = Field(default=16, ge=1)
    #: how a block's key names the engine's block hash: "vllm" (the vLLM
    #: tier's keys: the hash's last 8 bytes before a 4-byte group index, as
    #: vLLM converts them), "sglang" (the SGLang integration's keys end with
    #: SGLang's own event hash of the page, signed), "tail" (the key's last 8
    #: bytes, unsigned)
    key_format: Literal["vllm", "sglang", "tail"] = "vllm"


class NamespaceConfig(Section):
    """One namespace's share of the node (``[namespaces.<name>]``; the default
    namespace, of clients that name none, is ``[namespaces.default]``). See
    docs/tenancy.md. SIGHUP applies a change live."""

    #: RAM guaranteed to the namespace: other namespaces' pressure never
    #: evicts its blocks while it holds no more than this
    ram_min: ByteCount = 0
    #: RAM it may hold at most; past it, its own blocks make room for its new
    #: ones (none: up to the whole tier)
    ram_max: ByteCount | None = None
    #: disk it may hold at most; past it, its own blocks on disk go first
    disk_max: ByteCount | None = None
    #: its weight in sharing the RAM above every namespace's ram_min: of two
    #: namespaces that both want more, the one further above its share
    #: (ram_min plus its weight's part of the rest) gives up room first
    weight: float = Field(default=1.0, gt=0)
    #: local users that may use the namespace (checked at HELLO with the
    #: socket's credentials); none: every user the socket admits
    uids: list[int] | None = None
    #: the key sealing the namespace's blocks (AES-256-GCM) wherever they
    #: leave RAM: disk files, remote tiers, pushes to peers (docs/security.md);
    #: a file of 32 bytes (raw, hex or base64) that only its owner may read;
    #: unset: its blocks are stored plain. SIGHUP reads the key files again
    encryption_key_file: Path | None = None
    #: older keys the namespace's blocks may still be sealed under: read,
    #: never written (a rotation lists the previous key here)
    encryption_old_key_files: list[Path] = Field(default_factory=list)

    @model_validator(mode="after")
    def _min_below_max(self) -> NamespaceConfig:
        if self.ram_max is not None and self.ram_min > self.ram_max:
            raise ValueError(f"ram_min ({self.ram_min}) is above ram_max ({self.ram_max})")
        if self.encryption_old_key_files and self.encryption_key_file is None:
            raise ValueError("encryption_old_key_files without an encryption_key_file")
        return self


class LogConfig(Section):
    #: log level; SIGHUP applies a change live
    level: Literal["debug", "info", "warning", "error"] = "info"


_toml_path: ContextVar[Path | None] = ContextVar("kvtier_toml_path", default=None)


class _TomlSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], path: Path | None) -> None:
        super().__init__(settings_cls)
        self.path = path

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ returns the whole document

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            with open(self.path, "rb") as fh:
                return tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError(f"config file {self.path} does not exist") from exc
        except OSError as exc:
            raise ConfigError(f"cannot read config file {self.path}: {exc}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {self.path} is not valid TOML: {exc}") from exc


class Config(BaseSettings):
    """Every setting of the daemon. Build with :func:`load_config`."""

    model_config = SettingsConfigDict(
        env_prefix="KVTIER_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    server: ServerConfig = Field(default_factory=ServerConfig)
    ram: RamConfig = Field(default_factory=RamConfig)
    shared: SharedConfig = Field(default_factory=SharedConfig)
    disk: DiskConfig = Field(default_factory=DiskConfig)
    lookup: LookupConfig = Field(default_factory=LookupConfig)
    remote_tiers: list[RemoteTierConfig] = Field(default_factory=list)
    peer: PeerConfig = Field(default_factory=PeerConfig)

    @model_validator(mode="after")
    def _unique_tier_names(self) -> Config:
        names = [t.name for t in self.remote_tiers]
        taken = {"ram", "disk", "peers"}
        for name in names:
            if name in taken:
                raise ValueError(f"remote tier name {name!r} is used twice or is reserved")
            taken.add(name)
        return self

    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    namespaces: dict[str, NamespaceConfig] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _namespace_names(self) -> Config:
        for name in self.namespaces:
            namespace_id(name)  # a ValueError names the bad one
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Precedence: command-line flags (init), then the environment, then TOML.
        return init_settings, env_settings, _TomlSource(settings_cls, _toml_path.get())


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"]) or "(root)"
        value = err.get("input")
        shown = "" if isinstance(value, dict) else f" (got {value!r})"
        lines.append(f"{loc}: {err['msg']}{shown}")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Build the effective config; raise :class:`ConfigError` naming any bad field.

    ``path`` falls back to ``$KVTIER_CONFIG``; ``overrides`` is a nested dict
    of command-line values (``{"server": {"socket_path": ...}}``).
    """
    if path is None:
        path = os.environ.get("KVTIER_CONFIG") or None
    token = _toml_path.set(Path(path) if path else None)
    saved = os.environ.pop("KVTIER_CONFIG", None)  # not a field; keep it out of the env source
    try:
        return Config(**(overrides or {}))
    except ValidationError as exc:
        raise ConfigError(_format_validation_error(exc)) from None
    finally:
        _toml_path.reset(token)
        if saved is not None:
            os.environ["KVTIER_CONFIG"] = saved


def render_toml(config: Config) -> str:
    """The effective config as TOML (for ``kvtier config check``)."""
    out: list[str] = []

    def table(header: str, values: dict[str, Any]) -> None:
        out.append(header)
        out.extend(
            f"{key} = {_toml_value(value)}" if value is not None else f"# {key} unset"
            for key, value in values.items()
        )
        out.append("")

    for section, model in config.model_dump(mode="json").items():
        if isinstance(model, list):
            for item in model:
                table(f"[[{section}]]", item)
        elif section == "namespaces":
            for name, values in model.items():
                table(f"[namespaces.{_toml_key(name)}]", values)
        else:
            table(f"[{section}]", model)
    return "\n".join(out)


def _toml_key(name: str) -> str:
    bare = name.replace("-", "").replace("_", "").isalnum()
    return name if bare else '"' + name + '"'


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + " }"
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
