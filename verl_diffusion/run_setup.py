"""What happens to a composed training config before any Ray worker starts: :func:`prepare_config` resolves its paths
(``pkg://``, the run dir, a tiny model), :func:`validate_config` types and checks it once
(:class:`~verl_diffusion.config.schema.RunConfig`: one line naming the field, the value and what is accepted, exit 2),
:func:`plan_run_dir` decides what the run does with its directory, and :func:`build_reward_fn` /
:func:`preflight_remote_rewards` build the reward and probe its servers.
"""

from __future__ import annotations

import os

from verl_diffusion.config.schema import ConfigError, RunConfig, RewardSection

__all__ = ["ConfigError", "build_reward_fn", "plan_run_dir", "preflight_remote_rewards", "prepare_config",
           "replace_components_override", "resolve_path", "validate_config"]


def validate_config(cfg) -> RunConfig:
    """The typed run config (config/schema.py), built once from the prepared ``cfg``; raises :class:`ConfigError`
    with one line for the mistakes users make."""
    return RunConfig.from_omegaconf(cfg)


def resolve_path(p: str) -> str:
    """``pkg://<package>/<file>`` → a file path inside the installed package; other paths unchanged."""
    p = str(p)
    if p.startswith("pkg://"):
        import importlib.resources

        rest = p[len("pkg://"):]
        pkg, _, rel = rest.partition("/")
        return str(importlib.resources.files(pkg).joinpath(rel))
    return os.path.expanduser(p)


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
    """The driver-side reward of the ``reward`` section (``cfg``: the composed config, or its typed RunConfig)."""
    from verl_diffusion.rewards import build_reward

    r = cfg.reward if isinstance(cfg, RunConfig) else RewardSection.from_node(cfg.reward)
    return build_reward(dict(r.components), options=r.options, penalty=r.penalty, executor=r.executor,
                        max_workers=r.max_workers, timeout=r.timeout)


def plan_run_dir(cfg, run_dir: str):
    """What this run does with its run directory (trainer/run_dir.py: new, resume or already finished), decided
    before Ray starts; the reward-failure budget is checked here too. Raises ConfigError with one line."""
    from verl_diffusion.trainer.run_dir import RunDirError, clear_outputs, plan_run

    t = cfg.trainer
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


def preflight_remote_rewards(reward_fn, timeout: float | None) -> None:
    """Probe every reward that talks to a server (``Reward.preflight``) before the first step; a dead URL raises
    one line naming it. ``timeout`` None skips the check."""
    if timeout is None:
        return
    for name, reward in reward_fn.rewards.items():
        try:
            reward.preflight(float(timeout))
        except RuntimeError as e:
            raise ValueError(f"reward {name!r}: {e} before the first step; start the server (docs/rewards.md, "
                             f"scripts/reward_server.py) or fix reward.options.{name}.url "
                             "(reward.preflight_timeout=null skips this check)") from None


def replace_components_override(argv: list) -> None:
    """``reward.components={ocr: 1.0}`` on the command line replaces the recipe's components (hydra would merge
    the dicts, into a struct node that refuses new keys): a ``reward.components=null`` goes before it."""
    out = []
    for arg in argv:
        if str(arg).startswith("reward.components={"):
            out.append("reward.components=null")
        out.append(arg)
    argv[:] = out
