"""Checks of a composed training config that run before any Ray worker starts (main_flowgrpo.validate_config).

Each check raises ``ValueError`` with one line naming the field, the value and what is accepted;
validate_config turns it into a ConfigError (exit 2). The remote-reward pre-flight raises it too, from
run_flowgrpo, once the reward is built.
"""

from __future__ import annotations

import inspect
import math
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
