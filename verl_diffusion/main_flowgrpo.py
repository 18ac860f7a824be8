"""Hydra entry point: ``python -m verl_diffusion.main_flowgrpo [--config-name NAME] [key=value ...]``.

With no arguments it runs the shapes world on the CPU (``config/shapes_cpu.yaml``): the packaged pretrained
shapes model fine-tuned with the ``shapes`` reward through 2 Ray workers, a progress line per step, the held-out strict
accuracy and reward at each validation and their gain at the end; a reward/accuracy-curve PNG and a before/after grid.
``--config-name tiny_cpu`` is the JPEG demo on a tiny random SD3.

Outputs go to the run directory, ``./outputs/<experiment_name>`` by default, printed first; what a run does with
an existing one (resume, "already finished", refuse) is decided before Ray starts (trainer/run_dir.py). Exit
codes: 0, 2 (config / run directory, also one that cannot be written), 3 (reward-failure budget), 4 (a save failed:
disk full or not writable), 130 / 143 (SIGINT / SIGTERM: checkpoint saved in the loop; at once before it).

Platform: when no accelerator is present, ``VERL_PLATFORM=cpu`` is set in the driver and in Ray's
``runtime_env`` before verl is imported. On a host that has GPUs but where torch sees none (broken driver),
it stops with an error instead of falling back to CPU; set ``VERL_PLATFORM=cpu`` to force CPU.
The config is validated before any Ray worker starts (:func:`validate_config`).
"""

from __future__ import annotations

import glob
import logging
import os
import sys
from typing import Any, Optional

# Loading bars and advisory lines of diffusers / transformers / huggingface_hub in every process (a model load
# prints dozens); errors still show. A user's own setting of these variables wins.
QUIET_ENV = {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "DIFFUSERS_VERBOSITY": "error", "TRANSFORMERS_VERBOSITY": "error",
             "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
QUIET_ENV = {k: os.environ.get(k, v) for k, v in QUIET_ENV.items()}

CONFIG_ERROR_EXIT = 2
REWARD_FAILURE_EXIT = 3   # trainer.reward_failure_budget ran out (checkpoint saved)
STORAGE_ERROR_EXIT = 4    # a save failed: disk full or not writable (the previous complete checkpoint stays)


class ConfigError(ValueError):
    """A config problem found before any Ray worker starts; the message names the field."""


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


def resolve_path(p: str) -> str:
    """``pkg://<package>/<file>`` → a file path inside the installed package; other paths unchanged."""
    p = str(p)
    if p.startswith("pkg://"):
        import importlib.resources

        rest = p[len("pkg://"):]
        pkg, _, rel = rest.partition("/")
        return str(importlib.resources.files(pkg).joinpath(rel))
    return os.path.expanduser(p)


def validate_config(cfg) -> None:
    """One line naming the field for the mistakes users make; raises :class:`ConfigError`. The checks of
    numbers, prompt counts and the reward section live in :mod:`verl_diffusion.config_checks`."""
    from verl_diffusion.trainer.dataset import read_rows

    arr = cfg.actor_rollout_ref
    path = arr.model.get("path", None)
    if not path:
        raise ConfigError("actor_rollout_ref.model.path is not set: give a diffusers pipeline folder "
                          "(model_index.json), or set actor_rollout_ref.model.tiny for a tiny random model")
    if not os.path.isfile(os.path.join(str(path), "model_index.json")):
        raise ConfigError(f"actor_rollout_ref.model.path={path!r} has no model_index.json: give a local diffusers "
                          "pipeline folder (save_pretrained output)")
    try:
        from verl_diffusion.workers.worker import adapter_kwargs, model_adapter_cls

        adapter_cls = model_adapter_cls(arr.model)
        adapter_kwargs(arr.model)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"actor_rollout_ref.model: {str(e).strip(chr(39) + chr(34))}") from None
    found = _pipeline_class(path)
    if found != adapter_cls.architecture:
        raise ConfigError(f"actor_rollout_ref.model.architecture={arr.model.get('architecture')!r} wraps a "
                          f"{adapter_cls.architecture}, but model.path holds a {found}; drop the architecture key "
                          "(it is read from model_index.json) or point model.path at a matching model")
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    import verl_diffusion.trainer.async_trainer  # noqa: F401  (registers diffusion_sync and diffusion_async)

    mode = str(cfg.trainer.get("v1", {}).get("trainer_mode", "diffusion_sync"))
    ours = sorted(k for k in TRAINER_REGISTRY if k.startswith("diffusion"))
    if mode not in ours:
        raise ConfigError(f"trainer.v1.trainer_mode={mode!r} is not a diffusion trainer; choose one of {ours} "
                          "(verl's own sync/async trainers train language models)")
    name = str(arr.rollout.get("name", "diffusers"))
    if name not in RolloutReplicaRegistry._registry:
        raise ConfigError(f"actor_rollout_ref.rollout.name={name!r} is not a registered rollout replica; choose one "
                          f"of {sorted(RolloutReplicaRegistry._registry)}")
    from verl_diffusion.rollout.diffusers_standalone import check_placement
    from verl_diffusion.trainer.async_trainer import RayFlowGRPOAsyncTrainer

    try:
        check_placement(arr, asynchronous=issubclass(TRAINER_REGISTRY[mode], RayFlowGRPOAsyncTrainer))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from verl_diffusion import config_checks

    try:
        config_checks.check_optimizer_and_steps(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    n_rows = {}
    for field in ("train_files", "val_files"):
        files = cfg.data.get(field, None)
        if not files:
            raise ConfigError(f"data.{field} is empty: give prompt files (.parquet/.jsonl/.txt)")
        n_rows[field] = 0
        for f in files:
            try:
                n_rows[field] += len(read_rows(resolve_path(f), prompt_key=cfg.data.get("prompt_key", "prompt")))
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"data.{field}: {e}") from None
    try:
        config_checks.check_prompt_count(cfg, n_rows["train_files"])
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not cfg.reward.get("components"):
        raise ConfigError("reward.components is empty: give {name: weight}, e.g. reward.components={ocr: 1.0}")
    try:
        config_checks.check_reward_section(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        from verl_diffusion.algos.windows import window_steps
        from verl_diffusion.workers.worker import build_rollout_config

        rollout_cfg = build_rollout_config(arr.rollout)
        window_steps(rollout_cfg.window, num_steps=rollout_cfg.num_steps)
    except (KeyError, ValueError, TypeError) as e:
        msg = str(e).strip("'\"")
        raise ConfigError(f"actor_rollout_ref.{msg}" if msg.startswith("rollout.")
                          else f"actor_rollout_ref.rollout: {msg}") from None
    try:
        from verl_diffusion.workers.old_policy import OldPolicyConfig

        OldPolicyConfig.from_dict(arr.actor.get("old_policy", None))
    except (KeyError, ValueError, TypeError) as e:
        msg = str(e).strip("'\"")
        raise ConfigError(f"actor_rollout_ref.{msg}" if msg.startswith("actor.")
                          else f"actor_rollout_ref.actor.old_policy: {msg}") from None
    frac = float(arr.actor.get("train_step_fraction", 1.0))
    if not 0.0 < frac <= 1.0:
        raise ConfigError(f"actor_rollout_ref.actor.train_step_fraction={frac} must be in (0, 1] "
                          "(1.0 trains every window step; DanceGRPO uses 0.6)")
    loss_mode = arr.actor.policy_loss.loss_mode
    try:
        from verl_diffusion.workers.step_loss import make_step_loss
        from verl_diffusion.workers.worker import loss_knobs_for

        make_step_loss(loss_mode, loss_knobs_for(arr))
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(str(e).strip("'\"")) from None
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

    est = cfg.algorithm.adv_estimator
    if est not in ADV_ESTIMATOR_REGISTRY:
        raise ConfigError(f"algorithm.adv_estimator={est!r} is unknown; choose one of "
                          f"{sorted(k for k in ADV_ESTIMATOR_REGISTRY if str(k).startswith('flow_grpo'))}")
    n = int(arr.rollout.n)
    if n < 1:
        raise ConfigError(f"actor_rollout_ref.rollout.n={n} must be >= 1")
    workers = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    try:
        from verl_diffusion.workers.worker import branched_settings

        branched = branched_settings(arr.rollout)
    except (KeyError, ValueError, TypeError) as e:
        msg = str(e).strip("'\"")
        raise ConfigError(f"actor_rollout_ref.{msg}" if msg.startswith("rollout.")
                          else f"actor_rollout_ref.rollout.branched.{msg}") from None
    if branched is not None:
        # TempFlow-GRPO (docs/algorithms.md §3.3): rows per step = prompts × |branch steps| × num_children; rollout.n is unused.
        if rollout_cfg.sampler not in ("flow_sde", "cps", "dance") or rollout_cfg.noise_level <= 0:
            raise ConfigError(f"actor_rollout_ref.rollout.branched.enabled=true needs a Flow-SDE-type sampler with "
                              f"noise_level > 0 for the children (got rollout.sde.type={rollout_cfg.sampler}, "
                              f"noise_level={rollout_cfg.noise_level}); docs/algorithms.md §3.3 uses flow_sde")
        if loss_mode != "tempflow_grpo":
            raise ConfigError(f"actor_rollout_ref.rollout.branched.enabled=true is the TempFlow-GRPO rollout: use "
                              f"actor_rollout_ref.actor.policy_loss.loss_mode=tempflow_grpo (got {loss_mode})")
        n = len(branched["branch_steps"]) * int(branched["num_children"])
        if int(cfg.data.train_batch_size) % workers:
            raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} prompts do not split over {workers} "
                              "workers; a branched rollout keeps each prompt's trunk and (prompt, k) groups on one worker")
    elif n == 1 and est in ("flow_grpo", "flow_grpo_gdpo"):
        raise ConfigError(f"actor_rollout_ref.rollout.n=1 with algorithm.adv_estimator={est}: a group of one sample "
                          "has advantage 0 and nothing trains; use n >= 2 or adv_estimator=flow_grpo_batch")
    samples = int(cfg.data.train_batch_size) * n
    rows_name = "|branch steps| × num_children" if branched is not None else "rollout.n"
    if samples % workers:
        raise ConfigError(f"data.train_batch_size × {rows_name} = {samples} samples do not split over {workers} workers "
                          "(trainer.nnodes × trainer.n_gpus_per_node)")
    from verl_diffusion.algos.losses import get_loss_spec

    if get_loss_spec(loss_mode).prepare is not None and int(cfg.data.train_batch_size) % workers:
        raise ConfigError(f"data.train_batch_size={cfg.data.train_batch_size} prompts do not split over {workers} "
                          f"workers; loss_mode={loss_mode} pre-processes whole groups on one worker")
    mini = int(arr.actor.ppo_mini_batch_size) * n
    if samples % mini or mini % workers:
        raise ConfigError(f"actor_rollout_ref.actor.ppo_mini_batch_size={arr.actor.ppo_mini_batch_size} prompts "
                          f"({mini} samples) must divide the {samples} samples of a step and split over {workers} workers")


def _pipeline_class(path) -> str:
    from verl_diffusion.models.base import pipeline_class_name

    return pipeline_class_name(path)


def prepare_config(cfg) -> str:
    """Resolve the run dir (relative paths: under the working directory; null: ``./outputs/<experiment_name>``),
    build the tiny model when asked, resolve pkg:// data and model paths. Returns the run dir."""
    from omegaconf import open_dict

    run_dir = cfg.trainer.get("run_dir", None) or os.path.join("outputs", str(cfg.trainer.experiment_name))
    run_dir = os.path.abspath(os.path.expanduser(str(run_dir)))
    os.makedirs(run_dir, exist_ok=True)
    with open_dict(cfg):
        cfg.trainer.run_dir = run_dir
        cfg.trainer.default_local_dir = os.path.abspath(os.path.expanduser(str(cfg.trainer.default_local_dir)))
        cfg.data.train_files = [resolve_path(f) for f in cfg.data.train_files]
        cfg.data.val_files = [resolve_path(f) for f in cfg.data.val_files]
        model = cfg.actor_rollout_ref.model
        if model.get("path"):
            # pkg://verl_diffusion/assets/shapes_sd3: the pretrained shapes model shipped with the package.
            model.path = resolve_path(model.path)
        if not model.get("path") and model.get("tiny") is not None:
            from omegaconf import OmegaConf

            from verl_diffusion.models.tiny import TINY_BUILDERS, save_tiny

            kwargs = dict(OmegaConf.to_container(model.tiny, resolve=True) or {})
            arch = str(kwargs.pop("architecture", None) or model.get("architecture", None) or "sd3")
            if arch not in TINY_BUILDERS:
                raise ConfigError(f"actor_rollout_ref.model.tiny.architecture={arch!r} is unknown; choose one of "
                                  f"{sorted(TINY_BUILDERS)}")
            tiny_dir = os.path.join(run_dir, f"tiny_{arch}")
            if not os.path.isfile(os.path.join(tiny_dir, "model_index.json")):
                save_tiny(arch, tiny_dir, **kwargs)
            model.path = tiny_dir
    return run_dir


def build_reward_fn(cfg):
    from omegaconf import OmegaConf

    from verl_diffusion.config_checks import options_in_use
    from verl_diffusion.rewards import build_reward

    r = cfg.reward
    return build_reward(OmegaConf.to_container(r.components, resolve=True), options=options_in_use(cfg),
                        penalty=float(r.get("penalty", 0.0)), executor=str(r.get("executor", "sync")),
                        max_workers=r.get("max_workers", None), timeout=r.get("timeout", None))


def plan_run_dir(cfg, run_dir: str):
    """What this run does with its run directory (trainer/run_dir.py: new, resume or already finished), decided
    before Ray starts; the reward-failure budget is checked here too. Raises ConfigError with one line."""
    from verl_diffusion.trainer.reward_health import RewardFailureBudget
    from verl_diffusion.trainer.run_dir import RunDirError, clear_outputs, plan_run

    t = cfg.trainer
    try:
        RewardFailureBudget.from_dict(t.get("reward_failure_budget", None))
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None
    if bool(t.get("val_only", False)):
        # Validation only (verl's trainer.val_only): the newest complete checkpoint when there is one, else the
        # model at model.path; no training, and the run's metrics and state stay as they are.
        from verl_diffusion.trainer.checkpoints import find_resume_checkpoint
        from verl_diffusion.trainer.run_dir import RunPlan

        point = find_resume_checkpoint(str(t.default_local_dir))
        return RunPlan("validate", run_dir, str(t.default_local_dir), resume=point if point.path else None,
                       message=point.warning() or "")
    total = t.get("total_training_steps", None)
    total = int(total) if total is not None else 10 ** 12     # epochs: the step count needs the dataloader
    try:
        plan = plan_run(run_dir, str(t.default_local_dir), total_steps=total,
                        resume_mode=str(t.get("resume_mode", "auto")), resume_from_path=t.get("resume_from_path", None),
                        overwrite=bool(t.get("overwrite", False)))
    except RunDirError as e:
        raise ConfigError(str(e)) from None
    if plan.action == "new" and bool(t.get("overwrite", False)):
        clear_outputs(run_dir, str(t.default_local_dir))
    return plan


def run_flowgrpo(cfg, *, finalize: bool = True) -> dict:
    """Validate, plan the run directory, start Ray, train. Returns a summary dict (history, paths); a run that
    already finished returns ``{"finished": True, "message": ...}`` without starting Ray or touching a file.
    Raises StopRequested (SIGTERM/SIGINT, checkpoint saved) or RewardBudgetExceeded (checkpoint saved)."""
    from verl_diffusion.trainer.run_dir import RunDirLock

    platform = select_platform()
    try:
        run_dir = prepare_config(cfg)
        lock = RunDirLock(run_dir).acquire()     # held until this run ends; a second run here is refused
    except OSError as e:
        raise ConfigError(f"trainer.run_dir: cannot write {e.filename or cfg.trainer.get('run_dir')}: "
                          f"{e.strerror or e}") from None
    try:
        return _run_locked(cfg, run_dir, platform, finalize)
    finally:
        lock.release()


def _run_locked(cfg, run_dir: str, platform: str, finalize: bool) -> dict:
    validate_config(cfg)
    plan = plan_run_dir(cfg, run_dir)
    if plan.action == "finished":
        return {"run_dir": run_dir, "finished": True, "message": plan.message, "history": []}
    from verl_diffusion.process_log import tee_output
    from verl_diffusion.trainer.run_dir import RUN_LOG_NAME

    log_path = os.path.join(run_dir, RUN_LOG_NAME)
    try:
        open(log_path, "a").close()
    except OSError as e:
        raise ConfigError(f"trainer.run_dir: cannot write {log_path}: {e.strerror or e}") from None
    with tee_output(log_path):
        return _run_planned(cfg, run_dir, plan, platform, finalize)


def _run_planned(cfg, run_dir: str, plan, platform: str, finalize: bool) -> dict:
    """The part of :func:`run_flowgrpo` after the run directory is planned: reward, Ray, the trainer."""
    try:
        reward_fn = build_reward_fn(cfg)
    except ValueError as e:
        raise ConfigError(f"reward: {e}") from None
    resume = {"resume": f"resuming from {plan.resume.path}" if plan.resume else "",
              "validate": "validation only, of " + (plan.resume.path if plan.resume else str(
                  cfg.actor_rollout_ref.model.path))}.get(plan.action, "new run")
    print(f"run dir: {run_dir} ({resume}; checkpoints in {cfg.trainer.default_local_dir})", flush=True)
    if plan.message and plan.action in ("resume", "validate"):
        print(f"WARNING: {plan.message}", flush=True)
    try:  # remote rewards answer before the first step (one line naming the URL otherwise)
        from verl_diffusion.config_checks import preflight_remote_rewards

        preflight_remote_rewards(reward_fn, cfg.reward.get("preflight_timeout", None))
    except ValueError as e:
        raise ConfigError(str(e)) from None

    import ray
    from omegaconf import OmegaConf, open_dict
    from verl.trainer.ppo.v1 import get_trainer_cls

    import verl_diffusion.trainer.async_trainer  # noqa: F401  (registers diffusion_sync and diffusion_async)
    from verl_diffusion.trainer.checkpoints import ResumePoint

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
        ray.init(address=address, runtime_env={"env_vars": env}, logging_level=logging.ERROR,
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
        ray.init(**kwargs)
    trainer = None
    try:
        trainer = get_trainer_cls(str(cfg.trainer.v1.trainer_mode))(config=cfg, reward_fn=reward_fn, run_dir=run_dir)
        trainer.resume_point = plan.resume if plan.resume is not None else ResumePoint(None, None)
        trainer.init()          # verl V1: _setup, then on_init_end (the first weight sync)
        history = trainer.fit()
        summary = {"run_dir": run_dir, "history": history, "val_history": trainer.val_history,
                   "worker_info": dict(getattr(trainer, "worker_info", {}) or {}), "model": trainer.exported_model}
        if finalize:
            summary.update(trainer.refresh_artifacts())
        return summary
    finally:
        if own_ray:
            ray.shutdown()
        else:
            release_workers(trainer, getattr(trainer, "resource_pool_manager", None))


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


def _hydra_main():
    import hydra

    @hydra.main(config_path="config", config_name="shapes_cpu", version_base="1.3")  # 1.3: no chdir
    def entry(cfg) -> None:
        from verl_diffusion.trainer.reward_health import RewardBudgetExceeded
        from verl_diffusion.trainer.run_dir import RunDirError, StorageError
        from verl_diffusion.trainer.signals import StopRequested
        from verl_diffusion.trainer.validation import validation_gain_line

        try:
            summary = run_flowgrpo(cfg)
        except (ConfigError, RunDirError) as e:
            print(f"config error: {e}", file=sys.stderr)
            sys.exit(CONFIG_ERROR_EXIT)
        except StopRequested as e:
            print(f"{e}: checkpoint and metrics saved in {cfg.trainer.run_dir}; run the same command to resume",
                  flush=True)
            sys.exit(e.exit_code)
        except StorageError as e:
            print(f"storage error: {e}; the newest complete checkpoint is kept: free space (or fix the permissions) "
                  "and run the same command to resume", file=sys.stderr, flush=True)
            sys.exit(STORAGE_ERROR_EXIT)
        except RewardBudgetExceeded as e:
            print(f"reward failure: {e}; checkpoint and metrics saved in {cfg.trainer.run_dir}; fix the reward and "
                  "run the same command to resume", file=sys.stderr, flush=True)
            sys.exit(REWARD_FAILURE_EXIT)
        if summary.get("finished"):
            print(summary["message"], flush=True)
            return
        # The whole run, every resumed segment included: metrics.jsonl and the validation files, not this process.
        from verl_diffusion.trainer.run_dir import METRICS_NAME, MetricsLog
        from verl_diffusion.trainer.validation import tag_table_from_run_dir, val_history_from_run_dir

        rows = MetricsLog(os.path.join(summary["run_dir"], METRICS_NAME)).rows()
        h = [r for r in rows if "reward/mean" in r]
        if h:
            k = max(1, len(h) // 4)
            first = sum(x["reward/mean"] for x in h[:k]) / k
            last = sum(x["reward/mean"] for x in h[-k:]) / k
            print(f"reward: first {k} steps {first:.4f} -> last {k} steps {last:.4f}")
        gain = validation_gain_line(val_history_from_run_dir(summary["run_dir"], rows))
        if gain:
            print(gain)
        for line in tag_table_from_run_dir(summary["run_dir"], rows) or []:
            print(line)
        for key in ("reward_curve", "before_after", "metrics"):
            if key in summary:
                print(f"{key}: {summary[key]}")
        if summary.get("model"):
            print(f"model: {summary['model']} (stock diffusers loads it: {summary['model']}/README.md)")
        print(f"run dir: {summary['run_dir']}")

    entry()


def recipe_lines(folder: str) -> list[str]:
    """Per recipe of ``folder``: a line with its name, loss, reward, GPUs, LoRA, image size and GPU estimate
    (verl_diffusion/hardware.py), then the first line of its header comment (model, paper), indented."""
    from hydra import compose, initialize_config_dir

    from verl_diffusion.hardware import estimate

    names = sorted(f[:-5] for f in os.listdir(folder) if f.endswith(".yaml"))
    search = searchpath_overrides()
    lines = []
    with initialize_config_dir(config_dir=folder, version_base="1.3"):
        for name in names:
            cfg = compose(config_name=name, overrides=search)
            a = cfg.actor_rollout_ref
            with open(os.path.join(folder, name + ".yaml")) as f:
                head = f.readline().lstrip("# ").strip()
            lora = f"LoRA r{a.model.lora_rank}" if int(a.model.get("lora_rank", 0) or 0) else "full FT"
            reward = "+".join(str(k) for k in cfg.reward.components)
            gpus = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
            est = estimate(name, cfg)
            need = est.short() if est else "CPU"
            lines.append(f"{name:34s} {a.actor.policy_loss.loss_mode:14s} {reward:22s} {gpus:>2d} GPUs  {lora:9s} "
                         f"{int(a.rollout.resolution):>4d}px  {need}\n    {head}")
    return lines


def quiet_environment() -> None:
    """verl's INFO lines at import (its loggers read VERL_LOGGING_LEVEL) and the libraries' loading bars off in this
    process and every process it starts; a user's own setting of these variables wins."""
    os.environ.setdefault("VERL_LOGGING_LEVEL", "WARN")
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)


def main() -> None:
    from verl_diffusion.trainer.signals import StartupInterrupted, install_startup_handlers

    install_startup_handlers()
    try:
        _main()
    except StartupInterrupted as e:
        print(f"{e}: nothing new to save; run the same command to start again (it resumes from the newest complete "
              "checkpoint, if any)", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


def _main() -> None:
    quiet_environment()
    if "--list-recipes" in sys.argv[1:]:
        os.environ.setdefault("VERL_PLATFORM", "cpu")   # composing imports verl; nothing runs on a device
        local = os.path.join(os.getcwd(), "recipes")
        folder = local if os.path.isdir(local) else recipes_dir()
        print(f"recipes in {folder} (python -m verl_diffusion.main_flowgrpo --config-name NAME; docs/recipes.md):")
        for line in recipe_lines(folder):
            print(line)
        return
    # Before hydra composes the config: `pkg://verl.trainer.config` imports verl, which fixes the platform.
    try:
        select_platform()
    except RuntimeError as e:
        print(f"platform error: {e}", file=sys.stderr)
        sys.exit(1)
    add_search_path(sys.argv)
    from verl_diffusion.config_checks import replace_components_override

    replace_components_override(sys.argv)
    _hydra_main()


def recipes_dir() -> str:
    """The recipes shipped in the package (``verl_diffusion/recipes``), as a folder path."""
    import importlib.resources

    return str(importlib.resources.files("verl_diffusion").joinpath("recipes"))


def searchpath_overrides() -> list[str]:
    """The ``hydra.searchpath=[...]`` override that :func:`add_search_path` adds, for composing a recipe in code."""
    argv = ["main_flowgrpo"]
    add_search_path(argv)
    return [a for a in argv if a.startswith("hydra.searchpath")]


def add_search_path(argv: list) -> None:
    """verl's config tree (``pkg://verl.trainer.config``) on hydra's search path, and the recipes as the config dir.

    Hydra reads ``hydra.searchpath`` only from the primary config; passing it on the command line makes every
    config name (package configs and recipes) compose ``ppo_trainer`` the same way. Primary configs are only
    looked up in config dirs: ``./recipes`` when the working directory has one (your own recipes), else the
    recipes shipped in the package, so ``--config-name <recipe>`` resolves from any directory.
    """
    args = [str(a) for a in argv[1:]]
    local = os.path.join(os.getcwd(), "recipes")
    if not any(a.startswith(("--config-dir", "-cd")) for a in args):
        argv.insert(1, "--config-dir=" + (local if os.path.isdir(local) else recipes_dir()))
    if any(a.startswith("hydra.searchpath") for a in args):
        return
    argv.append("hydra.searchpath=[pkg://verl.trainer.config,pkg://verl_diffusion.config]")


if __name__ == "__main__":
    main()
