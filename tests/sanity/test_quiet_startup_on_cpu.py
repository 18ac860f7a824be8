"""A new user's first run prints no alarming line that is not a problem (issue 12 item 14): verl's platform
fallback on a CPU host, libnuma affinity failures, diffusers' "kept in float32: []", transformers' torchvision
notices, setuptools' deprecated license table."""

import logging
import os
import tomllib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CPU_HOST = not torch.cuda.is_available() and not os.path.exists("/dev/nvidia0")


@pytest.mark.skipif(not CPU_HOST, reason="the fallback explanation is for hosts without an accelerator")
def test_cpu_host_import_explains_the_platform_fallback_and_drops_torchvision_notices(fresh_import_verl):
    """A fresh ``import verl`` with VERL_PLATFORM unset, then transformers' image processors and diffusers' SD3 pipeline
    (tests/sanity/conftest.py; the same process checks the registrations in test_layout_on_cpu.py)."""
    res = fresh_import_verl
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-2000:]
    err = res.stderr
    assert "Falling back to 'nvidia'" not in err and "is registered but not available" not in err, err
    assert err.count("verl found no GPU/NPU and VERL_PLATFORM is unset") == 1, err
    assert "set VERL_PLATFORM=cpu" in err
    assert "requires torchvision" not in err, err


@pytest.mark.skipif(not CPU_HOST, reason="on a GPU host the check uses the GPU platform")
def test_check_command_selects_cpu_first_and_prints_no_fallback(check_command):
    res = check_command     # VERL_PLATFORM unset (tests/sanity/conftest.py; test_layout_on_cpu.py reads it too)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "  platform:cpu" in res.stdout
    out = res.stdout + res.stderr
    assert "Falling back" not in out and "no GPU/NPU" not in out and "registered but not available" not in out, out


def test_numa_affinity_is_skipped_on_the_cpu_platform(capsys, monkeypatch):
    import verl.workers.engine_workers as engine_workers

    from verl_diffusion.workers.platform_cpu import skip_gpu_numa_affinity

    stock = engine_workers.set_numa_affinity
    monkeypatch.setattr(engine_workers, "set_numa_affinity", stock)  # restored after the test
    skip_gpu_numa_affinity("cuda")
    assert engine_workers.set_numa_affinity is stock  # a GPU platform keeps verl's affinity
    skip_gpu_numa_affinity("cpu")
    engine_workers.set_numa_affinity()
    assert "NUMA" not in capsys.readouterr().out


def test_transformer_loads_in_its_dtype_without_the_fp32_modules_warning(tmp_path, caplog):
    from verl_diffusion.models.tiny import save_tiny_sd3
    from verl_diffusion.workers.engine import load_transformer

    path = str(save_tiny_sd3(tmp_path / "tiny"))
    for dtype in (torch.float32, torch.bfloat16):
        with caplog.at_level(logging.WARNING):
            module = load_transformer(path, "transformer", dtype)
        assert {p.dtype for p in module.parameters()} == {dtype}
    assert not [r for r in caplog.records if "should be kept in float32" in r.getMessage()]


def test_pyproject_license_is_an_spdx_string():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert meta["project"]["license"] == "Apache-2.0"
    assert any(r.replace(" ", "").startswith("setuptools>=77") for r in meta["build-system"]["requires"])


def test_torchdata_set_vital_notice_is_dropped_and_other_user_warnings_are_kept():
    """torchdata's StatefulDataLoader (the trainer's prompt loader) warns about its own deprecated set_vital call on
    every new iterator; the plugin drops that one message only."""
    import warnings

    from torchdata.stateful_dataloader import StatefulDataLoader

    from verl_diffusion.notices import install_notice_filters

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        install_notice_filters()
        list(StatefulDataLoader(list(range(4)), batch_size=2, num_workers=0))
        warnings.warn("an unrelated user warning", UserWarning)
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if "set_vital" in m], messages
    assert "an unrelated user warning" in messages


def test_v1_trainer_starts_without_the_legacy_trainer_deprecation():
    """verl 0.9.1 warns "Legacy trainer is deprecated" whenever its RayPPOTrainer is built; ours is the V1 sync
    trainer, built here from the default config (no Ray) with every warning recorded. The e2e runs check the
    whole output of a real run for the same line."""
    import warnings

    from hydra import compose, initialize_config_dir

    import verl_diffusion.config as package_config
    from verl_diffusion.main_flowgrpo import add_search_path
    from verl_diffusion.trainer.flowgrpo_trainer import RayFlowGRPOTrainer

    argv = ["main_flowgrpo"]
    add_search_path(argv)
    with initialize_config_dir(config_dir=os.path.dirname(package_config.__file__), version_base="1.3"):
        cfg = compose(config_name="tiny_cpu", overrides=[a for a in argv if a.startswith("hydra.searchpath")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = RayFlowGRPOTrainer(config=cfg, reward_fn=None, run_dir=os.getcwd(), progress=False)
    assert trainer.trainer_mode == "diffusion_sync" and cfg.trainer.use_v1
    assert not [w for w in caught if "Legacy trainer" in str(w.message) or "use_v1" in str(w.message)], \
        [str(w.message) for w in caught]


def test_help_prints_no_log_lines(tmp_path):
    """``main_flowgrpo --help`` (VERL_PLATFORM unset, as a new user types it) prints hydra's help and no INFO or
    WARNING line of verl's platform selection."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_LOGGING_LEVEL")}
    res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--help"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "powered by Hydra" in out, out[-2000:]
    assert "INFO" not in out and "WARNING" not in out, out[:2000]
