"""The cpu platform: selected only by VERL_PLATFORM=cpu, never auto-detected; the values verl needs."""

import os
import subprocess
import sys

import torch

from verl_diffusion.workers.platform_cpu import cpu_device_module, register_cpu_platform


def test_platform_fields():
    cls = register_cpu_platform()
    p = cls()
    assert p.device_name == "cpu"
    assert p.current_device() == "cpu"          # not 0: torch would read 0 as cuda:0
    assert p.communication_backend_name() == "gloo"
    assert p.ray_resource_name() == "CPU"
    assert p.ray_resource_options(2) == {}     # Ray rejects {"resources": {"CPU": n}}
    assert p.is_platform_available() is False and p.is_platform_available(use_smi_check=True) is False
    assert register_cpu_platform() is cls      # idempotent


def test_device_module_has_what_verl_calls():
    m = cpu_device_module
    for name in ("empty_cache", "memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved",
                 "reset_peak_memory_stats", "manual_seed", "synchronize"):
        getattr(m, name)()  if name not in ("manual_seed",) else m.manual_seed(0)
    free, total = m.mem_get_info()
    assert total >= free >= 0
    state = m.get_rng_state()
    a = torch.rand(3)
    m.set_rng_state(state)
    assert torch.equal(a, torch.rand(3))
    assert m.Event is torch.cpu.Event          # everything else comes from torch.cpu


def _probe(env_platform):
    env = dict(os.environ)
    env.pop("VERL_PLATFORM", None)
    if env_platform:
        env["VERL_PLATFORM"] = env_platform
    code = ("import verl\nfrom verl.utils.device import get_device_name, get_device_id, get_nccl_backend\n"
            "print(get_device_name(), get_device_id(), get_nccl_backend())")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()[-3:]


def test_verl_uses_it_only_when_asked():
    assert _probe("cpu") == ["cpu", "cpu", "gloo"]
    env_free = _probe_name(None)
    assert env_free != "cpu"                  # never an automatic fallback


def _probe_name(env_platform):
    env = dict(os.environ)
    env.pop("VERL_PLATFORM", None)
    if env_platform:
        env["VERL_PLATFORM"] = env_platform
    code = "from verl.plugin.platform import get_platform\nprint(get_platform().device_name)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout.split()[-1]
