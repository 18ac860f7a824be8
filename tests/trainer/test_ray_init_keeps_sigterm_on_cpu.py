"""launch.init_ray_keeping_sigterm: Ray's driver replaces the SIGTERM handler with ``sys.exit(15)`` (exit code 15, no
line). Around ``ray.init`` the run's own handler is kept, and a SIGTERM that lands inside ``ray.init`` becomes the
start-up stop (exit 143 with its one line), not a silent exit 15. A fake ``ray`` does what Ray's driver does."""

import os
import signal
import sys

import pytest

from verl_diffusion.launch import init_ray_keeping_sigterm
from verl_diffusion.trainer.signals import StartupInterrupted


class FakeRay:
    def __init__(self, signal_during_init: bool):
        self.signal_during_init, self.shutdowns = signal_during_init, 0

    def init(self, **kwargs):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # as ray/_private/worker.py
        if self.signal_during_init:
            os.kill(os.getpid(), signal.SIGTERM)

    def shutdown(self):
        self.shutdowns += 1


@pytest.fixture
def run_handler():
    def handler(signum, frame):
        raise StartupInterrupted(signum, "start-up")

    previous = signal.signal(signal.SIGTERM, handler)
    yield handler
    signal.signal(signal.SIGTERM, previous)


def test_the_runs_handler_is_back_after_ray_init(run_handler):
    init_ray_keeping_sigterm(FakeRay(signal_during_init=False), num_cpus=1)
    assert signal.getsignal(signal.SIGTERM) is run_handler


def test_a_sigterm_inside_ray_init_is_a_start_up_stop(run_handler):
    ray = FakeRay(signal_during_init=True)
    with pytest.raises(StartupInterrupted) as e:
        init_ray_keeping_sigterm(ray, num_cpus=1)
    assert e.value.exit_code == 143 and ray.shutdowns == 1
    assert signal.getsignal(signal.SIGTERM) is run_handler
