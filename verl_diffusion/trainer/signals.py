"""Graceful stop on SIGTERM / SIGINT in the driver.

Slurm and Kubernetes send SIGTERM before killing a job; Ctrl-C sends SIGINT. The first signal only sets a
flag: the training loop finishes the step in flight, saves a checkpoint, flushes the metrics and exits with
128 + the signal number (143 for SIGTERM, 130 for SIGINT), as shells report a signal death. A second signal
restores the default handler and re-raises it, for a user who does not want to wait.
"""

from __future__ import annotations

import signal
import threading
from typing import Optional

HANDLED = (signal.SIGTERM, signal.SIGINT)

# What the process is doing outside the training loop, for the line a start-up signal prints (set by the trainer).
phase = "start-up"


class StartupInterrupted(BaseException):
    """SIGTERM / SIGINT outside the training loop (start-up, the step-0 validation, the end): nothing is saved
    then, so the process stops at once. A BaseException, like KeyboardInterrupt, so that no ``except Exception``
    on the way (hydra's, Ray's) turns it into a traceback; ``finally`` blocks still run (Ray is shut down)."""

    def __init__(self, signum: int, during: str):
        self.signum, self.during = int(signum), during
        super().__init__(f"stopped by {signal.Signals(signum).name} during {during}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def startup_interruption(exc: BaseException) -> Optional[StartupInterrupted]:
    """The :class:`StartupInterrupted` that ``exc`` was raised from or while handling (its ``__cause__`` /
    ``__context__`` chain), else None. A handler that raises while a C function runs can surface as another
    exception: CPython reports "SystemError: <function> returned a result with an exception set", the interruption
    its cause."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, StartupInterrupted):
            return e
        seen.add(id(e))
        todo += [e.__context__, e.__cause__]
    return None


def install_startup_handlers() -> None:
    """From the first line of ``main``: SIGTERM / SIGINT raise :class:`StartupInterrupted` in the main thread
    (the training loop's :class:`GracefulStop` takes over while it runs, and restores these after)."""
    def stop(signum, frame):
        raise StartupInterrupted(signum, phase)

    if threading.current_thread() is threading.main_thread():
        for s in HANDLED:
            signal.signal(s, stop)


class StopRequested(Exception):
    """Raised by the loop after it saved its state because a signal asked it to stop."""

    def __init__(self, signum: int, step: int):
        self.signum, self.step = int(signum), int(step)
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class GracefulStop:
    """Context manager: while active, SIGTERM / SIGINT set :attr:`signum` instead of killing the process.

    Installs handlers only from the main thread (Python's rule); elsewhere it is inert.
    """

    def __init__(self, on_signal=None):
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}
        self._on_signal = on_signal

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is not None:         # second signal: the default action, now
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.signum = signum
        if self._on_signal is not None:
            self._on_signal(signum)

    def __enter__(self) -> "GracefulStop":
        if threading.current_thread() is threading.main_thread():
            for s in HANDLED:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()
