"""The benchmark scripts are files, not a package: a test loads one by its path (benchmarks/<name>.py)."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # registered under its name, so that its dataclasses and pickles resolve
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def load_benchmark():
    """load_benchmark(name) -> benchmarks/<name>.py as a module."""
    return _load
