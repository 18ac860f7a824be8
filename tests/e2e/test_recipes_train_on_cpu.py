"""Each Qwen-Image / FLUX recipe trains two steps through Ray on CPU, with the tiny model of its architecture built
by ``actor_rollout_ref.model.tiny`` in place of the real weights (saved and loaded through the real path).

One Ray session for all recipes (``run_flowgrpo`` uses an initialised Ray); one worker per run; the recipe's own
loss, sampler, window, steps, grid and guidance, shrunk only in size (64 px, 2 prompts, small groups, 2 steps).
Every reward is replaced by JPEG compressibility: the random tiny models write no text (OCR would score 0 everywhere,
so nothing would train) and PickScore / HPSv3 need weights; the rewards have tests of their own.
Per recipe: the right adapter ran, on the scheduler grid, LoRA with the adapter disabled as reference; both steps
train (finite loss, gradient); the first on-policy micro-step has log-ratio exactly 0 with the recipe's guidance
(Qwen-Image CFG 4 with the norm rescale; FLUX.1's distilled guidance; FLUX.2-klein with CFG 4 added here); the
final ODE validation images exist.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"

# recipe -> (tiny architecture, extra overrides). The first recipe of each architecture also runs the ODE validation.
CASES = {
    "qwenimage_ocr_flowgrpo": ("qwen_image", ["trainer.test_freq=2"]),
    "qwenimage_hpsv3_path_space": ("qwen_image", []),
    "qwenimage_hpsv3_diffusion_nft": ("qwen_image", []),
    "flux2_klein_ocr_flow_dppo": ("flux2_klein", ["actor_rollout_ref.rollout.guidance_scale=4.0", "trainer.test_freq=2"]),
    "flux1_dev_pickscore_flow_dppo": ("flux", ["trainer.test_freq=2"]),
}
PIPELINES = {"qwen_image": "QwenImagePipeline", "flux": "FluxPipeline", "flux2_klein": "Flux2KleinPipeline"}


@pytest.fixture(scope="module")
def ray_session():
    os.environ["VERL_PLATFORM"] = "cpu"
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "VERL_PLATFORM": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
        "VERL_LOGGING_LEVEL": "WARN"}})
    yield
    ray.shutdown()


def _compose(name: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from verl_diffusion.main_flowgrpo import add_search_path

    argv = ["main_flowgrpo"]
    add_search_path(argv)
    search = [a for a in argv if a.startswith("hydra.searchpath")]
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return compose(config_name=name, overrides=[*search, *overrides])


def _tiny_overrides(name: str, arch: str, tmp_path: Path) -> list[str]:
    raw = _compose(name, [])
    ov = [f"+actor_rollout_ref.model.tiny={{architecture: {arch}, seed: 0}}",
          "actor_rollout_ref.rollout.resolution=64", "data.train_batch_size=2",
          "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
          "actor_rollout_ref.rollout.micro_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
          "actor_rollout_ref.rollout.val_num_steps=4",
          "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2", "trainer.test_freq=-1",
          "trainer.val_before_train=false", "trainer.val_num_images=2", "trainer.save_freq=-1", "trainer.logger=[]",
          f"trainer.run_dir={tmp_path}/run", f"trainer.default_local_dir={tmp_path}/ckpt"]
    ov += ["data.train_files=[pkg://verl_diffusion/data/tiny_train_prompts.txt]",
           "data.val_files=[pkg://verl_diffusion/data/tiny_val_prompts.txt]",
           *[f"~reward.components.{k}" for k in raw.reward.components], "~reward.options",
           "+reward.components.jpeg_compressibility=1.0", "reward.executor=sync"]
    return ov


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    """Every case trained once; failures are kept per recipe so each test reports its own."""
    from verl_diffusion.main_flowgrpo import run_flowgrpo

    out = {}
    for name, (arch, extra) in CASES.items():
        tmp = tmp_path_factory.mktemp(name)
        cfg = _compose(name, ["actor_rollout_ref.model.path=null", *_tiny_overrides(name, arch, tmp), *extra])
        try:
            summary = run_flowgrpo(cfg, finalize=False)
            out[name] = {"summary": summary, "cfg": cfg}
        except Exception as e:   # reported by the recipe's own test
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_recipe_trains_two_steps_with_its_tiny_model(runs, name):
    run = runs[name]
    assert "error" not in run, run.get("error")
    arch = CASES[name][0]
    cfg, summary = run["cfg"], run["summary"]
    # The tiny model of the recipe's architecture was built and loaded through model_index.json.
    assert Path(cfg.actor_rollout_ref.model.path).name == f"tiny_{arch}"
    history = summary["history"]
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert math.isfinite(h["loss"]) and h["grad_norm"] > 0, h
        assert math.isfinite(h["reward/mean"])
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if loss_mode == "flow_grpo":
        # Exactly what was sampled is trained: log-ratio 0 at the first (on-policy) micro-step with CFG 4 (the DPPO,
        # path-space and NFT losses compare means / velocities and log no per-micro-step ratio; the engine test
        # tests/workers/test_arch_engine_on_cpu.py checks every architecture with guidance on).
        assert history[0]["actor/first_micro_log_ratio_abs_max"] == 0.0
    if loss_mode == "flow_dppo":
        # Two mini-batches: the second is off-policy, so the trust-region divergence is measured and positive.
        assert all(math.isfinite(h["actor/dppo_div_max"]) for h in history) and history[0]["actor/dppo_div_max"] > 0
    if "trainer.test_freq=2" in CASES[name][1]:
        assert summary["val_history"] and summary["val_history"][-1]["step"] == 2


def test_workers_ran_the_right_adapter_on_the_scheduler_grid(runs):
    for name, run in runs.items():
        if "error" in run:
            continue
        info = run["summary"].get("worker_info") or {}
        assert info.get("architecture") == PIPELINES[CASES[name][0]], (name, info)
        assert info.get("grid") == "scheduler" and info.get("lora") is True, (name, info)
        assert info.get("reference") == "adapter_disabled", (name, info)
