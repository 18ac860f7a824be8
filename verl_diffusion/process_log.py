"""Where a process's output goes: the driver's console also into the run directory's ``run.log``
(:func:`tee_output`), a Ray worker's output into a log file instead of the console (:func:`redirect_process_output`)."""

from __future__ import annotations

import contextlib
import os


class _Tee:
    """A text stream writing to the console stream and to a log file."""

    def __init__(self, stream, log):
        self.stream, self.log = stream, log

    def write(self, text):
        self.log.write(text)
        return self.stream.write(text)

    def flush(self):
        self.log.flush()
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


@contextlib.contextmanager
def tee_output(path: str):
    """Inside: this process's stdout and stderr also go to ``path`` (appended, a header line per start), so a run's
    console survives in its run directory."""
    import datetime
    import sys

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a", buffering=1) as log:
        log.write(f"=== {datetime.datetime.now().isoformat(timespec='seconds')} {' '.join(sys.argv)}\n")
        out, err = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(out, log), _Tee(err, log)
        try:
            yield path
        finally:
            sys.stdout, sys.stderr = out, err


def redirect_process_output(path: str) -> str:
    """This process's file descriptors 1 and 2 (Python's prints and C libraries' output alike) appended to ``path``:
    a Ray worker's output in the run directory instead of the driver's console."""
    import sys

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path
