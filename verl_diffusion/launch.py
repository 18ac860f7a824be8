"""Starting a run's processes: the platform (CPU when no accelerator is present), the quiet environment every process
inherits, Ray (a local session sized for the workers, or an existing cluster), and the release of a run's workers in a
Ray session the caller keeps."""

from __future__ import annotations

import glob
import logging
import os
import signal
import threading
from typing import Any, Optional

# Loading bars and advisory lines of diffusers / transformers / huggingface_hub in every process (a model load
# prints dozens); errors still show. A user's own setting of these variables wins.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "DIFFUSERS_VERBOSITY": "error", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
QUIET_ENV = {k: os.environ.get(k, v) for k, v in QUIET_ENV.items()}


def _gpu_host() -> bool:
    """Signs of an NVIDIA/Ascend host even when torch sees no device (driver problems)."""
    import shutil

    return bool(glob.glob("/dev/nvidia[0-9]*") or glob.glob("/dev/davinci[0-9]*") or shutil.which("nvidia-smi"))


def select_platform() -> str:
    """Set VERL_PLATFORM=cpu when no accelerator is present; never fall back silently on a GPU host."""
    from verl_diffusion.workers.platform_cpu import accelerator_present

    explicit = os.environ.get("VERL_PLATFORM", "").strip().lower()
    if explicit:
        return explicit
    if accelerator_present():
        return ""
    if _gpu_host():
        raise RuntimeError("this host has GPU devices but torch sees none (driver / CUDA build problem); fix it, "
                           "or set VERL_PLATFORM=cpu to train on CPU on purpose")
    os.environ["VERL_PLATFORM"] = "cpu"
    return "cpu"


def quiet_environment() -> None:
    """verl's INFO lines at import (its loggers read VERL_LOGGING_LEVEL) and the libraries' loading bars off in this
    process and every process it starts; a user's own setting of these variables wins."""
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def cluster_address(cfg) -> Optional[str]:
    """The Ray cluster to join: ``ray_kwargs.ray_init.address`` (verl's key), else ``$RAY_ADDRESS``; None starts a
    local Ray."""
    ray_init = (cfg.get("ray_kwargs", None) or {}).get("ray_init", None) or {}
    address = ray_init.get("address", None) or os.environ.get("RAY_ADDRESS", "")
    return str(address) if address else None


def release_workers(trainer, pools) -> None:
    """In a Ray session the caller keeps (tests run several trainings in one): kill this run's workers and remove
    its placement groups, whose names verl derives from the pool name, so the next run can create them again."""
    import ray
    from ray.util import remove_placement_group

    group = getattr(trainer, "actor_rollout_wg", None) if trainer is not None else None
    for worker in list(getattr(group, "_workers", None) or []):
        ray.kill(worker)
    for pool in (pools.resource_pool_dict.values() if pools is not None else []):
        for pg in list(pool.pgs or []):
            remove_placement_group(pg)
    for replica in list(getattr(trainer, "rollout_replicas", None) or []):
        if hasattr(replica, "shutdown"):      # standalone replicas: their own processes and placement groups
            replica.shutdown()


def start_ray(cfg, platform: str) -> bool:
    """Ray for this run, with the environment every worker needs (platform, quiet libraries, one OMP thread per CPU
    worker): joined to ``cluster_address`` when one is given (nothing sized: its nodes bring their resources), else a
    local session with a CPU slot per worker and standalone replica. Returns whether this call started Ray (the
    caller shuts it down); an already initialised Ray is used as it is."""
    import ray
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.trainer.device = "cpu" if platform == "cpu" else cfg.trainer.get("device", "cuda")
    quiet_environment()
    env = {"VERL_PLATFORM": os.environ.get("VERL_PLATFORM", ""), "TOKENIZERS_PARALLELISM": "false",
           "VERL_LOGGING_LEVEL": os.environ.get("VERL_LOGGING_LEVEL", "WARN"), **QUIET_ENV}
    env = {k: v for k, v in env.items() if v}
    if platform == "cpu":
        env["OMP_NUM_THREADS"] = os.environ.get("VERL_DIFFUSION_WORKER_THREADS", "1")
    own_ray = not ray.is_initialized()
    address = cluster_address(cfg)
    if own_ray and address:
        # An existing cluster (ray start --head / --address on every node; docs/multinode.md): its nodes bring their
        # own resources, so nothing is sized here (Ray refuses num_cpus when joining).
        init_ray_keeping_sigterm(ray, address=address, runtime_env={"env_vars": env}, logging_level=logging.ERROR,
                                 log_to_driver=bool(cfg.trainer.ray_log_to_driver))
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cpus = sum(n.get("Resources", {}).get("CPU", 0) for n in nodes)
        gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in nodes)
        print(f"ray: joined the cluster at {ray.get_runtime_context().gcs_address} ({len(nodes)} nodes, "
              f"{cpus:g} CPUs, {gpus:g} GPUs)", flush=True)
    elif own_ray:
        workers = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
        kwargs: dict[str, Any] = {"runtime_env": {"env_vars": env}, "include_dashboard": False,
                                  "log_to_driver": bool(cfg.trainer.ray_log_to_driver), "logging_level": logging.ERROR}
        if platform == "cpu":
            from verl_diffusion.rollout.diffusers_standalone import num_standalone_replicas, placement

            rollout = cfg.actor_rollout_ref.rollout
            replicas = num_standalone_replicas(rollout) if placement(rollout) == "standalone" else 0
            kwargs["num_cpus"] = max(workers + replicas, os.cpu_count() or 1)
        init_ray_keeping_sigterm(ray, **kwargs)
    return own_ray


def init_ray_keeping_sigterm(ray, **kwargs) -> None:
    """``ray.init`` with this process's SIGTERM handler kept. Ray's driver installs its own (``sys.exit(15)``: exit
    code 15, no line), which would replace the start-up and training-loop handling (one line, exit 143, a checkpoint
    in the loop). A SIGTERM that arrives while ``ray.init`` runs is reported as a start-up stop."""
    from verl_diffusion.trainer import signals

    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main else None
    try:
        ray.init(**kwargs)
    except SystemExit as e:
        if e.code != signal.SIGTERM or previous in (None, signal.SIG_DFL):
            raise
        ray.shutdown()
        raise signals.StartupInterrupted(signal.SIGTERM, signals.phase) from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
