"""A ``cpu`` platform for verl's platform layer.

Selected only by ``VERL_PLATFORM=cpu`` (``main_flowgrpo`` sets it when no accelerator is present):
:meth:`PlatformCPU.is_platform_available` is always false, so auto-detection on a GPU host with a broken
driver never falls back to CPU silently.

The choices that matter (each one measured on verl 0.9.1):

* ``current_device()`` is the string ``"cpu"``: verl passes the device id to ``.to()`` / ``device=`` and
  torch reads ``0`` as ``cuda:0``.
* ``device_module`` is :data:`cpu_device_module`, ``torch.cpu`` plus the memory / RNG calls verl makes on
  ``torch.cuda`` (no-ops, zeros, RNG pass-through).
* ``communication_backend_name()`` is ``gloo``; ``ray_resource_name()`` is ``"CPU"`` and
  ``ray_resource_options(n)`` is ``{}`` (Ray rejects ``{"resources": {"CPU": n}}``).
"""

from __future__ import annotations

import logging
import types
from contextlib import contextmanager
from typing import Any, Optional

import torch

PLATFORM_NAME = "cpu"


def _build_cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` with the accelerator-only calls verl makes (memory stats, RNG, caches) added."""
    mod = types.ModuleType("verl_diffusion_cpu_device")
    mod.__doc__ = "torch.cpu plus no-op memory stats and RNG pass-through (verl_diffusion.workers.platform_cpu)"

    def _zero(*_: Any, **__: Any) -> int:
        return 0

    def _noop(*_: Any, **__: Any) -> None:
        return None

    def mem_get_info(*_: Any, **__: Any) -> tuple[int, int]:
        try:
            import psutil

            vm = psutil.virtual_memory()
            return int(vm.available), int(vm.total)
        except Exception:  # pragma: no cover - psutil is a verl dependency
            return 0, 0

    def memory_stats(*_: Any, **__: Any) -> dict:
        return {}

    extras = {
        "empty_cache": _noop,
        "ipc_collect": _noop,
        "reset_peak_memory_stats": _noop,
        "reset_max_memory_allocated": _noop,
        "reset_accumulated_memory_stats": _noop,
        "memory_allocated": _zero,
        "memory_reserved": _zero,
        "max_memory_allocated": _zero,
        "max_memory_reserved": _zero,
        "memory_stats": memory_stats,
        "mem_get_info": mem_get_info,
        "get_rng_state": lambda *_, **__: torch.get_rng_state(),
        "set_rng_state": lambda state, *_, **__: torch.set_rng_state(state),
        "get_rng_state_all": lambda: [torch.get_rng_state()],
        "set_rng_state_all": lambda states: torch.set_rng_state(states[0]) if states else None,
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
        "initial_seed": torch.initial_seed,
        "is_available": lambda: True,
        "current_device": lambda: "cpu",
        "device_count": lambda: 1,
        "set_device": _noop,
        "synchronize": _noop,
        "is_initialized": lambda: True,
    }
    for name, fn in extras.items():
        setattr(mod, name, fn)

    def __getattr__(name: str) -> Any:  # everything else: torch.cpu (Stream, Event, amp, ...)
        return getattr(torch.cpu, name)

    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return mod


#: The module verl gets from ``get_torch_device()`` on the CPU platform.
cpu_device_module = _build_cpu_device_module()


def _platform_class():
    from verl.plugin.platform import PlatformBase

    class PlatformCPU(PlatformBase):
        """CPU-only hosts: gloo collectives, Ray ``CPU`` resources, no device memory."""

        @property
        def device_name(self) -> str:
            return "cpu"

        @property
        def vendor_name(self) -> str:
            return "cpu"

        @property
        def device_module(self) -> types.ModuleType:
            return cpu_device_module

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            # Never auto-detected: only VERL_PLATFORM=cpu selects it (no silent fallback on GPU hosts).
            return False

        def current_device(self) -> str:  # type: ignore[override]
            return "cpu"

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            return None

        def synchronize(self, device_index: Optional[int] = None) -> None:
            return None

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None

        def empty_cache(self) -> None:
            return None

        def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "VERL_DIFFUSION_VISIBLE_CPUS"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            # Ray already gives every actor its CPU; {"resources": {"CPU": n}} is rejected.
            return {}

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    return PlatformCPU


_REGISTERED_CLS = None


def register_cpu_platform() -> type:
    """Register the ``cpu`` platform with verl's ``PlatformRegistry`` (idempotent). Returns the class.

    Must run before anything imports ``verl.workers.engine`` (its FSDP module reads the device name at
    import time); ``verl_diffusion.registry.register_all`` calls it first.
    """
    global _REGISTERED_CLS
    if _REGISTERED_CLS is not None:
        return _REGISTERED_CLS
    import warnings

    # verl.workers.engine announces each optional engine it lacks (torchtitan, veomni, megatron, ...) in every
    # process at import; this runs first in register_all(), before that import.
    warnings.filterwarnings("ignore", message=r".* engine is not available", category=UserWarning)
    from verl.plugin.platform import PlatformRegistry

    cls = _platform_class()
    PlatformRegistry.register(platform=PLATFORM_NAME)(cls)
    _REGISTERED_CLS = cls
    explain_platform_fallback()
    return cls


class _CpuHostPlatformFilter(logging.Filter):
    """On a host with no accelerator and VERL_PLATFORM unset, verl's platform detection warns "No supported
    accelerator detected ... Falling back to 'nvidia'" and then "Platform 'nvidia' (PlatformCUDA) is registered
    but not available". Say instead what it means and what to do; drop the second line, which repeats it."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        if msg.startswith("No supported accelerator detected"):
            record.msg = ("verl found no GPU/NPU and VERL_PLATFORM is unset, so it assumes 'nvidia'. On a CPU host "
                          "set VERL_PLATFORM=cpu (python -m verl_diffusion.main_flowgrpo sets it for you).")
            record.args = ()
            return True
        return not msg.startswith("Platform '%s' (%s) is registered but not available")


def explain_platform_fallback() -> None:
    """Install :class:`_CpuHostPlatformFilter` on verl's platform-manager logger, only where there is no
    accelerator and no sign of a GPU host (where those lines would report a real driver problem)."""
    import glob
    import shutil

    gpu_host = bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/davinci[0-9]*") or shutil.which("nvidia-smi"))
    if accelerator_present() or gpu_host:
        return
    log = logging.getLogger("verl.plugin.platform.platform_manager")
    if not any(isinstance(f, _CpuHostPlatformFilter) for f in log.filters):
        log.addFilter(_CpuHostPlatformFilter())


def skip_gpu_numa_affinity(device_name: Optional[str] = None) -> None:
    """On the cpu platform, make verl's ``set_numa_affinity`` (called by every TrainingWorker) a no-op: it pins
    the process to the CPUs near its GPU through libnuma + pynvml, and on a CPU host only prints "Failed to set
    NUMA affinity: libnuma.so: cannot open shared object file"."""
    if device_name is None:
        from verl.utils.device import get_device_name

        device_name = get_device_name()
    if device_name != "cpu":
        return
    import verl.workers.engine_workers as engine_workers

    engine_workers.set_numa_affinity = lambda: None


def accelerator_present() -> bool:
    """True when torch sees a CUDA or NPU device (used by main_flowgrpo to decide VERL_PLATFORM)."""
    if torch.cuda.is_available():
        return True
    npu = getattr(torch, "npu", None)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:
        return False
