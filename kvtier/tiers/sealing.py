"""Blocks sealed where they leave RAM: AES-256-GCM per namespace, compressed first. Pure.

A block a tier writes to its medium (a disk file, an S3 object, a push to
a peer) is *sealed* when its namespace has a key, *packed* when the tier
has a codec, or stored as it is when neither applies. A sealed or packed
block is a header, then the payload:

* the header: the magic ``KVS``, the format version, the codec (0: none,
  1: zstd), whether it is encrypted, the key's id (4 bytes, derived from
  the key; zeros when not encrypted) and the nonce (12 random bytes;
  zeros when not encrypted);
* the payload: the value, compressed by the codec when that made it
  smaller, then, when encrypted, AES-256-GCM's ciphertext and 16-byte tag.

The associated data of the encryption is the header (key id, codec and all)
and the block's whole key, which names its namespace: a sealed block only
opens as the block it was sealed as, in its namespace, under its key; a
block moved to another key or namespace, or re-labelled with another
key's id, fails its tag. A namespace with a key accepts only sealed blocks
(a plain one is refused); one without keys refuses sealed ones. Every
failure is :class:`SealError` with its reason: the tier answers a miss and
counts it, never bytes.

:meth:`Sealer.admit` is the one rule where stored bytes become a block
again: every tier that hands a block up (a disk read, an S3 GET, a load
from a peer, a block a peer pushed, a hedge of any of them) passes the
stored bytes through it, whatever the daemon's keys and codec, and it
checks, in order, the medium's checksum (where the medium keeps one) and
length, the seal state against the namespace's keys (sealed without a key
is ``no_key``, plain where a key is required is ``plain``), and the
block's size. A block is handed up only when every check holds: a daemon
hands a client exactly the bytes that were stored under a key, or
nothing. A plain value that happens to begin like a header is stored
wrapped (a header without a key or codec), so no plain block is ever
read as a sealed one.

Keys rotate: a namespace has one current key (new blocks) and any number
it still reads. :class:`Keys` is the daemon's one set of them, replaced
whole when the key files are read again; each tier's :class:`Sealer`
reads it at each block.

Invariants: ``admit(key, seal(key, value)) == value`` for every value,
with the same keys or with the sealing key still readable, and with any
other codec (a block packed by another daemon opens here too); a sealed block
opens under no other block key, namespace or key; a block is never
returned with a failed check. Imports the shared records and well-kept
codecs only (``cryptography``'s AES-GCM, zstd).
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from backports import zstd
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvtier.errors import KvtierError
from kvtier.model import Buffer, namespace_of
from kvtier.tiers.base import TierStats, block_checksum

S = TypeVar("S", bound=TierStats)

MAGIC = b"KVS"
FORMAT_VERSION = 1
#: magic, version, codec, flags, key id, nonce
HEADER = struct.Struct("<3sBBB4s12s")
TAG_BYTES = 16
#: the flags bit of an encrypted payload
_ENCRYPTED = 1
_NO_ID = bytes(4)
_NO_NONCE = bytes(12)
#: bytes of key material: AES-256
KEY_BYTES = 32


def wrapped(data: Buffer) -> bool:
    """Whether ``data`` begins with a header (sealed, packed or escaped)."""
    return len(data) >= HEADER.size and bytes(memoryview(data)[:3]) == MAGIC


class Codec(enum.IntEnum):
    NONE = 0
    ZSTD = 1


_CODECS = frozenset(int(c) for c in Codec)


class Failure(enum.Enum):
    """Why a block did not open (the metrics label)."""

    NO_KEY = "no_key"  # sealed under a key this daemon does not have (or none for its namespace)
    AUTH = "auth"  # its tag did not verify: altered, moved, or another key's
    PLAIN = "plain"  # not sealed, in a namespace whose blocks must be
    FORMAT = "format"  # a header or payload that does not parse or decompress
    CORRUPT = "corrupt"  # its bytes do not match the checksum its medium kept
    LENGTH = "length"  # not the length its medium said, or longer than any block may be


#: failures of the medium (torn or altered bytes), not of the seal
TORN = frozenset({Failure.CORRUPT, Failure.LENGTH})


class SealError(KvtierError):
    """A stored block that does not open; the tier answers a miss."""

    def __init__(self, failure: Failure, message: str) -> None:
        super().__init__(message)
        self.failure = failure


def key_id(material: bytes) -> bytes:
    """A key's 4-byte id: derived from it, telling nothing of it."""
    return hashlib.sha256(b"kvtier key id\0" + material).digest()[:4]


@dataclass(frozen=True)
class Keyring:
    """One namespace's keys: the current one seals, every one opens."""

    current: bytes  # its id
    ciphers: Mapping[bytes, AESGCM]

    @classmethod
    def of(cls, current: bytes, *older: bytes) -> Keyring:
        """From key material: the current key, then the ones still read."""
        for material in (current, *older):
            if len(material) != KEY_BYTES:
                raise ValueError(f"a key is {KEY_BYTES} bytes, not {len(material)}")
        ciphers = {key_id(m): AESGCM(m) for m in (*reversed(older), current)}
        return cls(key_id(current), ciphers)

    def __repr__(self) -> str:
        ids = ",".join(i.hex() for i in self.ciphers)
        return f"<Keyring current={self.current.hex()} keys={ids}>"


@dataclass
class Keys:
    """The daemon's keys by namespace id (replaced whole by a reload)."""

    rings: dict[bytes, Keyring] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"<Keys namespaces={len(self.rings)}>"

    def replace(self, rings: Mapping[bytes, Keyring]) -> None:
        self.rings = dict(rings)


@dataclass
class SealCounts:
    """What one tier's sealer did (its stats and metrics)."""

    #: plain bytes sealed (encrypted) and opened (decrypted)
    sealed_bytes: int = 0
    opened_bytes: int = 0
    #: bytes a codec was given, and the bytes it made of them
    packed_in: int = 0
    packed_out: int = 0
    failures: dict[Failure, int] = field(default_factory=lambda: dict.fromkeys(Failure, 0))
    #: (a tier seals on several threads at once)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def fill(self, stats: S) -> S:
        """``stats`` with these counts in its sealing fields."""
        stats.sealed_bytes = self.sealed_bytes
        stats.opened_bytes = self.opened_bytes
        stats.packed_in_bytes = self.packed_in
        stats.packed_out_bytes = self.packed_out
        stats.seal_failures = {f.value: n for f, n in self.failures.items()}
        return stats


class Sealer:
    """One tier's sealing: the daemon's keys, and the tier's codec."""

    def __init__(
        self,
        keys: Keys | None = None,
        codec: Codec = Codec.NONE,
        level: int = 3,
        max_block_bytes: int = 1 << 30,
    ) -> None:
        #: (none: a sealer that opens what other daemons sealed or packed, or refuses it)
        self.keys = keys if keys is not None else Keys()
        self.codec = codec
        self.level = level
        #: a packed block that would unpack to more is refused (never a bomb)
        self.max_block_bytes = max_block_bytes
        self.counts = SealCounts()

    def __repr__(self) -> str:
        return f"<Sealer codec={self.codec.name.lower()} {self.keys!r}>"

    @property
    def active(self) -> bool:
        """Whether any block may be sealed or packed (else values pass as they are)."""
        return self.codec is not Codec.NONE or bool(self.keys.rings)

    def sealed_size(self, key: bytes, value: Buffer) -> int | None:
        """The bytes ``seal`` makes of ``value`` (None: it depends on the codec)."""
        size = len(value)
        if self.codec is not Codec.NONE:
            return None
        if namespace_of(key) in self.keys.rings:
            return HEADER.size + size + TAG_BYTES
        return HEADER.size + size if wrapped(value) else size

    def seal(self, key: bytes, value: Buffer) -> Buffer:
        """``value`` as the tier stores it (see the module)."""
        ring = self.keys.rings.get(namespace_of(key))
        codec = Codec.NONE
        payload: Buffer = value
        if self.codec is Codec.ZSTD:
            packed = zstd.compress(value, level=self.level)
            with self.counts.lock:
                self.counts.packed_in += len(value)
                self.counts.packed_out += len(packed)
            if len(packed) < len(value):
                codec, payload = Codec.ZSTD, packed
        elif ring is None and not wrapped(value):
            return value  # (one that begins like a header is stored wrapped)
        if ring is None:
            return HEADER.pack(MAGIC, FORMAT_VERSION, codec, 0, _NO_ID, _NO_NONCE) + payload
        head = HEADER.pack(MAGIC, FORMAT_VERSION, codec, _ENCRYPTED, ring.current, os.urandom(12))
        sealed = bytearray(HEADER.size + len(payload) + TAG_BYTES)
        sealed[: HEADER.size] = head
        ring.ciphers[ring.current].encrypt_into(
            head[-12:], payload, head + key, memoryview(sealed)[HEADER.size :]
        )
        with self.counts.lock:
            self.counts.sealed_bytes += len(value)
        return sealed

    def passes(self, value: Buffer) -> bool:
        """Whether ``seal`` stores ``value`` as it is, whatever its key."""
        return not self.active and not wrapped(value)

    def costly(self, stored: Buffer) -> bool:
        """Whether admitting ``stored`` decrypts or unpacks (worth a thread):
        :func:`wrapped`, inline (every block a tier loads asks)."""
        return len(stored) >= HEADER.size and bytes(memoryview(stored)[:3]) == MAGIC

    def admit(
        self,
        key: bytes,
        stored: Buffer,
        *,
        checksum: int | None = None,
        length: int | None = None,
    ) -> Buffer:
        """The block ``stored`` holds for ``key``, from a tier's medium: the
        one rule where bytes leave a tier (see the module). ``checksum`` is
        the :func:`~kvtier.tiers.base.block_checksum` the medium kept with
        the bytes, ``length`` the length it said they have (None: it keeps
        none). Raises SealError (counted by reason)."""
        try:
            if length is not None and len(stored) != length:
                raise SealError(
                    Failure.LENGTH, f"{len(stored)} bytes where its medium said {length}"
                )
            if checksum is not None and block_checksum(key, stored) != checksum:
                raise SealError(Failure.CORRUPT, "its bytes do not match their checksum")
            value = self._open(key, stored)
            if len(value) > self.max_block_bytes:
                raise SealError(
                    Failure.LENGTH,
                    f"{len(value)} bytes, more than a block may hold ({self.max_block_bytes})",
                )
        except SealError as exc:
            with self.counts.lock:
                self.counts.failures[exc.failure] += 1
            raise
        return value

    def _open(self, key: bytes, data: Buffer) -> Buffer:
        rings = self.keys.rings
        ring = rings.get(namespace_of(key)) if rings else None
        view = memoryview(data)
        # (``wrapped``, inline: every read of a block passes here)
        if len(view) < HEADER.size or view[:3] != MAGIC:  # stored without a key or codec: plain
            if ring is not None:
                raise SealError(Failure.PLAIN, "a plain block where its namespace seals blocks")
            return data
        _magic, version, codec, flags, kid, nonce = HEADER.unpack_from(view)
        if version != FORMAT_VERSION or codec not in _CODECS:
            raise SealError(Failure.FORMAT, f"a sealed block of format {version}, codec {codec}")
        payload: Buffer = view[HEADER.size :]
        if flags & _ENCRYPTED:
            if ring is None:
                raise SealError(Failure.NO_KEY, "a sealed block in a namespace without keys")
            cipher = ring.ciphers.get(kid)
            if cipher is None:
                raise SealError(Failure.NO_KEY, f"sealed under key {kid.hex()}, not one of ours")
            try:
                payload = cipher.decrypt(nonce, payload, bytes(view[: HEADER.size]) + key)
            except InvalidTag:
                raise SealError(Failure.AUTH, "its tag does not verify") from None
        elif ring is not None:
            raise SealError(Failure.PLAIN, "an unencrypted block where its namespace seals blocks")
        if codec == Codec.ZSTD:
            payload = self._unpack(payload)
        if flags & _ENCRYPTED:  # (plain bytes, as ``sealed_bytes`` counts them)
            with self.counts.lock:
                self.counts.opened_bytes += len(payload)
        return payload

    def _unpack(self, payload: Buffer) -> bytes:
        unpacker = zstd.ZstdDecompressor()
        try:
            out = unpacker.decompress(payload, max_length=self.max_block_bytes + 1)
        except zstd.ZstdError as exc:
            raise SealError(Failure.FORMAT, f"its payload does not decompress: {exc}") from None
        if not unpacker.eof or len(out) > self.max_block_bytes:
            raise SealError(
                Failure.FORMAT,
                f"its payload does not unpack whole within {self.max_block_bytes} bytes",
            )
        return out
