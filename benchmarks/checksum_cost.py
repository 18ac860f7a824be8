"""Cost of a checkpoint manifest's per-file checksum (trainer/checkpoints.py uses CRC-32): MB/s of CRC-32, SHA-256
and BLAKE2b over one file on this machine, and the resulting seconds per GB of checkpoint.

    python benchmarks/checksum_cost.py [--mb 256]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
import zlib


def rate(path: str, name: str) -> float:
    start = time.perf_counter()
    with open(path, "rb") as f:
        if name == "crc32":
            crc = 0
            while block := f.read(8 << 20):
                crc = zlib.crc32(block, crc)
        else:
            h = hashlib.new(name)
            while block := f.read(8 << 20):
                h.update(block)
    return os.path.getsize(path) / 2 ** 20 / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    args = ap.parse_args()
    with tempfile.NamedTemporaryFile(delete=False) as f:
        for _ in range(args.mb):
            f.write(os.urandom(2 ** 20))
        path = f.name
    try:
        rate(path, "crc32")   # page cache warm: the manifest reads files the save just wrote
        print(f"| checksum | MB/s | s per GB |  ({args.mb} MB file, page cache warm)")
        print("|---|---|---|")
        for name in ("crc32", "sha256", "blake2b"):
            r = rate(path, name)
            print(f"| {name} | {r:.0f} | {1024 / r:.2f} |")
    finally:
        os.remove(path)


if __name__ == "__main__":
    main()
