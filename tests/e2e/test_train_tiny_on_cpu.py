"""End to end on CPU through Ray, verl's worker group, TrainingWorker, our engine, the rollout and the trainer.

Three claims, each from ``python -m verl_diffusion.main_flowgrpo`` runs (the real entry point):

1. the reward goes up: mean reward over the last K steps exceeds the first K steps' by more than
   Z = 3 standard errors of the difference of the per-step means (Welch; each per-step mean averages
   train_batch_size × n images), a margin that sampling noise alone crosses with probability < 0.2 %;
2. the importance ratio is exactly 1 at the first on-policy micro-step (training forwards the same batch
   composition as the rollout, so ℓ_train = ℓ_rollout bitwise; |log ratio| = 0, not just small);
3. a run killed (SIGINT) after its checkpoint at step L and resumed with resume_mode=auto logs the same
   metrics at step L+1 as an uninterrupted run with the same seed.
"""

import json
import math
import os
import subprocess
import sys

import pytest

# The tiny_cpu defaults, spelled out (they learn within ~1.5 minutes on 2 cores).
LEARN = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.micro_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.sde.noise_level=1.0",
         "actor_rollout_ref.rollout.sde.window.size=5", "actor_rollout_ref.rollout.sde.window.hi=5",
         "trainer.logger=[]"]
STEPS = int(os.environ.get("VD_E2E_STEPS", "100"))
LR = os.environ.get("VD_E2E_LR", "3e-3")
K = STEPS // 4
Z = 3.0


def _run(root, *overrides, timeout=600):
    env = dict(os.environ, VERL_DIFFUSION_RUN_ROOT=str(root), RAY_DEDUP_LOGS="1")
    res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", *overrides], capture_output=True,
                         text=True, env=env, timeout=timeout)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-5000:])
    with open(os.path.join(root, "tiny_cpu", "metrics.jsonl")) as f:
        return [json.loads(line) for line in f], res.stdout


@pytest.fixture(scope="module")
def learning_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    rows, out = _run(root, f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1",
                     f"actor_rollout_ref.actor.optim.lr={LR}", *LEARN)
    return root, rows, out


def _mean_se(xs):
    m = sum(xs) / len(xs)
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def test_reward_goes_up_beyond_noise(learning_run):
    root, rows, out = learning_run
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == STEPS
    first, se1 = _mean_se(rewards[:K])
    last, se2 = _mean_se(rewards[-K:])
    margin = Z * math.sqrt(se1 ** 2 + se2 ** 2)
    print(f"reward first {K}: {first:.4f}±{se1:.4f}  last {K}: {last:.4f}±{se2:.4f}  diff {last - first:.4f} "
          f"margin {margin:.4f}")
    assert last - first > margin, (first, last, margin)
    assert "reward_curve:" in out and os.path.isfile(os.path.join(root, "tiny_cpu", "reward_curve.png"))


def test_first_on_policy_micro_step_has_ratio_exactly_one(learning_run):
    _, rows, _ = learning_run
    assert rows[0]["actor/first_micro_log_ratio_abs_max"] == 0.0


def test_killed_run_resumes_like_an_uninterrupted_one(tmp_path):
    """Kill (SIGINT) a run once its first checkpoint is written, resume with resume_mode=auto, compare step L+1."""
    import signal
    import time

    k = 3
    common = ["trainer.test_freq=-1", "trainer.val_before_train=false", *LEARN]
    root = tmp_path / "killed"
    tracker = root / "tiny_cpu" / "checkpoints" / "latest_checkpointed_iteration.txt"
    env = dict(os.environ, VERL_DIFFUSION_RUN_ROOT=str(root))
    proc = subprocess.Popen([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "trainer.total_training_steps=200",
                             f"trainer.save_freq={k}", "trainer.max_actor_ckpt_to_keep=2", *common],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        deadline = time.time() + 300
        while not tracker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert tracker.exists(), "the run wrote no checkpoint"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    last = int(tracker.read_text().strip())
    assert last % k == 0 and last < 200
    resumed, out = _run(root, f"trainer.total_training_steps={last + 1}", "trainer.resume_mode=auto", *common)
    assert [r["step"] for r in resumed] == [last + 1], out[-2000:]
    full, _ = _run(tmp_path / "full", f"trainer.total_training_steps={last + 1}", *common)
    a, b = full[last], resumed[0]
    for key in ("reward/mean", "reward/std", "advantages/abs_max", "loss", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (key, a[key], b[key])


def test_lora_cfg_ema_off_policy_through_ray(tmp_path):
    """LoRA (reference = adapter disabled), CFG 4.5 in rollout and training, EMA, 2 epochs × 2 mini-batches
    (old log-probs recomputed): the recompute equals the rollout's log-probs and ratio = 1 at the first micro-step."""
    rows, out = _run(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.val_before_train=false",
                     "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                     "actor_rollout_ref.rollout.guidance_scale=4.5", "actor_rollout_ref.actor.ema.enable=true",
                     "actor_rollout_ref.actor.ema.interval=1", "actor_rollout_ref.actor.ppo_epochs=2",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=2", *LEARN)
    assert "LoRA r4 | reference adapter_disabled" in out
    for r in rows:
        assert r["rollout/train_rollout_log_prob_abs_max"] == 0.0
        assert r["actor/first_micro_log_ratio_abs_max"] == 0.0
        assert r["grad_norm"] > 0 and math.isfinite(r["loss"])
    assert "val/reward_mean" in rows[-1]


@pytest.mark.parametrize("mode", ["diffusion_nft", "path_space"])
def test_losses_with_per_step_preparation_through_ray(tmp_path, mode):
    """Forward-noising states + fresh old velocities (diffusion_nft) and the path-space prepare hook run in the
    worker over whole groups before mini-batching; 2 steps train with finite loss."""
    rows, _ = _run(tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=-1",
                   f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}", *LEARN)
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0


def test_resume_at_an_epoch_boundary(tmp_path):
    """8 prompts / 4 per step = 2 steps per epoch: a checkpoint at step 4 ends an epoch, where verl does not restore
    the dataloader; the epoch-seeded sampler still gives step 5 the prompts of the uninterrupted run."""
    k = 4
    common = ["trainer.test_freq=-1", "trainer.val_before_train=false", *LEARN]
    _run(tmp_path / "b", f"trainer.total_training_steps={k}", f"trainer.save_freq={k}", *common)
    resumed, out = _run(tmp_path / "b", f"trainer.total_training_steps={k + 1}", *common)
    full, _ = _run(tmp_path / "a", f"trainer.total_training_steps={k + 1}", *common)
    assert [r["step"] for r in resumed] == [k + 1], out[-2000:]
    for key in ("reward/mean", "reward/std", "loss", "grad_norm"):
        assert full[k][key] == pytest.approx(resumed[0][key], rel=1e-6, abs=1e-9), key


def test_diffusion_nft_with_soft_old_policy_through_ray(tmp_path):
    """SPEC §8.2 through Ray: diffusion_nft with actor.old_policy schedule nft type 1 (θ_old samples the rollouts
    and gives v_old); after each step's training θ_old ← d·θ_old + (1 − d)·θ with d = 0.001·n, n = optimizer steps."""
    rows, _ = _run(tmp_path, "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
                   "actor_rollout_ref.actor.policy_loss.loss_mode=diffusion_nft",
                   "actor_rollout_ref.actor.old_policy.schedule=nft", "actor_rollout_ref.actor.old_policy.nft_type=1",
                   *LEARN)
    assert [r["actor/old_policy_decay"] for r in rows] == pytest.approx([0.001, 0.002, 0.003])
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0


def test_tempflow_branched_rollout_through_ray(tmp_path):
    """TempFlow-GRPO (SPEC §3.3) through Ray: branched rollout (ODE trunk, 2 children at k ∈ {0, 1} of N = 4),
    process advantages within (prompt, k) on the driver, micro-batches mixing branch steps in the engine."""
    rows, out = _run(tmp_path, "trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
                     "trainer.logger=[]", "data.train_batch_size=2", "actor_rollout_ref.rollout.num_steps=4",
                     "actor_rollout_ref.rollout.micro_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                     "actor_rollout_ref.rollout.sde.noise_level=1.0", "actor_rollout_ref.rollout.sde.window.size=2",
                     "actor_rollout_ref.rollout.sde.window.hi=3", "actor_rollout_ref.actor.policy_loss.loss_mode=tempflow_grpo",
                     "actor_rollout_ref.rollout.branched.enabled=true",
                     "actor_rollout_ref.rollout.branched.branch_steps=[0,1]")
    assert "loss tempflow_grpo" in out and "8 images/step" in out     # 2 prompts × 2 branch steps × 2 children
    assert len(rows) == 3
    assert rows[0]["actor/first_micro_log_ratio_abs_max"] == 0.0
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["advantages/abs_max"] > 0
