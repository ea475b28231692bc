"""Blocks sealed at rest: the format alone, key files, and the disk and S3
tiers (a real S3-compatible server) and a daemon's start and SIGHUP."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvtier import Client
from kvtier.config import S3TierConfig
from kvtier.errors import ConfigError
from kvtier.model import namespace_prefix
from kvtier.tiers.base import block_checksum
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk.format import FORMAT_VERSION as FILE_VERSION
from kvtier.tiers.disk.format import HEADER as FILE_HEADER
from kvtier.tiers.disk.format import MAGIC as FILE_MAGIC
from kvtier.tiers.keyfiles import read_key_file, read_keyring
from kvtier.tiers.s3 import CHECKSUM_META, S3Tier, object_checksum
from kvtier.tiers.sealing import (
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    Codec,
    Failure,
    Keyring,
    Keys,
    Sealer,
    SealError,
    key_id,
)
from tests.helpers import DaemonProcess
from tests.s3server import ProxiedS3

KEY_A, KEY_B, KEY_OLD = os.urandom(32), os.urandom(32), os.urandom(32)
A, B = b"tenant-a", b"tenant-b"


def ns_key(ns: bytes, key: bytes) -> bytes:
    return namespace_prefix(ns) + key


def kv_like(n: int, seed: int = 0) -> bytes:
    """bf16-like bytes: the upper halves of float32 normals (what KV tensors
    hold: small exponents repeat, mantissas do not)."""
    import random
    import struct

    rng = random.Random(seed)
    floats = struct.pack(f"<{n // 2}f", *(rng.gauss(0, 1) for _ in range(n // 2)))
    return bytes(b for i in range(0, len(floats), 4) for b in floats[i + 2 : i + 4])


def failures(**counts: int) -> dict[str, int]:
    """A tier's ``seal_failures``: every reason, 0 but for ``counts``."""
    return {f.value: counts.get(f.value, 0) for f in Failure}


def sealer(rings: dict[bytes, Keyring], codec: Codec = Codec.NONE) -> Sealer:
    return Sealer(Keys(rings), codec)


# -- the format, alone


@given(st.binary(max_size=3000), st.sampled_from(Codec))
def test_a_sealed_block_opens_as_it_was_and_only_as_it_was(value: bytes, codec: Codec) -> None:
    s = sealer({A: Keyring.of(KEY_A)}, codec)
    key = ns_key(A, b"block-1")
    sealed = bytes(s.seal(key, value))
    assert bytes(s.admit(key, sealed)) == value
    assert value == b"" or value not in sealed or len(value) < 8  # never stored in the clear
    for other in (ns_key(A, b"block-2"), ns_key(B, b"block-1"), b"block-1"):
        with pytest.raises(SealError):
            s.admit(other, sealed)


def test_namespaces_with_the_same_key_material_still_cannot_read_each_other() -> None:
    both = Keyring.of(KEY_A)
    s = sealer({A: both, B: both})
    sealed = s.seal(ns_key(A, b"k"), b"secret prompt" * 100)
    with pytest.raises(SealError) as err:
        s.admit(ns_key(B, b"k"), sealed)  # (moved to B's key: its tag binds A's)
    assert err.value.failure is Failure.AUTH
    assert s.counts.failures[Failure.AUTH] == 1


@given(st.integers(0, 10_000), st.integers(1, 255))
def test_a_flipped_byte_never_opens(at: int, flip: int) -> None:
    s = sealer({A: Keyring.of(KEY_A)}, Codec.ZSTD)
    key = ns_key(A, b"k")
    sealed = bytearray(s.seal(key, kv_like(4096)))
    sealed[at % len(sealed)] ^= flip
    with pytest.raises(SealError):
        s.admit(key, bytes(sealed))


def test_a_relabelled_key_id_or_codec_fails_its_tag() -> None:
    ring = Keyring.of(KEY_A, KEY_OLD)
    s = sealer({A: ring})
    key = ns_key(A, b"k")
    sealed = bytearray(s.seal(key, b"v" * 1000))
    assert sealed[6:10] == key_id(KEY_A)
    sealed[6:10] = key_id(KEY_OLD)  # claims the other key of the ring
    with pytest.raises(SealError) as err:
        s.admit(key, bytes(sealed))
    assert err.value.failure is Failure.AUTH


def test_rotation_reads_old_blocks_and_writes_new_ones_under_the_current_key() -> None:
    keys = Keys({A: Keyring.of(KEY_OLD)})
    s = Sealer(keys)
    key = ns_key(A, b"k")
    old = s.seal(key, b"old block")
    keys.replace({A: Keyring.of(KEY_A, KEY_OLD)})  # KEY_A current, KEY_OLD still read
    new = s.seal(key, b"new block")
    assert bytes(s.admit(key, old)) == b"old block"
    assert bytes(s.admit(key, new)) == b"new block"
    assert bytes(memoryview(new)[6:10]) == key_id(KEY_A)
    keys.replace({A: Keyring.of(KEY_A)})  # the old key dropped: its blocks are misses
    with pytest.raises(SealError) as err:
        s.admit(key, old)
    assert err.value.failure is Failure.NO_KEY


def test_plain_and_sealed_blocks_each_stay_in_their_kind_of_namespace() -> None:
    s = sealer({A: Keyring.of(KEY_A)})
    plain_key, sealed_key = ns_key(B, b"k"), ns_key(A, b"k")
    assert s.seal(plain_key, b"plain") == b"plain"  # B has no key: stored as it is
    with pytest.raises(SealError) as err:
        s.admit(sealed_key, b"a plain block planted where A's sealed one belongs")
    assert err.value.failure is Failure.PLAIN
    with pytest.raises(SealError) as err:
        s.admit(plain_key, s.seal(sealed_key, b"x" * 100))  # (a sealed block in B)
    assert err.value.failure in (Failure.NO_KEY, Failure.AUTH)
    assert s.counts.failures[Failure.PLAIN] == 1


def test_the_codec_packs_what_shrinks_and_leaves_the_rest() -> None:
    s = sealer({}, Codec.ZSTD)
    compressible, noise = b"\x00\x01" * 50_000, os.urandom(100_000)
    packed, kept = s.seal(b"a", compressible), s.seal(b"b", noise)
    assert len(packed) < len(compressible) // 10
    assert len(kept) == HEADER.size + len(noise)  # not smaller: stored unpacked
    assert bytes(s.admit(b"a", packed)) == compressible and bytes(s.admit(b"b", kept)) == noise
    assert s.counts.packed_in == 200_000 and s.counts.sealed_bytes == 0


# -- key files


def key_file(tmp_path: Path, name: str, data: bytes, mode: int = 0o600) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    path.chmod(mode)
    return path


def test_key_files_raw_hex_or_base64_and_nothing_else(tmp_path: Path) -> None:
    import base64

    raw = key_file(tmp_path, "raw.key", KEY_A)
    hexed = key_file(tmp_path, "hex.key", KEY_A.hex().encode() + b"\n")
    b64 = key_file(tmp_path, "b64.key", base64.b64encode(KEY_A) + b"\n")
    assert read_key_file(raw, "a") == read_key_file(hexed, "a") == read_key_file(b64, "a") == KEY_A
    short = key_file(tmp_path, "short.key", b"0123456789abcdef")
    with pytest.raises(ConfigError, match=r"namespace 'a'.*does not hold a 32-byte key"):
        read_key_file(short, "a")


def test_a_missing_or_open_key_file_is_refused_naming_the_namespace(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"namespace 'tenant-a'.*gone\.key does not exist"):
        read_keyring("tenant-a", tmp_path / "gone.key")
    loose = key_file(tmp_path, "loose.key", KEY_A, 0o644)
    with pytest.raises(ConfigError, match=r"namespace 'tenant-a'.*mode 644.*chmod 600"):
        read_keyring("tenant-a", loose)
    ok = key_file(tmp_path, "ok.key", KEY_A, 0o400)
    ring = read_keyring("tenant-a", ok, [key_file(tmp_path, "old.key", KEY_OLD)])
    assert ring.current == key_id(KEY_A) and set(ring.ciphers) == {key_id(KEY_A), key_id(KEY_OLD)}


# -- the disk tier


def forge_file(tier: DiskTier, key: bytes, value: bytes) -> None:
    """Write ``value`` as ``key``'s block file, with a valid checksum (an
    attacker with the disk who knows the format)."""
    head = FILE_HEADER.pack(
        FILE_MAGIC, FILE_VERSION, 0, len(key), len(value), block_checksum(key, value)
    )
    tier.path_of(key).write_bytes(head + key + value)


async def test_the_disk_keeps_sealed_blocks_that_open_only_in_their_namespace(
    tmp_path: Path,
) -> None:
    keys = Keys({A: Keyring.of(KEY_A), B: Keyring.of(KEY_B)})
    tier = DiskTier(tmp_path / "data", 10 << 20, fsync="none", sealer=Sealer(keys))
    tier.prepare()
    await tier.load_index()
    await tier.rebuild_index()
    prompt = b"the user's prompt, as KV " * 400
    a_key, b_key, plain_key = ns_key(A, b"k"), ns_key(B, b"k"), b"plain-k"
    await tier.write(a_key, prompt)
    await tier.write(b_key, b"b's own" * 10)
    await tier.write(plain_key, prompt)
    on_disk = tier.path_of(a_key).read_bytes()
    assert prompt[:64] not in on_disk and b"KVS" in on_disk[:100]
    assert prompt in tier.path_of(plain_key).read_bytes()  # no key: plain, as before
    assert bytes(await tier.read(a_key) or b"") == prompt

    # A's sealed payload planted as B's block (checksum valid): a miss,
    # counted (B has no such key).
    sealed = on_disk[FILE_HEADER.size + len(a_key) :]
    forge_file(tier, b_key, sealed)
    assert await tier.read(b_key) is None
    stats = tier.stats()
    assert stats.seal_failures is not None and stats.seal_failures["no_key"] == 1
    assert stats.sealed_bytes == len(prompt) + 70 and stats.opened_bytes == len(prompt)
    assert not tier.contains(b_key) and not tier.path_of(b_key).exists()  # dropped

    # A flipped byte: the file's checksum catches it (corrupt); with the
    # checksum forged to match, the tag does (a miss either way).
    flipped = bytearray(sealed)
    flipped[-5] ^= 1
    forge_file(tier, a_key, bytes(flipped))
    assert await tier.read(a_key) is None
    assert tier.stats().seal_failures == failures(no_key=1, auth=1)
    await tier.close()


async def test_the_disk_reads_blocks_of_a_rotated_key_and_writes_under_the_new_one(
    tmp_path: Path,
) -> None:
    keys = Keys({A: Keyring.of(KEY_OLD)})
    tier = DiskTier(tmp_path / "data", 10 << 20, fsync="none", sealer=Sealer(keys))
    tier.prepare()
    await tier.load_index()
    await tier.rebuild_index()
    old_key, new_key = ns_key(A, b"old"), ns_key(A, b"new")
    await tier.write(old_key, b"o" * 5000)
    keys.replace({A: Keyring.of(KEY_A, KEY_OLD)})
    await tier.write(new_key, b"n" * 5000)

    def kid(key: bytes) -> bytes:
        data = tier.path_of(key).read_bytes()[FILE_HEADER.size + len(key) :]
        return data[6:10]

    assert kid(old_key) == key_id(KEY_OLD) and kid(new_key) == key_id(KEY_A)
    assert bytes(await tier.read(old_key) or b"") == b"o" * 5000
    assert bytes(await tier.read(new_key) or b"") == b"n" * 5000
    await tier.close()


# -- S3, through a real S3-compatible server


async def test_s3_objects_are_sealed_and_only_open_as_themselves(s3: ProxiedS3) -> None:
    bucket = s3.new_bucket()
    keys = Keys({A: Keyring.of(KEY_A), B: Keyring.of(KEY_B)})
    cfg = S3TierConfig(**s3.tier_config(bucket, codec="zstd"))
    tier = S3Tier(cfg, sealer=Sealer(keys, Codec.ZSTD))
    await tier.open()
    try:
        block = kv_like(1 << 20)
        a_key, b_key = ns_key(A, b"block"), ns_key(B, b"block")
        await tier.batch_store([a_key], [block])
        boto = s3.boto()
        obj = boto.get_object(Bucket=bucket, Key=tier.object_key(a_key))
        stored = obj["Body"].read()
        assert block[:64] not in stored and stored[:3] == b"KVS"
        assert len(stored) < len(block)  # packed before sealing
        assert [bytes(v or b"") for v in await tier.batch_load([a_key])] == [block]

        # A's object copied to B's name, checksum metadata and all: a miss
        # (B has no such key).
        boto.put_object(
            Bucket=bucket,
            Key=tier.object_key(b_key),
            Body=stored,
            Metadata={CHECKSUM_META: object_checksum(b_key, stored)},
        )
        assert await tier.batch_load([b_key]) == [None]
        # A flipped byte with the checksum forged to match: a miss.
        flipped = bytearray(stored)
        flipped[len(flipped) // 2] ^= 0x40
        boto.put_object(
            Bucket=bucket,
            Key=tier.object_key(a_key),
            Body=bytes(flipped),
            Metadata={CHECKSUM_META: object_checksum(a_key, bytes(flipped))},
        )
        assert await tier.batch_load([a_key]) == [None]
        stats = tier.stats()
        assert stats.seal_failures == failures(no_key=1, auth=1)
        assert stats.packed_in_bytes == len(block) and 0 < (stats.packed_out_bytes or 0) < len(
            block
        )
    finally:
        await tier.close()


# -- a daemon


def namespaces_toml(key: Path, old: Path | None = None) -> str:
    olds = f"encryption_old_key_files = [{str(old)!r}]\n" if old is not None else ""
    return f'[namespaces.tenant-a]\nencryption_key_file = "{key}"\n{olds}'


def test_a_daemon_refuses_to_start_without_its_key_file(sock_dir: Path) -> None:
    config = sock_dir / "kvtier.toml"
    config.write_text(namespaces_toml(sock_dir / "missing.key"))
    proc = DaemonProcess(sock_dir, "--config", str(config))
    with pytest.raises(RuntimeError, match="did not become ready"):
        proc.start()
    assert proc.wait() != 0
    output = "\n".join(proc.lines)
    assert "namespace 'tenant-a'" in output and "missing.key does not exist" in output


async def test_sighup_reads_rotated_key_files_and_old_blocks_stay_readable(
    sock_dir: Path,
) -> None:
    first = key_file(sock_dir, "first.key", KEY_OLD)
    config = sock_dir / "kvtier.toml"
    config.write_text(namespaces_toml(first))
    proc = DaemonProcess(sock_dir, "--config", str(config), "--ram-capacity", "1MiB").start()
    try:
        async with await Client.connect(proc.socket_path, namespace="tenant-a") as c:
            await c.put(b"old", b"o" * 300_000, durable=True)  # on disk under the first key
            second = key_file(sock_dir, "second.key", KEY_A)
            config.write_text(namespaces_toml(second, first))
            mark = len(proc.lines)
            proc.send_signal(signal.SIGHUP)
            proc.wait_for_line("reloaded:", mark)
            await c.put(b"new", b"n" * 300_000, durable=True)
            for i in range(8):  # RAM (1 MiB) gives both up to the disk
                await c.put(b"filler-%d" % i, b"f" * 300_000)
            assert bytes(await c.get(b"old") or b"") == b"o" * 300_000
            assert bytes(await c.get(b"new") or b"") == b"n" * 300_000
            stats = await c.stats()
        disk = stats["tiers"]["disk"]
        assert disk["opened_bytes"] >= 600_000 and disk["seal_failures"]["auth"] == 0

        bad = sock_dir / "loose.key"
        bad.write_bytes(KEY_B)
        bad.chmod(0o644)
        config.write_text(namespaces_toml(bad))
        mark = len(proc.lines)
        proc.send_signal(signal.SIGHUP)
        line = proc.wait_for_line("reload failed", mark)
        assert "kept" in line
        assert "namespace 'tenant-a'" in "\n".join(proc.lines[mark:])
        async with await Client.connect(proc.socket_path, namespace="tenant-a") as c:
            assert bytes(await c.get(b"new") or b"") == b"n" * 300_000  # the keys in force
    finally:
        assert proc.stop() == 0


def test_a_packed_block_that_would_unpack_past_the_limit_is_refused() -> None:
    s = Sealer(Keys(), Codec.ZSTD, max_block_bytes=1 << 20)
    bomb = s.seal(b"k", bytes(8 << 20))  # 8 MiB of zeros: a few hundred bytes packed
    assert len(bomb) < 4096
    with pytest.raises(SealError, match="within 1048576 bytes") as err:
        s.admit(b"k", bomb)
    assert err.value.failure is Failure.FORMAT
    assert bytes(s.admit(b"k", b"a block stored before the codec")) == (
        b"a block stored before the codec"  # headerless: plain, in a namespace without keys
    )


def test_opened_bytes_count_plain_bytes_as_sealed_bytes_do_with_a_codec() -> None:
    s = sealer({A: Keyring.of(KEY_A)}, Codec.ZSTD)
    key = ns_key(A, b"k")
    value = b"\x00\x01" * 50_000
    assert bytes(s.admit(key, s.seal(key, value))) == value
    assert s.counts.sealed_bytes == s.counts.opened_bytes == len(value)


@given(st.binary(max_size=200), st.sampled_from(Codec), st.booleans())
def test_a_value_that_begins_like_a_header_is_stored_wrapped_and_reads_as_it_was(
    tail: bytes, codec: Codec, with_key: bool
) -> None:
    s = sealer({A: Keyring.of(KEY_A)} if with_key else {}, codec)
    value = MAGIC + bytes([FORMAT_VERSION, 0, 0]) + bytes(HEADER.size) + tail
    for key in (ns_key(A, b"k"), b"plain-k"):
        stored = s.seal(key, value)
        assert stored != value and s.sealed_size(key, value) in (None, len(stored))
        assert bytes(s.admit(key, stored)) == value


def test_admit_checks_the_checksum_and_length_its_medium_kept() -> None:
    s = sealer({})
    value = b"v" * 1000
    assert bytes(s.admit(b"k", value, checksum=block_checksum(b"k", value), length=1000)) == value
    with pytest.raises(SealError) as err:
        s.admit(b"k", value, checksum=block_checksum(b"k", value) ^ 1)
    assert err.value.failure is Failure.CORRUPT
    with pytest.raises(SealError) as err:
        s.admit(b"k", value, length=1001)
    assert err.value.failure is Failure.LENGTH
    small = Sealer(Keys(), max_block_bytes=999)
    with pytest.raises(SealError) as err:
        small.admit(b"k", value)
    assert err.value.failure is Failure.LENGTH
    assert s.counts.failures[Failure.CORRUPT] == s.counts.failures[Failure.LENGTH] == 1
