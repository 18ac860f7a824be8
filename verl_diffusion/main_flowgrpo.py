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

import os
import sys


from verl_diffusion.run_setup import (
    ConfigError, build_reward_fn, plan_run_dir, prepare_config, resolve_path, validate_config)
from verl_diffusion.launch import QUIET_ENV, quiet_environment, release_workers, select_platform, start_ray
from verl_diffusion.recipe_index import add_search_path, recipe_lines, recipes_dir, searchpath_overrides

# The entry point's public names (tests and benchmarks import them from here).
__all__ = ["ConfigError", "QUIET_ENV", "add_search_path", "build_reward_fn", "main", "plan_run_dir", "prepare_config",
           "recipes_dir", "resolve_path", "run_flowgrpo", "searchpath_overrides", "select_platform", "validate_config"]

CONFIG_ERROR_EXIT = 2
REWARD_FAILURE_EXIT = 3   # trainer.reward_failure_budget ran out (checkpoint saved)
STORAGE_ERROR_EXIT = 4    # a save failed: disk full or not writable (the previous complete checkpoint stays)


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
    run_config = validate_config(cfg)
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
        return _run_planned(cfg, run_config, run_dir, plan, platform, finalize)


def _run_planned(cfg, run_config, run_dir: str, plan, platform: str, finalize: bool) -> dict:
    """The part of :func:`run_flowgrpo` after the run directory is planned: reward, Ray, the trainer."""
    try:
        reward_fn = build_reward_fn(run_config)
    except ValueError as e:
        raise ConfigError(f"reward: {e}") from None
    resume = {"resume": f"resuming from {plan.resume.path}" if plan.resume else "",
              "validate": "validation only, of " + (plan.resume.path if plan.resume else str(
                  cfg.actor_rollout_ref.model.path))}.get(plan.action, "new run")
    print(f"run dir: {run_dir} ({resume}; checkpoints in {cfg.trainer.default_local_dir})", flush=True)
    if plan.message and plan.action in ("resume", "validate"):
        print(f"WARNING: {plan.message}", flush=True)
    try:  # remote rewards answer before the first step (one line naming the URL otherwise)
        from verl_diffusion.run_setup import preflight_remote_rewards

        preflight_remote_rewards(reward_fn, run_config.reward.preflight_timeout)
    except ValueError as e:
        raise ConfigError(str(e)) from None

    import ray
    from verl.trainer.ppo.v1 import get_trainer_cls

    import verl_diffusion.trainer.async_trainer  # noqa: F401  (registers diffusion_sync and diffusion_async)
    from verl_diffusion.trainer.checkpoints import ResumePoint

    own_ray = start_ray(cfg, platform)
    trainer = None
    try:
        trainer = get_trainer_cls(run_config.trainer.trainer_mode)(config=cfg, run_config=run_config,
                                                                   reward_fn=reward_fn, run_dir=run_dir)
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


def _hydra_main():
    import hydra

    @hydra.main(config_path="config", config_name="shapes_cpu", version_base="1.3")  # 1.3: no chdir
    def entry(cfg) -> None:
        from verl_diffusion.trainer.reward_health import RewardBudgetExceeded
        from verl_diffusion.trainer.run_dir import RunDirError, StorageError
        from verl_diffusion.trainer.signals import StopRequested, startup_interruption

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
        except Exception as e:
            # A start-up signal that surfaced as another exception stops the run as the signal does (one line,
            # 128 + signum), not as a traceback with hydra's exit code 1.
            interrupted = startup_interruption(e)
            if interrupted is None:
                raise
            raise interrupted from None
        if summary.get("finished"):
            print(summary["message"], flush=True)
            return
        from verl_diffusion.trainer.summary import summary_lines

        for line in summary_lines(summary):
            print(line, flush=True)

    entry()


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
    from verl_diffusion.run_setup import replace_components_override

    replace_components_override(sys.argv)
    _hydra_main()


if __name__ == "__main__":
    main()
