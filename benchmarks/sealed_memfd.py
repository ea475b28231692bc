"""make bench: the store path not taken, a sealed memfd per block.

A writer process hands 1 MiB blocks to a receiver process (the daemon's
part), one block a round trip over a Unix socket; the receiver keeps the
last 512 it was given (a full store: each new block lets the oldest go).
Ways of handing a block over, each timed in turn over five rounds:

- ``slot``: the writer copies the block into a slot of a memory file both
  map (the receiver made it) and sends the slot's number: kvtier's write
  in place (docs/shared-memory.md, 4.).
- ``memfd, mapped``: a memory file per block (``memfd_create``,
  ``ftruncate``), the block copied into a mapping of it, the mapping
  dropped, the file sealed against writes and resizing (``F_SEAL_WRITE``
  refuses while a writable mapping lives) and its descriptor sent
  (SCM_RIGHTS); the receiver checks the seals and maps it read-only.
- ``memfd, pwrite``: the same with the block written by ``pwrite``, no
  mapping on the writer's side.
- ``memcpy``: the block copied into the next of a ring of 512 buffers, in
  the writer's process: the floor.

Prints each way's median GB/s and its ratio to ``slot``.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

MiB = 1024 * 1024
BLOCK = MiB
KEPT = 512
BLOCKS_PER_RUN = 1000
ROUNDS = 5
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_SLOT = struct.Struct("<Q")


def receive(path: str) -> None:
    """The receiver: first hands out its arena, then takes blocks until EOF."""
    arena_fd = os.memfd_create("arena")
    os.ftruncate(arena_fd, KEPT * BLOCK)
    arena = mmap.mmap(arena_fd, KEPT * BLOCK)
    arena.madvise(mmap.MADV_WILLNEED)
    for offset in range(0, KEPT * BLOCK, mmap.PAGESIZE):  # a full store's pages
        arena[offset] = 1
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        conn, _ = listener.accept()
    socket.send_fds(conn, [b"a"], [arena_fd])
    kept: deque[mmap.mmap] = deque()
    while True:
        msg, fds, _, _ = socket.recv_fds(conn, _SLOT.size, 1)
        if not msg:
            return
        if fds:  # a block in a file of its own
            (fd,) = fds
            try:
                if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
                    raise SystemExit("a block's file is not sealed")
                kept.append(mmap.mmap(fd, os.fstat(fd).st_size, prot=mmap.PROT_READ))
            finally:
                os.close(fd)
            if len(kept) > KEPT:
                kept.popleft().close()
        conn.send(b"k")


def main() -> int:
    value = bytes(range(256)) * (BLOCK // 256)
    with tempfile.TemporaryDirectory(prefix="kvt-memfd-", dir="/tmp") as tmp:
        path = str(Path(tmp) / "receiver.sock")
        receiver = subprocess.Popen([sys.executable, "-m", "benchmarks.sealed_memfd", path])
        try:
            while not os.path.exists(path):
                time.sleep(0.01)  # allow-sleep: waiting for the receiver's socket
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(path)
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            arena = memoryview(mmap.mmap(fds[0], KEPT * BLOCK))
            os.close(fds[0])
            for offset in range(0, KEPT * BLOCK, 64 * 1024):  # mapped, as a writer's long run has
                arena[offset]
            ring = [memoryview(bytearray(b"\x01" * BLOCK)) for _ in range(KEPT)]

            def slot(i: int) -> None:
                at = (i % KEPT) * BLOCK
                arena[at : at + BLOCK] = value
                sock.send(_SLOT.pack(i % KEPT))
                sock.recv(1)

            def sealed(write: Callable[[int], None]) -> Callable[[int], None]:
                def run(_i: int) -> None:
                    fd = os.memfd_create("block", os.MFD_ALLOW_SEALING | os.MFD_CLOEXEC)
                    try:
                        os.ftruncate(fd, BLOCK)
                        write(fd)
                        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
                        socket.send_fds(sock, [_SLOT.pack(0)], [fd])
                    finally:
                        os.close(fd)
                    sock.recv(1)

                return run

            def mapped(fd: int) -> None:
                with mmap.mmap(fd, BLOCK) as m:
                    m[:] = value

            def pwrite(fd: int) -> None:
                os.pwrite(fd, value, 0)

            def memcpy(i: int) -> None:
                ring[i % KEPT][:] = value

            ways: dict[str, Callable[[int], None]] = {
                "slot": slot,
                "memfd, mapped": sealed(mapped),
                "memfd, pwrite": sealed(pwrite),
                "memcpy": memcpy,
            }
            rates: dict[str, list[float]] = {name: [] for name in ways}
            for round_ in range(ROUNDS + 1):  # the first warms up
                for name, way in ways.items():
                    started = time.perf_counter()
                    for i in range(BLOCKS_PER_RUN):
                        way(i)
                    elapsed = time.perf_counter() - started
                    if round_:
                        rates[name].append(BLOCKS_PER_RUN * BLOCK / elapsed / 1e9)
            sock.close()
        finally:
            receiver.wait(timeout=30)
    base = statistics.median(rates["slot"])
    print("Store path, 1 MiB blocks      GB/s   x slot")
    for name, runs in rates.items():
        rate = statistics.median(runs)
        print(f"{name:28s} {rate:6.2f}   {rate / base:5.2f}x")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 2:
        receive(sys.argv[1])
        sys.exit(0)
    sys.exit(main())
