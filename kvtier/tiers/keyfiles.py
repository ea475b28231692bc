"""Encryption key files: read, checked and made into a namespace's keyring.

The acting half of :mod:`kvtier.tiers.sealing` (which only computes). A
key file holds 32 bytes of key material: raw, or as 64 hex digits, or in
base64 (text may end in a newline). It must be a regular file that neither
group nor others may read or write (mode 600 or 400): a key the whole
node can read protects nothing. Every refusal is a
:class:`~kvtier.errors.ConfigError` naming the namespace and the file: the
start (or the reload) fails with it, and a reload keeps the keys in force.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from collections.abc import Sequence
from pathlib import Path

from kvtier.errors import ConfigError
from kvtier.tiers.sealing import KEY_BYTES, Keyring


def read_key_file(path: Path, namespace: str) -> bytes:
    """The key material in ``path`` (see the module)."""
    where = f"namespace {namespace!r}: encryption key file {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{where} cannot be opened: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{where} is not a regular file")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"{where} may be read or written by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}); make it 600: chmod 600 {path}"
            )
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(data) == KEY_BYTES:
        return data
    text = data.strip()
    for decode in (bytes.fromhex, base64.b64decode):
        try:
            material = decode(text.decode("ascii"))
        except (ValueError, binascii.Error, UnicodeDecodeError):
            continue
        if len(material) == KEY_BYTES:
            return material
    raise ConfigError(
        f"{where} does not hold a {KEY_BYTES}-byte key (raw, {2 * KEY_BYTES} hex digits, or base64)"
    )


def read_keyring(namespace: str, current: Path, older: Sequence[Path] = ()) -> Keyring:
    """A namespace's keyring from its files: the current key, then the older ones it still reads."""
    return Keyring.of(
        read_key_file(current, namespace), *(read_key_file(p, namespace) for p in older)
    )
