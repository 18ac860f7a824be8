"""A composed training config, checked and prepared before any Ray worker starts.

:func:`prepare_config` resolves paths (``pkg://``, the run dir, a tiny model); :func:`validate_config` checks the
config and raises :class:`ConfigError` with one line naming the field, the value and what is accepted (exit 2); the
smaller checks below raise ``ValueError`` and validate_config turns them into ConfigError. :func:`plan_run_dir`
decides what the run does with its directory. The remote-reward pre-flight runs once the reward is built.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

# Keys of the `reward` section that this trainer reads (config/flowgrpo_trainer.yaml); verl's own RewardConfig
# fields are accepted next to them (ppo_trainer composes them in, our trainer does not use them).
REWARD_KEYS = ("components", "options", "penalty", "executor", "max_workers", "timeout", "preflight_timeout")


def _number(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def check_optimizer_and_steps(cfg) -> None:
    """actor.optim.lr > 0; trainer.total_training_steps null or >= 1; trainer.total_epochs >= 1;
    data.train_batch_size >= 1."""
    lr = cfg.actor_rollout_ref.actor.optim.get("lr", None)
    x = _number(lr)
    if x is None or x <= 0:
        raise ValueError(f"actor_rollout_ref.actor.optim.lr={lr!r} must be a number > 0 (lr 0 trains nothing; "
                         "the recipes use 1e-4 to 3e-4)")
    steps = cfg.trainer.get("total_training_steps", None)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"trainer.total_training_steps={steps!r} must be an integer >= 1, or null "
                         "(= trainer.total_epochs passes over the training prompts)")
    epochs = cfg.trainer.get("total_epochs", 1)
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ValueError(f"trainer.total_epochs={epochs!r} must be an integer >= 1")
    bs = cfg.data.get("train_batch_size", None)
    if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
        raise ValueError(f"data.train_batch_size={bs!r} must be an integer >= 1 (prompts per step)")


def check_prompt_count(cfg, n_train: int) -> None:
    """A step draws data.train_batch_size distinct prompts (drop_last): there must be at least that many."""
    limit = cfg.data.get("train_max_samples", -1)
    if limit is not None and int(limit) > 0:
        n_train = min(n_train, int(limit))
    bs = int(cfg.data.train_batch_size)
    if bs > n_train:
        raise ValueError(f"data.train_batch_size={bs} is larger than the {n_train} training prompts of "
                         f"data.train_files (after data.train_max_samples); lower it to <= {n_train} or add prompts")


def reward_option_names(name: str) -> list[str]:
    """The keyword options a registered reward's constructor takes."""
    from verl_diffusion.rewards import get_reward_cls

    params = inspect.signature(get_reward_cls(name).__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def verl_reward_keys() -> set[str]:
    """The keys of verl's own ``reward`` group (verl/trainer/config/reward/reward.yaml), which ppo_trainer composes
    in next to ours."""
    import importlib.resources

    from omegaconf import OmegaConf

    text = importlib.resources.files("verl.trainer.config").joinpath("reward/reward.yaml").read_text()
    return set(OmegaConf.create(text).keys()) | {"_target_"}


def check_reward_section(cfg) -> None:
    """Unknown keys under ``reward`` and under ``reward.options.<name>`` are errors naming the valid ones (a
    ``+reward.reward_kwargs...`` override used to be accepted and silently ignored)."""
    from verl_diffusion.rewards import REWARDS

    section = cfg.reward
    verl_keys = verl_reward_keys()
    for key in section.keys():
        if key not in REWARD_KEYS and key not in verl_keys:
            hint = " (reward options go under reward.options.<reward>.<option>)" if key == "reward_kwargs" else ""
            raise ValueError(f"reward.{key} is not a key this trainer reads{hint}; valid keys: {', '.join(REWARD_KEYS)}")
    options = section.get("options", None) or {}
    for name in options.keys():
        if name not in REWARDS:
            raise ValueError(f"reward.options.{name}: no reward is named {name!r}; rewards: {', '.join(sorted(REWARDS))}")
        valid = reward_option_names(name)
        for key in (options[name] or {}).keys():
            if key not in valid:
                raise ValueError(f"reward.options.{name}.{key} is not an option of reward {name!r}; valid options: "
                                 f"{', '.join(valid) if valid else '(none)'}")
    pf = section.get("preflight_timeout", None)
    if pf is not None and ((_number(pf) or 0) <= 0):
        raise ValueError(f"reward.preflight_timeout={pf!r} must be a positive number of seconds, or null to skip "
                         "the check of remote rewards")


def options_in_use(cfg) -> dict:
    """reward.options of the rewards in reward.components only, resolved. A recipe's options for a reward the
    command line switched off are dropped (their ${oc.env:...} is not resolved), with a note."""
    from omegaconf import OmegaConf

    opts = cfg.reward.get("options", None) or {}
    components = set(cfg.reward.get("components", None) or {})
    unused = sorted(k for k in opts.keys() if k not in components)
    if unused:
        print(f"note: reward.options for {', '.join(unused)} ignored: not in reward.components "
              f"({', '.join(sorted(components))})")
    return {k: OmegaConf.to_container(opts[k], resolve=True) if opts[k] is not None else {}
            for k in opts.keys() if k in components}


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


class ConfigError(ValueError):
    """A config problem found before any Ray worker starts; the message names the field."""


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
