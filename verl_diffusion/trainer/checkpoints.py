"""Checkpoint bookkeeping that survives a crash at any point.

verl's layout stays: ``<ckpt_dir>/global_step_<k>/{actor/, data.pt}`` and ``latest_checkpointed_iteration.txt``.
Added on top, trainer-independent:

* the tracker is written atomically (a temp file + ``os.replace``), so a reader sees the old or the new step,
  never an empty or half-written file;
* ``global_step_<k>/manifest.json`` lists every file of the checkpoint with its size and is written last: a
  checkpoint without it, or whose files no longer match it (a shard truncated by a full disk, a file deleted),
  is incomplete;
* :func:`find_resume_checkpoint` picks the newest complete checkpoint and names every newer one it skipped and
  why, so a damaged latest checkpoint falls back instead of crashing or silently training from scratch.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import Optional

TRACKER_NAME = "latest_checkpointed_iteration.txt"
MANIFEST_NAME = "manifest.json"
STEP_DIR_RE = re.compile(r"^global_step_(\d+)$")


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old content or the new one, never a mix."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_tracker(ckpt_dir: str, step: int) -> str:
    """verl's ``latest_checkpointed_iteration.txt``, atomically."""
    path = os.path.join(ckpt_dir, TRACKER_NAME)
    atomic_write_text(path, str(int(step)))
    return path


def read_tracker(ckpt_dir: str) -> tuple[Optional[int], Optional[str]]:
    """(step, None) from the tracker, or (None, why it is unusable); (None, None) when there is no tracker."""
    path = os.path.join(ckpt_dir, TRACKER_NAME)
    if not os.path.exists(path):
        return None, None
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError as e:
        return None, f"unreadable ({e})"
    if not text.isdigit():
        return None, f"holds {text[:40]!r}, not a step number"
    return int(text), None


def step_dir(ckpt_dir: str, step: int) -> str:
    return os.path.join(ckpt_dir, f"global_step_{int(step)}")


def file_crc32(path: str, chunk: int = 8 << 20) -> str:
    """CRC-32 of a file's bytes as 8 hex digits (zlib; about 2.4 GB/s on one core here, twice SHA-256's speed:
    docs/benchmarks.md). It catches what damages a checkpoint without changing its size (a zeroed block, a
    bit flip), which the sizes alone miss."""
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk)
            if not block:
                break
            crc = zlib.crc32(block, crc)
    return f"{crc & 0xFFFFFFFF:08x}"


def write_manifest(path: str) -> str:
    """``manifest.json`` of a finished checkpoint folder: every file under it (relative path → {size in bytes,
    crc32 of its content}).

    Call it after every file of the checkpoint is written: its presence marks the checkpoint complete.
    """
    files = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            if rel == MANIFEST_NAME or ".tmp." in name:
                continue
            files[rel] = {"size": os.path.getsize(full), "crc32": file_crc32(full)}
    out = os.path.join(path, MANIFEST_NAME)
    atomic_write_text(out, json.dumps({"files": dict(sorted(files.items()))}, indent=1))
    return out


def check_checkpoint(path: str) -> Optional[str]:
    """None when the checkpoint folder is complete (its manifest matches the files), else why not."""
    if not os.path.isdir(path):
        return "folder missing"
    mpath = os.path.join(path, MANIFEST_NAME)
    if not os.path.exists(mpath):
        return f"no {MANIFEST_NAME} (the save did not finish)"
    try:
        with open(mpath) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{MANIFEST_NAME} unreadable ({type(e).__name__})"
    if not files:
        return f"{MANIFEST_NAME} lists no files"
    for rel, entry in files.items():
        full = os.path.join(path, rel)
        if not os.path.exists(full):
            return f"{rel} missing"
        # manifests written before checksums hold the size alone
        size, crc = (entry.get("size"), entry.get("crc32")) if isinstance(entry, dict) else (entry, None)
        actual = os.path.getsize(full)
        if actual != int(size):
            return f"{rel} is {actual} bytes, {size} expected (truncated or rewritten)"
        if crc is not None and file_crc32(full) != crc:
            return f"{rel} has other content than when it was saved (crc32 mismatch: damaged on disk)"
    return None


def list_step_dirs(ckpt_dir: str) -> list[int]:
    """Steps of the ``global_step_<k>`` folders in ``ckpt_dir``, newest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    steps = [int(m.group(1)) for m in (STEP_DIR_RE.match(n) for n in os.listdir(ckpt_dir)) if m]
    return sorted(steps, reverse=True)


@dataclass
class ResumePoint:
    """The checkpoint to resume from (``step``/``path`` None: none complete) and what was passed over."""

    step: Optional[int]
    path: Optional[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)   # (path or file, why)
    existing: bool = False     # any checkpoint folder or tracker exists

    def warning(self) -> Optional[str]:
        if not self.skipped:
            return None
        what = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in self.skipped)
        target = f"resuming from {os.path.basename(self.path)}" if self.path else "no complete checkpoint left"
        return f"skipped damaged checkpoint state ({what}); {target}"


def find_resume_checkpoint(ckpt_dir: str) -> ResumePoint:
    """The newest complete ``global_step_<k>`` under ``ckpt_dir``; damaged newer ones (and a tracker that is
    unreadable or names a missing or incomplete step) are listed in ``skipped``."""
    tracked, tracker_problem = read_tracker(ckpt_dir)
    skipped: list[tuple[str, str]] = []
    if tracker_problem:
        skipped.append((os.path.join(ckpt_dir, TRACKER_NAME), tracker_problem))
    steps = list_step_dirs(ckpt_dir)
    if tracked is not None and tracked not in steps:
        skipped.append((os.path.join(ckpt_dir, TRACKER_NAME), f"names step {tracked}, whose folder is missing"))
    existing = bool(steps) or tracked is not None or tracker_problem is not None
    for step in steps:
        path = step_dir(ckpt_dir, step)
        why = check_checkpoint(path)
        if why is None:
            return ResumePoint(step, path, skipped, existing)
        skipped.append((path, why))
    return ResumePoint(None, None, skipped, existing)
