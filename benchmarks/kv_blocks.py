"""Real KV blocks, for measuring codecs on them: a vLLM engine (its CPU
build, tests/e2e's tiny model) generates through kvtier, and the blocks it
stored are read back from the daemon's disk files into one file.

Runs in .venv-e2e (``make bench-encryption`` calls it), where vLLM is
installed and kvtier only as a client, so the block files are parsed here
by their documented format (docs: the disk tier's header, key, value).
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the block file's header (kvtier/tiers/disk/format.py): magic, version,
#: reserved, key length, value length, checksum
HEADER = struct.Struct("<4sBBHQQ")


def main() -> int:
    out = Path(sys.argv[1])
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("KVTIER_SERVE", str(ROOT / ".venv" / "bin" / "kvtier"))
    from tests.e2e.conftest import A, others, run
    from tests.e2e.model import make_model
    from tests.enginedaemon import start

    tmp = Path(tempfile.mkdtemp(prefix="kvt-kv-blocks-", dir="/tmp"))
    try:
        model = make_model(tmp / "tiny-llama")
        daemon = start(tmp, "--data-dir", str(tmp / "data"), "--ram-capacity", "256MiB")
        try:
            run(model, daemon.socket_path, [A, *others(8)])
        finally:
            daemon.stop()
        values = []
        for path in sorted((tmp / "data").glob("*/*.blk")):
            data = path.read_bytes()
            _magic, _version, _reserved, key_len, value_len, _digest = HEADER.unpack_from(data)
            start_at = HEADER.size + key_len
            values.append(data[start_at : start_at + value_len])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sizes = sorted({len(v) for v in values})
    out.write_bytes(b"".join(values))
    print(f"{len(values)} KV blocks of {sizes} bytes from a vLLM engine written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
