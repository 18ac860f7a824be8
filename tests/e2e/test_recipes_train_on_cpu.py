"""Each Qwen-Image / FLUX recipe trains two steps through Ray on CPU, with the tiny model of its architecture built
by ``actor_rollout_ref.model.tiny`` in place of the real weights (saved and loaded through the real path).

One subprocess, one Ray session for all recipes and the other e2e modules' in-process runs (tests/e2e/conftest.py;
``run_flowgrpo`` uses an initialised Ray and releases its workers);
one worker per run; the recipe's own loss, sampler, window, steps, grid, dtype, LoRA and guidance, shrunk only in size
(64 px, 2 prompts × 4 images, 2 mini-batches, 2 steps; tests/e2e/recipes_smoke.py). Every reward is replaced by JPEG
compressibility: the random tiny models write no text (OCR would score 0 everywhere, so nothing would train) and
PickScore / HPSv3 need weights; the rewards have tests of their own.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

# recipe -> (tiny architecture, extra overrides). The first recipe of each architecture also runs the ODE validation;
# FLUX.2-klein trains with CFG 4 here (its recipe's Table-1 setting is CFG off) so every architecture runs guided.
CASES = {
    "qwenimage_ocr_flowgrpo": ("qwen_image", ["trainer.test_freq=2"]),
    "qwenimage_hpsv3_path_space": ("qwen_image", []),
    "qwenimage_hpsv3_diffusion_nft": ("qwen_image", []),
    "flux2_klein_ocr_flow_dppo": ("flux2_klein", ["actor_rollout_ref.rollout.guidance_scale=4.0", "trainer.test_freq=2"]),
    "flux1_dev_pickscore_flow_dppo": ("flux", ["trainer.test_freq=2"]),
}
PIPELINES = {"qwen_image": "QwenImagePipeline", "flux": "FluxPipeline", "flux2_klein": "Flux2KleinPipeline"}


SESSION_CASES = [{"kind": "recipe", "case": ":".join([name, arch, ",".join(extra)]) if extra else f"{name}:{arch}"}
                 for name, (arch, extra) in CASES.items()]


@pytest.fixture(scope="module")
def runs(session_runs) -> dict:
    """The recipe rows of the e2e suite's shared Ray session (tests/e2e/conftest.py)."""
    return {r["recipe"]: r for (kind, _), r in session_runs.items() if kind == "recipe"}


@pytest.mark.parametrize("name", list(CASES))
def test_recipe_trains_two_steps_with_its_tiny_model(runs, name):
    run = runs[name]
    assert "error" not in run, run.get("error")
    arch, extra = CASES[name]
    # The tiny model of the recipe's architecture was built and loaded through model_index.json; the workers ran its
    # adapter on the scheduler grid with LoRA, the adapter disabled as the reference.
    assert Path(run["model_path"]).name == f"tiny_{arch}"
    info = run["worker_info"]
    assert info["architecture"] == PIPELINES[arch] and info["grid"] == "scheduler"
    assert info["lora"] is True and info["reference"] == "adapter_disabled"
    history = run["history"]
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert math.isfinite(h["loss"]) and h["grad_norm"] > 0, h
        assert math.isfinite(h["reward/mean"])
    if run["loss_mode"] == "flow_grpo":
        # Exactly what was sampled is trained: log-ratio 0 at the first (on-policy) micro-step with CFG 4 (the DPPO,
        # path-space and NFT losses compare means / velocities and log no per-micro-step ratio; the engine test
        # tests/workers/test_arch_engine_on_cpu.py checks every architecture with guidance on).
        assert history[0]["actor/first_micro_log_ratio_abs_max"] == 0.0
    if run["loss_mode"] == "flow_dppo":
        # Two mini-batches: the second is off-policy, so the trust-region divergence is measured and positive.
        assert all(math.isfinite(h["actor/dppo_div_max"]) for h in history) and history[0]["actor/dppo_div_max"] > 0
    if run["loss_mode"] == "path_space":
        # The prepare hook ran in the worker over whole groups before mini-batching: the estimator's value gradient
        # (SPEC §7) reached the loss at every step.
        assert all(math.isfinite(h["actor/ps_estimator_norm"]) and h["actor/ps_estimator_norm"] > 0 for h in history)
    if run["loss_mode"] == "diffusion_nft":
        # SPEC §8.2 through Ray (the recipe's old policy: schedule nft, type 1, θ_old samples the rollouts and gives
        # v_old): after each step's training θ_old ← d·θ_old + (1 − d)·θ with d = 0.001·n, n = optimizer steps
        # (2 mini-batches per step).
        assert [h["actor/old_policy_decay"] for h in history] == pytest.approx([0.002, 0.004])
    if "trainer.test_freq=2" in extra:
        assert run["val_history"] and run["val_history"][-1]["step"] == 2
        # The LoRA the run exported at its end, loaded by the stock pipeline on the base model, samples what the
        # trainer's own validation sampled at step 2 (the run's only validation: validation/baseline.pt).
        from exported_model import assert_export_samples_validation

        assert_export_samples_validation(run["model"], run["run_dir"], kind="lora")
