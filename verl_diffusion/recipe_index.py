"""The shipped recipes: where they are, the hydra search path that composes them from any directory, and the
``--list-recipes`` lines."""

from __future__ import annotations

import os


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
