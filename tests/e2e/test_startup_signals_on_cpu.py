"""SIGTERM / SIGINT before the training loop (start-up, the step-0 validation) stop the run at once with one line and
the shell's code (143 / 130), Ray shut down, no traceback and no Ray stack dump, on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest


def _start(tmp_path, *overrides):
    env = dict(os.environ, VERL_PLATFORM="cpu", VERL_DIFFUSION_RUN_ROOT=str(tmp_path), PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name", "tiny_cpu",
                             "trainer.total_training_steps=2", *overrides], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _signal_at(proc, marker: str, signum: int, timeout: float = 600):
    """Send ``signum`` once stdout shows ``marker``; returns (rc, stdout, stderr)."""
    out: list[str] = []
    err: list[str] = []
    t = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    t.start()
    deadline = time.time() + timeout
    for line in proc.stdout:
        out.append(line)
        if marker in line:
            proc.send_signal(signum)
            break
        assert time.time() < deadline, "".join(out)[-2000:]
    out.extend(proc.stdout)
    rc = proc.wait(timeout=300)
    t.join(timeout=60)
    return rc, "".join(out), "".join(err)


@pytest.mark.parametrize("marker,signum,during", [
    ("run dir:", signal.SIGTERM, "start-up"),
    ("validation step 0: sampling", signal.SIGINT, "the step-0 validation"),
])
def test_a_signal_before_the_loop_stops_with_one_line(tmp_path, marker, signum, during):
    # a step-0 validation long enough to be interrupted inside it (256 images of 40 ODE steps)
    proc = _start(tmp_path, "trainer.test_freq=2", "trainer.val_num_images=256",
                  "actor_rollout_ref.rollout.val_num_steps=40")
    try:
        rc, out, err = _signal_at(proc, marker, signum)
    finally:
        if proc.poll() is None:
            proc.kill()
    name = signal.Signals(signum).name
    assert rc == 128 + signum, (rc, out[-2000:], err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"stopped by {name} during {during}: nothing new to save"), err
    assert "Traceback" not in out + err and "step 1/2" not in out
