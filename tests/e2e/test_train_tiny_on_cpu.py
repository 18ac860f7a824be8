"""End to end on CPU through Ray, verl's worker group, TrainingWorker, our engine, the rollout and the trainer.

Claims, from ``python -m verl_diffusion.main_flowgrpo`` runs (the real entry point) and from runs in the e2e suite's
shared Ray session (tests/e2e/session_smoke.py); the default run (the shapes world) is tests/e2e/test_default_run_on_cpu.py:

1. off-policy LoRA/CFG/EMA, TempFlow's branched rollout: the importance ratio is exactly 1 at the first on-policy
   micro-step and train / rollout log-probs agree exactly;
2. a run whose reward server dies mid-run reports the failures on every progress line, stops on its failure
   budget (exit 3) with a checkpoint; resumed and then stopped by SIGTERM (exit 143, checkpoint), resumed again
   by the same command, its metrics.jsonl covers every step once, equal to an uninterrupted run's, and
   before/after still starts at step 0.

Every run is the JPEG demo (``--config-name tiny_cpu``: a tiny random model, seconds per step).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from geneval_helpers import geneval_prompts, geneval_server

# The tiny_cpu defaults, spelled out.
LEARN = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.rollout.micro_batch_size=8",
         "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.sde.noise_level=1.0",
         "actor_rollout_ref.rollout.sde.window.size=5", "actor_rollout_ref.rollout.sde.window.hi=5",
         "trainer.logger=[]"]
# The fault / resume runs' settings (the prompt files and the server's URL are added per run): validation every step,
# checkpoints only on stops, a weight-0 GenEval reward whose failures count against a budget of 2 steps.
FAULT_COMMON = ["trainer.test_freq=1", "trainer.save_freq=-1", "+reward.components.geneval=0.0",
                "+reward.options.geneval.max_retries=0", "+reward.options.geneval.timeout=10",
                "trainer.reward_failure_budget.max_consecutive_steps=2", *LEARN]
FULL_STEPS = 8   # the uninterrupted reference; the chain ends at step 6 or 7 (SIGTERM after step 5 or 6)


def _run(root, *overrides, timeout=600, rc=0):
    env = dict(os.environ, VERL_DIFFUSION_RUN_ROOT=str(root), RAY_DEDUP_LOGS="1")
    res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name=tiny_cpu", *overrides],
                         capture_output=True, text=True, env=env, timeout=timeout)
    assert res.returncode == rc, (res.returncode, res.stdout[-3000:], res.stderr[-5000:])
    return _metrics(root), res.stdout + res.stderr


def _metrics(root, experiment="tiny_cpu"):
    with open(os.path.join(root, experiment, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


class _Run:
    """A training subprocess whose stdout lines are read as they come (a thread feeds a queue)."""

    def __init__(self, root, *overrides):
        import queue
        import threading

        env = dict(os.environ, VERL_DIFFUSION_RUN_ROOT=str(root), RAY_DEDUP_LOGS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name=tiny_cpu",
                                      *overrides],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines, self.queue = [], queue.Queue()
        self.err = []
        threading.Thread(target=lambda: [self.queue.put(x) for x in self.proc.stdout] + [self.queue.put(None)],
                         daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def wait_for(self, text, timeout=300):
        import time

        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                line = self.queue.get(timeout=1)
            except Exception:
                continue
            if line is None:
                break
            self.lines.append(line)
            if text in line:
                return line
        raise AssertionError(f"no line with {text!r}: {''.join(self.lines)[-3000:]} {''.join(self.err)[-3000:]}")

    def finish(self, timeout=300):
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        while True:
            line = self.queue.get(timeout=30)
            if line is None:
                break
            self.lines.append(line)
        return self.proc.returncode, "".join(self.lines), "".join(self.err)


def test_reward_fault_budget_sigterm_and_resumes_keep_every_step(tmp_path, session_runs):
    """The jpeg reward trains; a GenEval server (weight 0: it changes no score, only the failure accounting) dies
    after step 2. Run A reports `failed geneval 32/32` on each later step, warns once when the fault starts, and
    stops after 2 failing steps (trainer.reward_failure_budget) with exit 3 and a checkpoint at step 4 (save_freq
    is off), the end of an epoch (8 prompts, 4 per step), where verl skips the dataloader state. Run B (the same
    command, a live server) resumes and is stopped by SIGTERM: it finishes its step, saves and exits 143. Run C
    resumes again to the end; a rerun of C says the run is finished and touches nothing. metrics.jsonl holds
    steps 0..L once each, equal to an uninterrupted run's (the same settings, trained in the e2e suite's Ray session
    with a live server); the step-0 validation images survive both resumes for before/after."""
    import signal

    prompts = geneval_prompts(tmp_path / "prompts.jsonl")
    srv, url = geneval_server(die_after_train_requests=2)
    common = [f"data.train_files=[{prompts}]", f"data.val_files=[{prompts}]", *FAULT_COMMON]
    root = tmp_path / "killed"
    run_dir = root / "tiny_cpu"
    a = _Run(root, "trainer.total_training_steps=200", f"+reward.options.geneval.url={url}", *common)
    try:
        a.wait_for("WARNING: reward 'geneval' started failing at step 3: 32/32 samples")
        rc, out, err = a.finish()
    finally:
        srv.shutdown()
        srv.server_close()
        if a.proc.poll() is None:
            a.proc.kill()
    assert rc == 3, (out[-3000:], err[-3000:])
    failing = [ln for ln in out.splitlines() if ln.startswith("step ") and "failed geneval 32/32" in ln]
    assert len(failing) == 2, out[-3000:]                              # the 2 steps of the budget, each reported
    assert out.count("started failing") == 1 and "reward failure: reward 'geneval' failed" in err
    stop_a = int(failing[-1].split("/")[0].split()[1])
    assert stop_a == 4                              # 2 prompts' steps per epoch: B resumes at an epoch boundary
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == str(stop_a)
    rows_a = _metrics(root)
    assert [r["step"] for r in rows_a] == list(range(stop_a + 1))      # the step-0 validation, then every step
    assert [r["reward/geneval/failures"] for r in rows_a[stop_a - 1:]] == [32.0, 32.0]

    srv, url = geneval_server()
    try:
        b = _Run(root, "trainer.total_training_steps=200", f"+reward.options.geneval.url={url}", *common)
        try:
            b.wait_for(f"step {stop_a + 1}/200")
            b.proc.send_signal(signal.SIGTERM)
            rc, out, err = b.finish()
        finally:
            if b.proc.poll() is None:
                b.proc.kill()
        assert rc == 143, (out[-3000:], err[-3000:])
        assert f"resuming from {run_dir}/checkpoints/global_step_{stop_a}" in out and "failed geneval" not in out
        stop_b = int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text())
        assert stop_b > stop_a and f"stopped by SIGTERM after step {stop_b}" in out, (out[-3000:], err[-3000:])
        end = stop_b + 1
        rows, out = _run(root, f"trainer.total_training_steps={end}", f"+reward.options.geneval.url={url}", *common)
        _, again = _run(root, f"trainer.total_training_steps={end}", f"+reward.options.geneval.url={url}", *common)
        assert f"already finished at step {end}" in again and _metrics(root) == rows   # says so, touches nothing
    finally:
        srv.shutdown()
        srv.server_close()
    # the uninterrupted run: the same command's settings in the e2e suite's Ray session, FULL_STEPS >= end steps (a
    # constant learning rate; nothing before step `end` depends on the total), its first end + 1 rows
    full = session_runs[("tiny", "fault_reference")]
    assert "error" not in full, (full["error"], full["out"][-3000:])
    assert end <= FULL_STEPS, (end, FULL_STEPS)
    full = full["rows"][:end + 1]
    assert [r["step"] for r in rows] == [r["step"] for r in full] == list(range(end + 1))
    for a_row, b_row in zip(full[1:], rows[1:]):
        for key in ("reward/mean", "reward/std", "advantages/abs_max", "loss", "grad_norm", "val/reward_mean"):
            assert a_row[key] == pytest.approx(b_row[key], rel=1e-6, abs=1e-9), (a_row["step"], key)
    assert rows[end]["reward/geneval/failures"] == 0.0
    import torch

    assert torch.load(run_dir / "validation" / "baseline.pt", weights_only=True)["step"] == 0
    # the last segment's summary covers the whole run (every segment's rows and validations, from the run's files)
    k = max(1, end // 4)
    first = sum(r["reward/mean"] for r in rows[1:k + 1]) / k
    assert f"reward: first {k} steps {first:.4f} -> " in out and f"validation step 0 -> {end}: reward " in out, out[-2000:]
    assert f"before_after: {run_dir}/before_after.png" in out and json.loads(
        (run_dir / "run_state.json").read_text()) == {"status": "finished", "step": end}


# The short trainings below check features through Ray, not the command line: they run in the e2e suite's shared
# Ray session (tests/e2e/conftest.py, tests/e2e/session_smoke.py), each tiny_cpu with these overrides in a fresh run
# directory (fault_reference: with the GenEval prompt file and a live GenEval server of its own); a row holds the
# run's metrics.jsonl and what the trainer printed.
SESSION_CASES = [{"kind": "tiny", "name": name, "overrides": overrides, "geneval": name == "fault_reference"}
                 for name, overrides in {
    "lora_cfg_ema": ["trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.val_before_train=false",
                     "actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
                     "actor_rollout_ref.rollout.guidance_scale=4.5", "actor_rollout_ref.actor.ema.enable=true",
                     "actor_rollout_ref.actor.ema.interval=1", "actor_rollout_ref.actor.ppo_epochs=2",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.rollout.grid=scheduler",
                     "trainer.save_freq=2", *LEARN],
    "fault_reference": [f"trainer.total_training_steps={FULL_STEPS}", *FAULT_COMMON],
    "tempflow_branched": ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
                          "trainer.logger=[]", "data.train_batch_size=2", "actor_rollout_ref.rollout.num_steps=4",
                          "actor_rollout_ref.rollout.micro_batch_size=4",
                          "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                          "actor_rollout_ref.rollout.sde.noise_level=1.0", "actor_rollout_ref.rollout.sde.window.size=2",
                          "actor_rollout_ref.rollout.sde.window.hi=3",
                          "actor_rollout_ref.actor.policy_loss.loss_mode=tempflow_grpo",
                          "actor_rollout_ref.rollout.branched.enabled=true",
                          "actor_rollout_ref.rollout.branched.branch_steps=[0,1]",
                          # the update's size with gathered parameters kept after the rollout's forwards
                          "actor_rollout_ref.actor.log_update_size=true",
                          "actor_rollout_ref.actor.fsdp_config.reshard_after_forward=false"],
}.items()]


def _session_run(session_runs, name):
    row = session_runs[("tiny", name)]
    assert "error" not in row, (row["error"], row["out"][-3000:])
    return row["rows"], row["out"]


def test_lora_cfg_ema_off_policy_through_ray(session_runs):
    """LoRA (reference = adapter disabled), CFG 4.5 in rollout and training, EMA, 2 epochs × 2 mini-batches
    (old log-probs recomputed): the recompute equals the rollout's log-probs and ratio = 1 at the first micro-step;
    train and rollout log-probs agree exactly on CPU (rollout/logprob_abs_diff: the first mini-batch's forwards vs
    the rollout's log-probs, every step)."""
    rows, out = _session_run(session_runs, "lora_cfg_ema")
    assert "LoRA r4 | reference adapter_disabled" in out
    for r in rows:
        assert r["rollout/train_rollout_log_prob_abs_max"] == 0.0 and r["rollout/logprob_abs_diff"] == 0.0
        assert r["actor/first_micro_log_ratio_abs_max"] == 0.0
        assert r["grad_norm"] > 0 and math.isfinite(r["loss"])
    assert "val/reward_mean" in rows[-1]
    # The model out: the run exported its EMA LoRA into run_dir/model (diffusers' LoRA format); the stock pipeline
    # with it samples the step-2 validation images. The checkpoint keeps the adapter only (no frozen base weights),
    # and exporting it on the CPU (python -m verl_diffusion.export) gives the same tensors as the live export.
    from exported_model import assert_export_samples_validation

    row = session_runs[("tiny", "lora_cfg_ema")]
    info = assert_export_samples_validation(row["model"], row["run_dir"], kind="lora")
    assert info["weights"] == "ema" and info["lora"]["rank"] == 4 and info["lora"]["alpha"] == 8.0
    import torch
    from safetensors.torch import load_file

    actor = Path(row["ckpt_dir"]) / "global_step_2" / "actor"
    shard = torch.load(actor / "model_world_size_2_rank_0.pt", weights_only=False)
    assert shard and all("lora_" in k for k in shard)
    res = subprocess.run([sys.executable, "-m", "verl_diffusion.export", row["ckpt_dir"], "--output",
                          f"{row['run_dir']}/cli_export"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    live = load_file(f"{row['model']}/pytorch_lora_weights.safetensors")
    cli = load_file(f"{row['run_dir']}/cli_export/pytorch_lora_weights.safetensors")
    assert live.keys() == cli.keys() and all(torch.equal(live[k], cli[k]) for k in live)


# The path-space prepare hook (whole groups, in the worker, before mini-batching) and diffusion_nft with the soft old
# policy (SPEC §8.2: schedule nft, type 1, θ_old samples the rollouts) run through Ray in the Qwen-Image recipe runs
# (tests/e2e/test_recipes_train_on_cpu.py): those recipes set exactly these options, so a tiny-model run of each
# here would add half a minute of CI and no check.


def test_tempflow_branched_rollout_through_ray(session_runs):
    """TempFlow-GRPO (SPEC §3.3) through Ray: branched rollout (ODE trunk, 2 children at k ∈ {0, 1} of N = 4),
    process advantages within (prompt, k) on the driver, micro-batches mixing branch steps in the engine; the
    update's size is measured on the shards although the rollout's forwards left the parameters gathered."""
    rows, out = _session_run(session_runs, "tempflow_branched")
    assert "loss tempflow_grpo" in out and "8 images/step" in out     # 2 prompts × 2 branch steps × 2 children
    assert len(rows) == 3
    assert rows[0]["actor/first_micro_log_ratio_abs_max"] == 0.0
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["advantages/abs_max"] > 0
        assert 0 < r["actor/update_rel_norm"] < 1 and r["actor/update_norm"] > 0
