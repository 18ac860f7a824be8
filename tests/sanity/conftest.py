"""Fresh-process probes shared by the sanity tests: each costs a Python start and a verl import, so a command that
two test files check is run once per session (VERL_PLATFORM unset, as a new user starts it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# `import verl` in a fresh process, nothing imported by hand first: the plugin's registrations (test_layout), then
# the platform the process chose and the transformers / diffusers imports a first run makes (test_quiet_startup).
FRESH_IMPORT = (
    "import verl\n"
    "from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn\n"
    "get_adv_estimator_fn('flow_grpo'); get_policy_loss_fn('flow_dppo')\n"
    "for n in ('flow_grpo_gdpo', 'flow_grpo_batch'): get_adv_estimator_fn(n)\n"
    "for n in ('flow_grpo', 'grpo_guard', 'dance_grpo', 'tempflow_grpo', 'path_space', 'awm', 'diffusion_nft'):\n"
    "    get_policy_loss_fn(n)\n"
    "from verl.utils.device import get_device_name\nget_device_name()\n"
    "from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY\n"
    "assert {'diffusion_sync', 'diffusion_async'} <= set(TRAINER_REGISTRY), sorted(TRAINER_REGISTRY)\n"
    "from transformers import CLIPImageProcessor, SiglipImageProcessor\n"
    "import diffusers\ndiffusers.StableDiffusion3Pipeline\nprint('ok')"
)


def _fresh(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("VERL_PLATFORM", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="session")
def fresh_import_verl() -> subprocess.CompletedProcess:
    return _fresh("-c", FRESH_IMPORT)


@pytest.fixture(scope="session")
def check_command() -> subprocess.CompletedProcess:
    """``python -m verl_diffusion.check``."""
    return _fresh("-m", "verl_diffusion.check")
