"""The wheel carries what a pip user needs: recipes, data scripts, the export and sample commands.

Builds the wheel, unpacks it into a scratch folder and runs from another scratch directory with that folder first on
PYTHONPATH (the checkout's editable install comes after it, and the test checks that the wheel's copy is the one
imported): a recipe resolves by name, a data script writes parquet, ``--list-recipes`` lists every recipe.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(REPO)],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        pytest.skip(f"pip could not build the wheel here (needs setuptools>=77 from the package index): "
                    f"{res.stderr.strip()[-300:]}")
    whl = next(out.glob("verl_diffusion-*.whl"))
    names = set(zipfile.ZipFile(whl).namelist())
    site = out / "site"
    zipfile.ZipFile(whl).extractall(site)
    return names, site


def _run(site, cwd, *args):
    env = dict(os.environ, PYTHONPATH=str(site), VERL_PLATFORM="cpu")
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_wheel_contents(wheel_site):
    names, _ = wheel_site
    recipes = sorted(p.name for p in (REPO / "verl_diffusion" / "recipes").glob("*.yaml"))
    for name in recipes:
        assert f"verl_diffusion/recipes/{name}" in names, name
    for path in ("verl_diffusion/recipes/common/sd35_medium.yaml", "verl_diffusion/data_process/ocr.py",
                 "verl_diffusion/data_process/shapes.py", "verl_diffusion/data_process/geneval.py",
                 "verl_diffusion/data_process/pickscore.py", "verl_diffusion/export/__main__.py",
                 "verl_diffusion/sample.py", "verl_diffusion/assets/shapes_sd3/model_index.json"):
        assert path in names, path


def test_recipe_and_data_script_from_a_scratch_directory(wheel_site, tmp_path):
    _, site = wheel_site
    res = _run(site, tmp_path, "-c", "import verl_diffusion; print(verl_diffusion.__file__)")
    assert res.stdout.strip().startswith(str(site)), res.stdout     # the wheel's copy, not the checkout's
    res = _run(site, tmp_path, "-m", "verl_diffusion.main_flowgrpo", "--config-name", "sd35_ocr_flowgrpo", "--cfg", "job")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "loss_mode: flow_grpo" in res.stdout and "lora_rank: 32" in res.stdout
    sample = REPO / "data_process" / "samples" / "ocr" / "test.txt"
    res = _run(site, tmp_path, "-m", "verl_diffusion.data_process.ocr", "--test", str(sample), "--output", "ocr_data")
    assert res.returncode == 0, res.stderr[-2000:]
    assert (tmp_path / "ocr_data" / "test.parquet").is_file()
    res = _run(site, tmp_path, "-m", "verl_diffusion.main_flowgrpo", "--list-recipes")
    assert res.returncode == 0, res.stderr[-2000:]
    listed = [line.split()[0] for line in res.stdout.splitlines()[1:] if line.strip() and not line.startswith(" ")]
    assert listed == sorted(p.stem for p in (REPO / "verl_diffusion" / "recipes").glob("*.yaml"))
