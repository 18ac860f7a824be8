"""One Ray session for the in-process trainings of every e2e test module in this pytest run.

A test module lists its trainings in ``SESSION_CASES`` (specs of tests/e2e/session_smoke.py) and reads its rows from
the ``session_runs`` fixture, keyed by (kind, key). The fixture gathers the cases of the modules whose tests were
selected, runs them all in one subprocess (the platform is chosen before verl is first imported, which a pytest
process that already imported verl cannot guarantee) and so pays the Python start, the verl import and ray.init
once instead of once per module (tests/e2e/session_smoke.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def session_runs(request) -> dict:
    """Every selected module's SESSION_CASES, trained in one subprocess; {(kind, key): row}."""
    modules = sorted({item.module for item in request.session.items if getattr(item, "module", None) is not None
                      and hasattr(item.module, "SESSION_CASES")}, key=lambda m: m.__name__)
    specs = [spec for m in modules for spec in m.SESSION_CASES]
    env = dict(os.environ, VERL_PLATFORM="cpu", OMP_NUM_THREADS="1", RAY_DEDUP_LOGS="1")
    res = subprocess.run([sys.executable, str(HERE / "session_smoke.py"), *(json.dumps(s) for s in specs)],
                         capture_output=True, text=True, env=env, timeout=3000)
    rows = [json.loads(line[len("RESULT "):]) for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and len(rows) == len(specs), (res.stdout[-3000:], res.stderr[-5000:])
    return {(r["kind"], r["key"]): r for r in rows}
