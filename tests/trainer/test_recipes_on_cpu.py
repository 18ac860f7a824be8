"""Every recipe in recipes/ composes, passes the pre-Ray checks of main_flowgrpo, and carries its paper's numbers.

For each ``recipes/*.yaml``: compose it with the search path ``main_flowgrpo`` uses (``./recipes`` as the config
dir, ``hydra.searchpath=[pkg://verl.trainer.config,pkg://verl_diffusion.config]`` from ``add_search_path``),
point the model at a tiny saved SD3 and the data at parquet files written by ``data_process/`` into tmp_path,
then run what ``run_flowgrpo`` runs before Ray starts (``prepare_config``, ``validate_config``,
``build_reward_fn``) plus the rollout / window / loss configs the worker builds, and assert the published
settings (SPEC sections in docs/recipes.md). No Ray, no training.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from verl_diffusion.main_flowgrpo import ConfigError, add_search_path, build_reward_fn, prepare_config, validate_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
DP = ROOT / "data_process"
RECIPE_NAMES = sorted(p.stem for p in RECIPES.glob("*.yaml"))

# Published numbers per recipe: dotted config key -> value (floats compared with rel 1e-9).
A = "actor_rollout_ref.actor."
PL = A + "policy_loss."
R = "actor_rollout_ref.rollout."
ALG = "algorithm.flow_grpo."
_FLOW_GRPO_SD35 = {R + "sde.type": "flow_sde", R + "sde.noise_level": 0.7, R + "sde.log_prob_convention": "exact",
                   R + "n": 24, R + "num_steps": 10, R + "val_num_steps": 40, R + "guidance_scale": 4.5,
                   PL + "loss_mode": "flow_grpo", PL + "clip_range": 1e-4, ALG + "std_mode": "global",
                   ALG + "adv_eps": 1e-4, ALG + "adv_clip_max": 5.0, "algorithm.adv_estimator": "flow_grpo",
                   A + "optim.lr": 3e-4, A + "optim.weight_decay": 1e-4, "actor_rollout_ref.model.lora_rank": 32,
                   "actor_rollout_ref.model.lora_alpha": 64, A + "ema.decay_max": 0.9, A + "ema.interval": 8}
_DPPO = {PL + "loss_mode": "flow_dppo", PL + "mask": "original", PL + "threshold": 1e-5, PL + "kl_coef": 0.0,
         R + "n": 16, "data.train_batch_size": 64, R + "num_steps": 10, R + "sde.type": "flow_sde",
         R + "sde.noise_level": 0.7, R + "sde.window.mode": "random", R + "sde.window.size": 3,
         R + "sde.window.lo": 0, R + "sde.window.hi": None, A + "ppo_epochs": 1, A + "ppo_mini_batch_size": 32,
         ALG + "std_mode": "group"}
# flow_grpo's train_sd3.py drops zero-advantage samples before training
_DROP = {ALG + "filter_zero_advantage": True}
EXPECTED: dict[str, dict] = {
    "sd35_ocr_flowgrpo": {**_FLOW_GRPO_SD35, **_DROP, PL + "kl_coef": 0.04, R + "sde.window.mode": "none",
                          "data.train_batch_size": 48, A + "ppo_mini_batch_size": 24, "trainer.val_num_images": None,
                          "reward.components": {"ocr": 1.0}},
    "sd35_ocr_flow_cps": {
        **_FLOW_GRPO_SD35, **_DROP, R + "sde.type": "cps", R + "sde.noise_level": 0.8,
        R + "sde.log_prob_convention": "unnormalized", PL + "clip_range": 1e-5, PL + "kl_coef": 0.0,
        R + "sde.window.mode": "random", R + "sde.window.size": 3, R + "sde.window.lo": 0, R + "sde.window.hi": None,
        "data.train_batch_size": 48, A + "ppo_mini_batch_size": 24, "reward.components": {"ocr": 1.0}},
    "sd35_pickscore_flowgrpo": {
        **_FLOW_GRPO_SD35, **_DROP, PL + "kl_coef": 0.01, PL + "kl_mode": "flow_grpo_legacy", R + "sde.window.mode": "none",
        "data.train_batch_size": 48, A + "ppo_mini_batch_size": 24, "reward.components": {"pickscore": 1.0}},
    "sd35_geneval_flowgrpo": {
        **_FLOW_GRPO_SD35, **_DROP, PL + "kl_coef": 0.04, PL + "kl_mode": "flow_grpo_legacy", R + "sde.window.mode": "none",
        "data.train_batch_size": 48, A + "ppo_mini_batch_size": 24, "reward.components": {"geneval": 1.0}},
    "sd35_ocr_grpo_guard": {
        **_FLOW_GRPO_SD35, **_DROP, PL + "loss_mode": "grpo_guard", PL + "clip_range": 2e-6, PL + "kl_coef": 0.0,
        A + "optim.lr": 1e-4, ALG + "std_mode": "group", R + "sde.window.mode": "none",
        "reward.components": {"ocr": 1.0}},
    "sd35_ocr_flow_dppo": {**_DPPO, "reward.components": {"ocr": 1.0}},
    "sd35_pickscore_dance_grpo": {
        PL + "loss_mode": "dance_grpo", R + "sde.type": "dance", R + "sde.noise_level": 0.3, R + "shift": 3.0,
        PL + "clip_range": 1e-4, PL + "kl_coef": 0.0, A + "train_step_fraction": 0.6, ALG + "std_mode": "group",
        ALG + "std_ddof": 1, ALG + "adv_eps": 1e-8, ALG + "adv_clip_max": 5.0, R + "sde.window.size": 10,
        R + "sde.window.hi": 10, "reward.components": {"pickscore": 1.0}},
    "sd35_pickscore_path_space": {
        PL + "loss_mode": "path_space", PL + "preset": "ps_kde", PL + "estimator": "kde", PL + "kde_bandwidth": None,
        PL + "w1_family": "one_minus_t", PL + "w2_family": "t", PL + "xt_source": "trajectory",
        PL + "kl_coef": 1e-4, PL + "kl_mode": "v_space", R + "sde.type": "flow_sde",
        R + "sde.noise_level": math.sqrt(2 * 0.005), R + "guidance_scale": 1.0, R + "same_noise_per_group": False,
        R + "n": 24, R + "num_steps": 10, R + "val_num_steps": 40, R + "sde.window.size": 10,
        "data.train_batch_size": 48, A + "ppo_mini_batch_size": 24,
        ALG + "std_mode": "global", ALG + "adv_eps": 1e-4, ALG + "adv_clip_max": 5.0, A + "optim.lr": 3e-4,
        A + "optim.betas": [0.9, 0.999], "actor_rollout_ref.model.lora_rank": 32,
        "actor_rollout_ref.model.lora_alpha": 64, "reward.components": {"pickscore": 1.0}},
    "sd35_ocr_diffusion_nft": {
        PL + "loss_mode": "diffusion_nft", PL + "beta": 0.1, PL + "kl_coef": 1e-4, PL + "adv_clip_max": 5.0,
        PL + "adv_mode": "all", R + "guidance_scale": 1.0, R + "num_steps": 10, A + "train_step_fraction": 0.99,
        A + "ema.decay_max": 0.9, A + "ema.interval": 1, ALG + "std_mode": "global", ALG + "adv_eps": 1e-4,
        "reward.components": {"ocr": 1.0}},
    "sd35_pickscore_awm": {
        PL + "loss_mode": "awm", PL + "phi": "uniform", PL + "clip_range": 1.0, PL + "adv_clip_max": 5.0,
        PL + "adv_scale": 1.0, PL + "kl_coef": 0.003, R + "guidance_scale": 1.0, R + "num_steps": 14,
        A + "ema.decay_max": 0.99, ALG + "std_mode": "global", "reward.components": {"pickscore": 1.0}},
    "sd35_pickscore_tempflow_grpo": {
        PL + "loss_mode": "tempflow_grpo", PL + "scale": 2.25, PL + "clip_range": 1e-4, PL + "kl_coef": 0.01,
        PL + "kl_mode": "exact", R + "branched.enabled": True, R + "branched.num_children": 4,
        R + "branched.branch_steps": None, R + "sde.type": "flow_sde", R + "sde.noise_level": 0.7,
        R + "sde.log_prob_convention": "exact", R + "num_steps": 10, R + "guidance_scale": 4.5,
        "data.train_batch_size": 16, A + "ppo_mini_batch_size": 8, ALG + "adv_eps": 1e-4, ALG + "adv_clip_max": 5.0,
        A + "optim.lr": 3e-4, "actor_rollout_ref.model.lora_rank": 32, "reward.components": {"pickscore": 1.0}},
    "sd35_multi_gdpo": {**_DPPO, "algorithm.adv_estimator": "flow_grpo_gdpo",
                        "reward.components": {"ocr": 1.0, "pickscore": 1.0}, ALG + "gdpo_reward_weights": [1.0, 1.0]},
    "tiny_cpu": {"reward.components": {"jpeg_compressibility": 1.0}, R + "n": 8, "trainer.device": "cpu",
                 R + "grid": "formula"},
    # verl PR #5951, examples/flowgrpo_trainer/run_qwen_image_ocr_lora.sh.
    "qwenimage_ocr_flowgrpo": {
        "data.train_batch_size": 32, R + "n": 16, "actor_rollout_ref.model.lora_rank": 64,
        "actor_rollout_ref.model.lora_alpha": 128, "actor_rollout_ref.model.target_modules": "all-linear",
        A + "optim.lr": 3e-4, A + "optim.weight_decay": 1e-4, PL + "loss_mode": "flow_grpo", PL + "clip_range": 1e-4,
        PL + "kl_coef": 0.0, ALG + "adv_clip_max": 5.0, R + "resolution": 512, R + "num_steps": 10,
        R + "val_num_steps": 50, R + "grid": "scheduler", R + "guidance_scale": 4.0, R + "negative_prompt": " ",
        R + "sde.type": "flow_sde", R + "sde.noise_level": 1.2, R + "sde.window.mode": "random",
        R + "sde.window.size": 2, R + "sde.window.lo": 0, R + "sde.window.hi": 5, A + "ppo_mini_batch_size": 16,
        "trainer.total_training_steps": 300, "trainer.n_gpus_per_node": 4,
        "actor_rollout_ref.model.adapter_kwargs.max_sequence_length": 256, "reward.components": {"ocr": 1.0}},
    "qwenimage_hpsv3_path_space": {
        PL + "loss_mode": "path_space", PL + "preset": "ps_kde", PL + "estimator": "kde", PL + "kde_bandwidth": None,
        PL + "w1_family": "one_minus_t", PL + "w2_family": "t", PL + "kl_coef": 1e-4, PL + "kl_mode": "v_space",
        R + "sde.noise_level": math.sqrt(2 * 0.005), R + "guidance_scale": 1.0, R + "n": 16, R + "num_steps": 10,
        R + "val_num_steps": 50, R + "sde.window.size": 10, R + "grid": "scheduler", "data.train_batch_size": 32,
        A + "ppo_mini_batch_size": 16,
        A + "optim.lr": 3e-4, A + "optim.betas": [0.9, 0.999], ALG + "std_mode": "global",
        "reward.components": {"hpsv3": 1.0}},
    "qwenimage_hpsv3_diffusion_nft": {
        PL + "loss_mode": "diffusion_nft", PL + "beta": 1.0, PL + "kl_coef": 1e-4, PL + "adv_clip_max": 5.0,
        A + "old_policy.schedule": "nft", A + "old_policy.nft_type": 1, A + "train_step_fraction": 0.99,
        R + "guidance_scale": 1.0, R + "n": 16, R + "num_steps": 10, "data.train_batch_size": 32,
        A + "ppo_mini_batch_size": 16, A + "optim.lr": 3e-4,
        R + "sde.noise_level": 0.1, "reward.components": {"hpsv3": 1.0}},
    "flux2_klein_ocr_flow_dppo": {
        **_DPPO, R + "num_steps": 14, R + "sde.noise_level": 0.9, A + "ppo_epochs": 1, A + "ppo_mini_batch_size": 32,
        R + "guidance_scale": 1.0, R + "grid": "scheduler", R + "val_num_steps": 50, "actor_rollout_ref.model.lora_rank": 64,
        "reward.components": {"ocr": 1.0}},
    "flux1_dev_pickscore_flow_dppo": {
        **_DPPO, R + "sde.noise_level": 0.9, A + "ppo_epochs": 1, A + "ppo_mini_batch_size": 32,
        R + "guidance_scale": 1.0, "actor_rollout_ref.model.adapter_kwargs.distilled_guidance_scale": 3.5,
        R + "grid": "scheduler", R + "val_num_steps": 28, "reward.components": {"pickscore": 1.0}},
}

# The tiny architecture standing in for each recipe's model.
def recipe_architecture(name: str) -> str:
    for prefix, arch in (("sd35_", "sd3"), ("tiny_", "sd3"), ("qwenimage_", "qwen_image"), ("flux2_klein_", "flux2_klein"),
                         ("flux1_dev_", "flux")):
        if name.startswith(prefix):
            return arch
    raise KeyError(f"recipe {name!r}: name it <model>_<reward>_<algo> with a known model prefix")

# Datasets the recipes read: data_process/<script>.py writes <default_output>/{train,test}.parquet.
DATASETS = {"ocr": "~/data/ocr", "pickscore": "~/data/pickscore", "geneval": "~/data/geneval"}


def _load_dp(name: str):
    sys.path.insert(0, str(DP))
    spec = importlib.util.spec_from_file_location(f"dp_recipes_{name}", DP / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _numbered(line: str, k: int) -> str:
    """The k-th distinct copy of a sample line (a prompt per line, or GenEval JSON whose prompt gets the number)."""
    if not line.strip() or k == 0:
        return line
    if line.lstrip().startswith("{"):
        meta = json.loads(line)
        meta["prompt"] = f"{meta['prompt']} ({k})"
        return json.dumps(meta)
    return f"{line} ({k})"


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """A tiny saved pipeline per architecture and the three datasets converted from data_process/samples by
    data_process/."""
    from verl_diffusion.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("recipes")
    data = {}
    for ds in DATASETS:
        out = root / ds
        # validate_config refuses train_batch_size > training prompts: repeat the sample prompts, numbered, to 72
        # distinct ones (the recipes' largest train_batch_size is 64).
        src = root / f"{ds}_in"
        src.mkdir()
        for name in os.listdir(DP / "samples" / ds):
            lines = (DP / "samples" / ds / name).read_text().splitlines()
            if name.startswith("train"):
                lines = [line for line in lines if line.strip()]
                lines = [_numbered(line, k) for k in range(-(-72 // len(lines))) for line in lines]
            (src / name).write_text("\n".join(lines) + "\n")
        assert _load_dp(ds).main(["--input", str(src), "--output", str(out)]) in (0, None)
        data[ds] = out
    models = {arch: str(save_tiny(arch, root / f"tiny_{arch}")) for arch in ("sd3", "qwen_image", "flux", "flux2_klein")}
    return {"models": models, "data": data, "root": root}


def _searchpath() -> list[str]:
    """main_flowgrpo's ``hydra.searchpath=[...]`` argument (its ``--config-dir`` is RECIPES here)."""
    argv = ["main_flowgrpo"]
    add_search_path(argv)
    search = [a for a in argv if a.startswith("hydra.searchpath")]
    assert len(search) == 1, argv
    return search


def _compose(name: str, overrides: list[str]):
    """Compose like `python -m verl_diffusion.main_flowgrpo --config-name NAME` run from the repository root."""
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return compose(config_name=name, overrides=[*_searchpath(), *overrides])


@functools.cache
def _raw(name: str):
    """The recipe as written (no overrides), composed once per recipe and read-only: a hydra compose of verl's
    config tree costs about a second, and several tests of each recipe read it."""
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = compose(config_name=name, overrides=[*_searchpath()])
    OmegaConf.set_readonly(cfg, True)
    return cfg


def _overrides(name: str, assets, tmp_path, *, model=True, reward=True) -> list[str]:
    raw = _raw(name)
    ov = [f"trainer.run_dir={tmp_path}/run", f"trainer.default_local_dir={tmp_path}/ckpt"]
    if model:
        ov.append(f"actor_rollout_ref.model.path={assets['models'][recipe_architecture(name)]}")
    for field in ("train_files", "val_files"):
        files = [str(f) for f in raw.data[field]]
        mapped = []
        for f in files:
            for ds, default in DATASETS.items():
                if f.startswith(default + "/"):
                    f = str(assets["data"][ds] / f[len(default) + 1:])
            mapped.append(f)
        ov.append(f"data.{field}=[{','.join(mapped)}]")
    if reward:
        comps = raw.reward.components
        if "pickscore" in comps:
            ov.append(f"reward.options.pickscore.model_path={tmp_path}/pickscore")
        if "geneval" in comps:
            ov.append("reward.options.geneval.url=http://127.0.0.1:1")
        if "hpsv3" in comps:
            ov.append(f"reward.options.hpsv3.checkpoint_path={tmp_path}/HPSv3.safetensors")
    return ov


def _pre_ray(cfg):
    """What run_flowgrpo does before ray.init, plus the configs the worker builds from the same keys."""
    from verl_diffusion.algos.windows import SdeWindowConfig, window_bounds
    from verl_diffusion.workers.step_loss import step_loss_for

    prepare_config(cfg)
    run = validate_config(cfg)
    reward = build_reward_fn(run)
    rollout = run.actor_rollout_ref.rollout.sampler
    window = rollout.window if isinstance(rollout.window, SdeWindowConfig) else SdeWindowConfig(**rollout.window)
    window_bounds(window, num_steps=rollout.num_steps)  # the window fits the N sampling steps
    loss = step_loss_for(run.actor_rollout_ref)
    return reward, rollout, loss


def test_every_recipe_has_expectations():
    assert RECIPE_NAMES, RECIPES
    assert set(RECIPE_NAMES) == set(EXPECTED), "add the published numbers of a new recipe to EXPECTED"


def test_recipe_names_do_not_shadow_package_configs():
    """main_flowgrpo looks primary configs up in verl_diffusion/config first, then in ./recipes; a recipe must not
    share a name with a package config (tiny_cpu is a symlink to the package's file)."""
    pkg = {p.stem for p in (ROOT / "verl_diffusion" / "config").glob("*.yaml")}
    for name in set(RECIPE_NAMES) & pkg:
        assert (RECIPES / f"{name}.yaml").resolve() == (ROOT / "verl_diffusion" / "config" / f"{name}.yaml").resolve()


@pytest.mark.parametrize("name", RECIPE_NAMES)
def test_recipe_composes_validates_and_carries_published_numbers(name, assets, tmp_path):
    cfg = _compose(name, _overrides(name, assets, tmp_path))
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    reward, rollout, loss = _pre_ray(cfg)
    for key, want in EXPECTED[name].items():
        got = OmegaConf.select(cfg, key, default="<missing>")
        if OmegaConf.is_config(got):
            got = OmegaConf.to_container(got, resolve=True)
        if isinstance(want, float):
            assert isinstance(got, (int, float)) and got == pytest.approx(want, rel=1e-9), (key, got, want)
        else:
            assert got == want, (key, got, want)
    # The loss config the worker builds sees the recipe's knobs (nothing silently dropped).
    knobs = {f.name: getattr(loss.cfg, f.name) for f in dataclasses.fields(loss.cfg)}
    for key, want in EXPECTED[name].items():
        if key.startswith(PL) and key != PL + "loss_mode" and want is not None:
            field = key[len(PL):]
            assert knobs[field] == (pytest.approx(want) if isinstance(want, float) else want), field
    assert rollout.sampler == cfg.actor_rollout_ref.rollout.sde.type
    assert set(reward.rewards) == set(EXPECTED[name]["reward.components"])


@pytest.mark.parametrize("name", [n for n in RECIPE_NAMES if n != "tiny_cpu"])
def test_recipes_need_the_model_path(name, assets, tmp_path):
    """The model path is a required override: without it the run stops before Ray with one line naming it."""
    cfg = _compose(name, _overrides(name, assets, tmp_path, model=False))
    assert cfg.actor_rollout_ref.model.path is None
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.path is not set"):
        prepare_config(cfg)
        validate_config(cfg)


@pytest.mark.parametrize("name", [n for n in RECIPE_NAMES if n != "tiny_cpu"])
def test_data_paths_are_what_data_process_writes(name):
    cfg = _raw(name)
    train, val = list(cfg.data.train_files), list(cfg.data.val_files)
    ds = [d for d, out in DATASETS.items() if train == [f"{out}/train.parquet"]]
    assert len(ds) == 1 and val == [f"{DATASETS[ds[0]]}/test.parquet"], (train, val)


@pytest.mark.parametrize("name", [n for n in RECIPE_NAMES if "pickscore" in n or "multi" in n])
def test_pickscore_model_path_is_required(name, assets, tmp_path):
    cfg = _compose(name, _overrides(name, assets, tmp_path, reward=False))
    assert cfg.reward.options.pickscore.model_path is None
    with pytest.raises(ValueError, match=r"pickscore needs options\.pickscore\.model_path"):
        build_reward_fn(cfg)


def test_geneval_url_is_required(assets, tmp_path, monkeypatch):
    monkeypatch.delenv("GENEVAL_REWARD_URL", raising=False)
    cfg = _compose("sd35_geneval_flowgrpo", _overrides("sd35_geneval_flowgrpo", assets, tmp_path, reward=False))
    with pytest.raises(Exception, match="GENEVAL_REWARD_URL"):
        build_reward_fn(cfg)
    monkeypatch.setenv("GENEVAL_REWARD_URL", "http://geneval-host:18085")
    assert build_reward_fn(cfg).rewards["geneval"].url == "http://geneval-host:18085"


@pytest.mark.parametrize("name", [n for n in RECIPE_NAMES if "hpsv3" in n])
def test_hpsv3_checkpoint_path_is_required(name, assets, tmp_path):
    cfg = _compose(name, _overrides(name, assets, tmp_path, reward=False))
    with pytest.raises(ValueError, match=r"hpsv3 needs options\.hpsv3\.checkpoint_path"):
        build_reward_fn(cfg)


@pytest.mark.parametrize("name", ["sd35_ocr_flowgrpo", "qwenimage_ocr_flowgrpo", "flux2_klein_ocr_flow_dppo",
                                  "flux1_dev_pickscore_flow_dppo"])
def test_a_recipe_on_another_architecture_stops_with_one_line(name, assets, tmp_path):
    """model.architecture pins the adapter; a model directory of another architecture is refused before Ray."""
    arch = recipe_architecture(name)
    other = "sd3" if arch != "sd3" else "flux2_klein"
    ov = [o for o in _overrides(name, assets, tmp_path) if not o.startswith("actor_rollout_ref.model.path=")]
    cfg = _compose(name, [*ov, f"actor_rollout_ref.model.path={assets['models'][other]}",
                          f"actor_rollout_ref.model.architecture={arch}"])
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model"):
        prepare_config(cfg)
        validate_config(cfg)


def test_every_gpu_recipe_has_a_hardware_estimate_by_the_documented_arithmetic():
    """verl_diffusion/hardware.py: sd35_pickscore_flowgrpo by hand: 48 prompts × 24 images / 8 GPUs = 144 images per
    GPU; CFG 4.5 doubles every forward; 10 sampling steps + 9 trained steps (window off: ⌊0.99·10⌋) × 1 epoch × 4;
    a forward = 2 · 2.5e9 · (1024 + 333 tokens) · 1.15 FLOPs; at 35% of 989 TFLOP/s."""
    from verl_diffusion.hardware import estimate

    names = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    for name in names:
        est = estimate(name, _raw(name))
        assert (est is None) == (name == "tiny_cpu"), name
        if est is not None:
            assert 5 < est.memory_gb < 80 and est.seconds_per_step > 0, (name, est)
    est = estimate("sd35_pickscore_flowgrpo", _raw("sd35_pickscore_flowgrpo"))
    forwards = 144 * 2 * (10 + 9 * 1 * 4)
    assert est.images_per_gpu == 144
    assert est.seconds_per_step == pytest.approx(forwards * 2 * 2.5e9 * 1357 * 1.15 / (989e12 * 0.35))
