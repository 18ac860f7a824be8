"""How the suite splits over pytest-xdist workers (`make test`: ``-n 2 --dist loadgroup``).

Each test module is one unit of work, so a module-scoped fixture (a tiny model, a worker subprocess) is built once
and not once per worker. The e2e trainings are the long pole: the modules that read the shared Ray session
(``SESSION_CASES``, tests/e2e/conftest.py) are one unit, the default shapes run (tests/e2e/test_default_run_on_cpu.py)
another, and both go first, so that they start at once and the unit modules fill the workers around them. A unit test
runs on about one core, an e2e training on a bit more than one (1.37 of 2 busy on average over the Ray session,
measured), so on a 2-core machine the two kinds overlap. The units come from node ids (our scheduler below), not
from xdist_group markers: xdist 3.8 renames node ids to group them, which pytest 9.2 no longer lets it do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parent / "e2e"
# node-id paths (relative to the rootdir) of the modules that share the e2e Ray session
SESSION_MODULES = frozenset(f"tests/e2e/{p.name}" for p in sorted(E2E.glob("test_*.py"))
                            if "SESSION_CASES" in p.read_text())


def work_unit(nodeid: str) -> str:
    """The scheduling unit of a test: its module, or "e2e_session" for every module of the shared Ray session."""
    module = nodeid.split("::", 1)[0]
    return "e2e_session" if module in SESSION_MODULES else module


def _rank(nodeid: str) -> int:
    unit = work_unit(nodeid)
    return 0 if unit == "e2e_session" else 1 if unit.startswith("tests/e2e/") else 2


def pytest_collection_modifyitems(config, items):
    # stable: the e2e units first, everything else in its order
    items.sort(key=lambda item: _rank(item.nodeid))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    # keep the collection's order (e2e first) instead of xdist's largest-unit-first
    config.option.loadscopereorder = False
    return ModuleUnits(config, log)
