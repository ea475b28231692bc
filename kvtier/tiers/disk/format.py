"""The block file format: ``<root>/<2 hex>/<32 hex>.blk``, header, key, value.

The name is a BLAKE2b-128 hash of the key, so keys never become paths and
any key bytes are safe. The header holds a magic, the format version, the
key and value lengths and the XXH3-64 of key and value
(:func:`~kvtier.tiers.base.block_checksum`); a file whose length, key or
checksum does not match is :class:`CorruptBlock`, never served. Pure.

Imports only the shared records.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from pathlib import Path

MAGIC = b"KVTB"
FORMAT_VERSION = 1
#: magic, format version, reserved, key length, value length, xxh3_64(key + value)
HEADER = struct.Struct("<4sBBHQQ")
SUFFIX = ".blk"
TMP_MARK = ".tmp-"
PEEK = HEADER.size + 4096  # enough to hold any header and key


class CorruptBlock(Exception):
    """A block file failed its format, length, key or checksum check."""


def block_name(key: bytes) -> str:
    return hashlib.blake2b(key, digest_size=16).hexdigest()


def bucket_of(key: bytes) -> int:
    """The bucket (0-255) holding ``key``'s file: its name's first byte."""
    return hashlib.blake2b(key, digest_size=16).digest()[0]


def by_bucket(keys: Iterable[bytes]) -> list[list[bytes]]:
    """``keys`` in 256 lists, by the bucket holding each one's file."""
    buckets: list[list[bytes]] = [[] for _ in range(256)]
    blake2b = hashlib.blake2b
    for key in keys:
        buckets[blake2b(key, digest_size=16).digest()[0]].append(key)
    return buckets


def block_path(root: Path, key: bytes) -> Path:
    """Where ``key``'s block lives under ``root``: a bucket of 256, then its name."""
    name = block_name(key)
    return root / name[:2] / (name + SUFFIX)


def file_size(key: bytes, value_len: int) -> int:
    return HEADER.size + len(key) + value_len


def parse_header(buf: bytes, file_len: int) -> tuple[bytes, int, int]:
    """(key, value length, checksum) from a file's first bytes; raises CorruptBlock."""
    if len(buf) < HEADER.size:
        raise CorruptBlock("shorter than a header")
    magic, version, _reserved, key_len, value_len, digest = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    if version != FORMAT_VERSION:
        raise CorruptBlock(f"unknown format version {version}")
    if len(buf) < HEADER.size + key_len:
        raise CorruptBlock("truncated key")
    key = bytes(buf[HEADER.size : HEADER.size + key_len])
    if file_len != HEADER.size + key_len + value_len:
        raise CorruptBlock(
            f"file is {file_len} bytes, header says {HEADER.size + key_len + value_len}"
        )
    return key, value_len, digest
