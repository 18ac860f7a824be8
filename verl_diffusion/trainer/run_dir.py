"""The run directory: what a run finds there decides what it does, and nothing is lost.

Layout (``trainer.run_dir``, default ``./outputs/<experiment_name>`` under the working directory)::

    metrics.jsonl        one JSON row per step, appended and flushed every step (survives a kill)
    reward_curve.png     redrawn at every validation from metrics.jsonl (so it spans resumes)
    before_after.png     the first validation vs the latest, redrawn at every validation
    validation/          step_<k>.png grids; baseline.pt = the first validation's images (uint8), kept for
                         before/after across resumes
    run_state.json       {"status": "finished" | "stopped", "step": k, ...}, written atomically
    run.log              everything the driver printed (appended, a header per start); logs/worker_<rank>.log:
                         each Ray worker's own output (model loading, verl's lines, warnings)
    model/               the trained model in a format stock diffusers loads (export/writer.py)
    checkpoints/         trainer.default_local_dir (verl's global_step_<k> layout), see checkpoints.py

:func:`plan_run` looks at that state before any Ray worker starts and returns one of: a new run, a resume
(from the newest complete checkpoint), or "already finished" (exit 0, touch nothing). A run directory that
holds an earlier run's outputs and nothing to resume from is refused with one line naming
``trainer.overwrite=true``: a new run never destroys an old run's files unless asked.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Any, Optional

from verl_diffusion.trainer.checkpoints import ResumePoint, atomic_write_text, check_checkpoint, find_resume_checkpoint

METRICS_NAME = "metrics.jsonl"
RUN_LOG_NAME = "run.log"
WORKER_LOG_DIR = "logs"
STATE_NAME = "run_state.json"
BASELINE_NAME = os.path.join("validation", "baseline.pt")
OUTPUT_NAMES = (METRICS_NAME, STATE_NAME, "reward_curve.png", "before_after.png", "validation", RUN_LOG_NAME,
                WORKER_LOG_DIR, "model")


class RunDirError(ValueError):
    """The run directory holds something this run must not overwrite; the message is one line."""


@dataclass
class RunPlan:
    action: str                             # "new" | "resume" | "finished"
    run_dir: str
    ckpt_dir: str
    resume: Optional[ResumePoint] = None
    message: str = ""                       # the line to print (finished) or a warning (resume fell back)
    finished_step: Optional[int] = None


def read_run_state(run_dir: str) -> dict:
    path = os.path.join(run_dir, STATE_NAME)
    try:
        with open(path) as f:
            state = json.load(f)
        return state if isinstance(state, dict) else {}
    except (OSError, ValueError):
        return {}


def write_run_state(run_dir: str, status: str, step: int, **extra: Any) -> str:
    path = os.path.join(run_dir, STATE_NAME)
    atomic_write_text(path, json.dumps({"status": status, "step": int(step), **extra}) + "\n")
    return path


def _metrics_steps(run_dir: str) -> int:
    return len(MetricsLog(os.path.join(run_dir, METRICS_NAME)).rows())


def _has_outputs(run_dir: str) -> bool:
    if _metrics_steps(run_dir):
        return True
    val = os.path.join(run_dir, "validation")
    return os.path.isdir(val) and bool(os.listdir(val))


def plan_run(run_dir: str, ckpt_dir: str, *, total_steps: int, resume_mode: str = "auto",
             resume_from_path: Optional[str] = None, overwrite: bool = False) -> RunPlan:
    """What this run does with ``run_dir`` / ``ckpt_dir`` (see the module docstring). Raises RunDirError."""
    if overwrite:
        return RunPlan("new", run_dir, ckpt_dir, message="trainer.overwrite=true: replacing the earlier run's outputs")
    state = read_run_state(run_dir)
    if state.get("status") == "finished" and int(state.get("step", -1)) >= total_steps:
        step = int(state["step"])
        more = ("a larger trainer.total_training_steps (resumes from its last checkpoint), "
                if find_resume_checkpoint(ckpt_dir).path else "")
        return RunPlan("finished", run_dir, ckpt_dir, finished_step=step,
                       message=f"this run already finished at step {step}: outputs in {run_dir} (metrics.jsonl, "
                               f"reward_curve.png, before_after.png); nothing to do. To train more pass {more}"
                               "trainer.overwrite=true (replaces it) or another trainer.experiment_name")
    if resume_mode == "resume_path":
        path = os.path.abspath(str(resume_from_path or ""))
        why = check_checkpoint(path)
        if why is not None:
            raise RunDirError(f"trainer.resume_from_path={resume_from_path!r} is not a complete checkpoint ({why})")
        step = int(os.path.basename(path.rstrip("/")).split("global_step_")[-1])
        return RunPlan("resume", run_dir, ckpt_dir, resume=ResumePoint(step, path))
    point = find_resume_checkpoint(ckpt_dir)
    replace = ("pass trainer.overwrite=true to replace it, or choose another trainer.experiment_name / "
               "trainer.run_dir")
    if resume_mode == "disable":
        if point.existing or _has_outputs(run_dir):
            raise RunDirError(f"{run_dir} holds an earlier run and trainer.resume_mode=disable would train from "
                              f"scratch over it; {replace}")
        return RunPlan("new", run_dir, ckpt_dir)
    if resume_mode != "auto":
        raise RunDirError(f"trainer.resume_mode={resume_mode!r} is unknown; choose auto, disable or resume_path")
    if point.path is not None:
        if point.step >= total_steps:
            return RunPlan("finished", run_dir, ckpt_dir, resume=point, finished_step=point.step,
                           message=f"this run is already trained to step {point.step} (checkpoint {point.path}; "
                                   f"trainer.total_training_steps={total_steps}): outputs in {run_dir}; nothing to "
                                   "do. Raise trainer.total_training_steps to continue it")
        return RunPlan("resume", run_dir, ckpt_dir, resume=point, message=point.warning() or "")
    if point.existing:
        raise RunDirError(f"{ckpt_dir} has checkpoints but none is complete ({point.warning()}); refusing to train "
                          f"from scratch over them: {replace}")
    if _has_outputs(run_dir):
        n = _metrics_steps(run_dir)
        raise RunDirError(f"{run_dir} holds the outputs of an earlier run ({n} steps in {METRICS_NAME}) and no "
                          f"checkpoint to resume from; {replace}")
    return RunPlan("new", run_dir, ckpt_dir)


def clear_outputs(run_dir: str, ckpt_dir: str) -> list[str]:
    """trainer.overwrite=true: remove the earlier run's outputs and checkpoints (the tiny model, if any, stays)."""
    removed = []
    for name in OUTPUT_NAMES:
        path = os.path.join(run_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
        else:
            continue
        removed.append(path)
    if os.path.isdir(ckpt_dir):
        shutil.rmtree(ckpt_dir)
        removed.append(ckpt_dir)
    return removed


class MetricsLog:
    """``metrics.jsonl``: one row per step, appended and flushed as each step ends.

    On resume from step k, rows after k (steps the killed run did after its checkpoint) are dropped, since the
    resumed run logs those steps again; rows up to k stay, so the file covers the whole run.
    """

    def __init__(self, path: str):
        self.path = path

    def rows(self) -> list[dict]:
        if not os.path.exists(self.path):
            return []
        out = []
        with open(self.path) as f:
            for line in f:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue    # a line cut by a kill mid-write
                if isinstance(row, dict):
                    out.append(row)
        return out

    def keep_until(self, step: int) -> int:
        """Drop rows with ``step`` > ``step`` (atomically). Returns the rows kept."""
        rows = [r for r in self.rows() if int(r.get("step", 0)) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))
        return len(rows)

    def append(self, row: dict) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        clean = {k: v for k, v in row.items() if isinstance(v, (int, float, str, bool))}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
            f.flush()
            os.fsync(f.fileno())


LOCK_NAME = ".run.lock"


class RunDirLock:
    """An OS file lock on ``<run_dir>/.run.lock`` held for the life of a run (``fcntl.flock``): a second run into the
    same directory is refused with one line naming the process that holds it; the kernel drops the lock when that
    process ends in any way (crash, kill -9), so a stale lock file never blocks a resume. The file records the
    holder (pid, host, command, start time) for that message."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, LOCK_NAME)
        self._fd: Optional[int] = None

    def acquire(self) -> "RunDirLock":
        import fcntl
        import socket
        import sys
        import time

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirError(f"{os.path.dirname(self.path)} is in use by another run ({holder}); wait for it to end, "
                              "or give this run another trainer.experiment_name / trainer.run_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "argv": sys.argv,
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)      # closing the descriptor drops the lock
            self._fd = None

    def __enter__(self) -> "RunDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 65536, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    if not info:
        return "a process that is still starting"
    cmd = " ".join(str(a) for a in info.get("argv", []))[:120]
    return f"process {info.get('pid')} on {info.get('host')}, started {info.get('started')}: {cmd}"


class StorageError(RuntimeError):
    """A save failed for lack of space or write permission; the message is one line naming the path and cause."""


def storage_problem(path: str) -> Optional[str]:
    """Why ``path``'s file system refuses writes, judged from the file system itself (a failed ``torch.save``
    reports only "iostream error" / "file write failed", without the errno): "No space left on device",
    "read-only file system", "permission denied", or None when it looks writable."""
    probe = path
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not probe:
        return None
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return e.strerror
    if st.f_flag & os.ST_RDONLY:
        return "read-only file system"
    if st.f_bavail * st.f_frsize < 1 << 20:
        return "No space left on device"
    if not os.access(probe, os.W_OK):
        return "permission denied"
    return None


def as_storage_error(exc: BaseException, path: str, what: str) -> Optional[StorageError]:
    """A :class:`StorageError` for ``exc`` when it came from the storage at ``path`` (an OSError of ENOSPC / EROFS /
    EACCES / EDQUOT anywhere in its chain, Ray task errors included, or a file system that now refuses writes);
    None for anything else."""
    import errno

    codes = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in codes:
            return StorageError(f"{what} failed: {e.filename or path}: {e.strerror}")
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    problem = storage_problem(path)
    if problem:
        return StorageError(f"{what} failed: {path}: {problem}")
    return None
