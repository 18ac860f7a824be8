"""A start-up signal that surfaces as another exception still stops the run as the signal does.

The start-up handler raises StartupInterrupted in the main thread; when the signal lands inside a C function, CPython
reports "SystemError: <function> returned a result with an exception set" with the interruption as its cause, and
hydra would turn that into a traceback and exit code 1. The entry point finds the interruption in the chain.
"""

from __future__ import annotations

import signal
import sys

import pytest

from verl_diffusion import main_flowgrpo
from verl_diffusion.trainer.signals import HANDLED, StartupInterrupted, startup_interruption


def _raised(make):
    try:
        make()
    except BaseException as e:  # noqa: BLE001  (the test inspects what was raised)
        return e
    raise AssertionError("nothing raised")


def _system_error_from(interrupted):
    def make():
        try:
            raise interrupted
        except StartupInterrupted as e:
            raise SystemError("<built-in method get> returned a result with an exception set") from e
    return make


def test_the_interruption_is_found_through_cause_and_context():
    stop = StartupInterrupted(signal.SIGINT, "the step-0 validation")
    assert startup_interruption(stop) is stop
    assert startup_interruption(_raised(_system_error_from(stop))) is stop

    def while_handling():                       # __context__ only, two levels down
        try:
            _system_error_from(stop)()
        except SystemError:
            raise RuntimeError("during cleanup")
    err = _raised(while_handling)
    assert err.__cause__ is None and startup_interruption(err) is stop

    def other_cause_while_handling():           # raised from another error while handling the interruption
        try:
            raise stop
        except StartupInterrupted:
            raise SystemError("wrapped") from KeyError("k")
    assert startup_interruption(_raised(other_cause_while_handling)) is stop

    assert startup_interruption(ValueError("unrelated")) is None
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a        # a cycle ends the walk
    assert startup_interruption(a) is None


def _main_with(monkeypatch, tmp_path, exc):
    def fail(cfg):
        raise exc
    monkeypatch.setattr(main_flowgrpo, "run_flowgrpo", fail)
    monkeypatch.setattr(sys, "argv", ["main_flowgrpo", "--config-name", "tiny_cpu", f"trainer.run_dir={tmp_path}"])
    saved = {s: signal.getsignal(s) for s in HANDLED}
    try:
        with pytest.raises(SystemExit) as stopped:
            main_flowgrpo.main()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    return stopped.value.code


def test_main_exits_130_with_one_line_when_the_interruption_surfaces_as_a_system_error(monkeypatch, tmp_path, capsys):
    stop = StartupInterrupted(signal.SIGINT, "the step-0 validation")
    code = _main_with(monkeypatch, tmp_path, _raised(_system_error_from(stop)))
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert code == 130
    assert len(err) == 1 and err[0].startswith("stopped by SIGINT during the step-0 validation: nothing new to save")


def test_an_unrelated_error_still_fails_as_an_error(monkeypatch, tmp_path, capsys):
    code = _main_with(monkeypatch, tmp_path, SystemError("a real bug"))
    assert code == 1 and "a real bug" in capsys.readouterr().err
