"""RayFlowGRPOTrainer's token-free helpers, without Ray: advantages through verl's registry, the on-policy
old-log-prob bypass, metric reduction, and its place in verl's V1 trainer registry."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl_diffusion.trainer.console import progress_line, validation_line
from verl_diffusion.trainer.flowgrpo_trainer import RayFlowGRPOTrainer
from verl_diffusion.trainer.metrics import reduce_worker_metrics, reward_metrics


class _StubTrainer(RayFlowGRPOTrainer):
    """The trainer without __init__: its typed rollout settings are re-read from the stub's DictConfig (on the YAML's
    defaults) at each access, so a test may edit the config in between."""

    @property
    def run_config(self):
        from types import SimpleNamespace

        from verl_diffusion.config.schema import RolloutSection, yaml_section

        node = OmegaConf.merge(yaml_section("actor_rollout_ref.rollout"), self.config.actor_rollout_ref.rollout)
        return SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=RolloutSection.from_node(node)))


def _trainer(epochs=1, mini=2, bs=2, n=4):
    tr = object.__new__(_StubTrainer)
    tr.config = OmegaConf.create({
        "algorithm": {"adv_estimator": "flow_grpo", "norm_adv_by_std_in_grpo": True,
                      "flow_grpo": {"std_mode": "global", "adv_eps": 1e-4, "adv_clip_max": 5.0}},
        "data": {"train_batch_size": bs},
        "actor_rollout_ref": {"actor": {"ppo_epochs": epochs, "ppo_mini_batch_size": mini},
                              "rollout": {"n": n, "recompute_old_log_prob": False}}})
    return tr


def _batch():
    mask = torch.tensor([[1, 1, 0]] * 8, dtype=torch.int32)
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 1.0])
    return DataProto.from_dict(
        tensors={"sample_level_rewards": rewards, "train_mask": mask, "rollout_log_probs": torch.randn(8, 3)},
        non_tensors={"uid": np.array(["a"] * 4 + ["b"] * 4, dtype=object)})


def test_trainer_is_verls_v1_sync_trainer_under_its_own_name():
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.v1 import PPOTrainerSync, get_trainer_cls

    assert issubclass(RayFlowGRPOTrainer, PPOTrainerSync)
    assert not issubclass(RayFlowGRPOTrainer, RayPPOTrainer)           # the deprecated legacy trainer is gone
    assert get_trainer_cls("diffusion_sync") is RayFlowGRPOTrainer
    assert get_trainer_cls("sync") is PPOTrainerSync                    # verl's own name is left alone


def test_advantages_through_verls_registry():
    tr, batch = _trainer(), _batch()
    m = tr._compute_advantage(batch)
    adv = batch.batch["advantages"]
    assert adv.shape == (8, 3)
    assert torch.all(adv[:, 2] == 0)                       # broadcast onto train_mask only
    assert torch.allclose(adv[:4, 0].sum(), torch.tensor(0.0), atol=1e-5)
    r = batch.batch["sample_level_rewards"]
    # std over the 8 samples (global), not over the 16 masked (sample, step) items
    ref = (r[:4] - r[:4].mean()) / (r.std(unbiased=False) + 1e-4)
    assert torch.allclose(adv[:4, 0], ref, atol=1e-5)
    assert m["advantages/abs_max"] == pytest.approx(float(adv.abs().max()))
    assert torch.equal(batch.batch["response_mask"], batch.batch["train_mask"])


def test_on_policy_bypass_and_off_policy_detection():
    tr, batch = _trainer(), _batch()
    assert tr._on_policy()
    assert tr._compute_old_log_prob(batch) == {}
    assert batch.batch["old_log_probs"] is batch.batch["rollout_log_probs"]
    assert not _trainer(epochs=2)._on_policy()
    assert not _trainer(mini=1)._on_policy()


def test_reward_metrics_zero_std_ratio():
    batch = _batch()
    m = reward_metrics(batch.batch["sample_level_rewards"], batch.non_tensor_batch["uid"], {})
    assert m["reward/zero_std_ratio"] == 0.0
    same = torch.tensor([1.0, 1.0, 2.0, 3.0])
    m = reward_metrics(same, np.array(["x", "x", "y", "y"]), {"jpeg": same})
    assert m["reward/zero_std_ratio"] == 0.5 and m["reward/jpeg/mean"] == pytest.approx(1.75)
    # the strict (all-correct) detail: group x all wrong, y all right, z mixed; a per-tag NaN group is left out
    strict = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, float("nan"), float("nan")])
    m = reward_metrics(torch.arange(8.0), np.array(list("xxyyzzww")), {},
                       details={"shapes/strict": strict, "shapes/strict/colors": strict})
    assert m["reward/shapes/strict/zero_std_ratio"] == pytest.approx(2 / 3)
    assert m["reward/shapes/strict/all_wrong_ratio"] == pytest.approx(1 / 3)
    assert "reward/shapes/strict/colors/zero_std_ratio" not in m and m["reward/zero_std_ratio"] == 0.0


def test_worker_metric_reduction_keeps_first_micro_step():
    per_rank = {"actor/log_ratio_abs_max": [[0.0, 0.3], [0.0, 0.1]], "actor/clipfrac": [[0.0, 0.5], [0.5, 1.0]],
                "grad_norm": [0.2, 0.2]}
    out = reduce_worker_metrics(per_rank)
    assert out["actor/first_micro_log_ratio_abs_max"] == 0.0
    assert out["actor/log_ratio_abs_max"] == 0.3 and out["actor/clipfrac"] == 0.5 and out["grad_norm"] == 0.2


def test_progress_line():
    line = progress_line(3, 10, {"reward/mean": -6.0, "reward/std": 0.1, "loss": 1e-5, "timing_s/step": 0.5})
    assert line.startswith("step 3/10 | reward -6.0000±0.1000") and line.endswith("0.5s")
    # 3 steps of this segment in 75 s: 25 s a step, 7 left -> ETA 2:55
    timed = progress_line(3, 10, {"reward/mean": -6.0, "timing_s/step": 0.5}, elapsed=75.0, done=3)
    assert timed.endswith("0.5s | 1:15 elapsed, ETA 2:55")
    assert progress_line(9, 10, {}, elapsed=3725.0, done=1).endswith("1:02:05 elapsed, ETA 1:02:05")


def test_validation_line_prints_every_strict_accuracy():
    line = validation_line(40, {"val/reward_mean": 0.61234, "val/num_images": 96.0, "val/shapes/strict": 0.375,
                                "val/shapes/strict/position": 0.125, "val/shapes/reward/position": 0.5})
    assert line == "validation step 40 | reward 0.6123 | shapes/strict 0.375 (96 images, ODE)"


def _branched_trainer(bs=2, kb=2, steps=(0, 1), num_steps=4, mini=2):
    tr = _trainer(mini=mini, bs=bs, n=8)
    tr.config.actor_rollout_ref.rollout.num_steps = num_steps
    tr.config.trainer = {"seed": 0}
    tr.config.actor_rollout_ref.rollout.branched = {"enabled": True, "num_children": kb, "branch_steps": list(steps)}
    return tr


def test_branched_rows_per_prompt_and_on_policy_accounting():
    tr = _branched_trainer()
    assert tr._rows_per_prompt() == 4 and tr._batch_samples() == 8 and tr._mini_batch_size() == 8
    assert tr._on_policy()
    tr.config.actor_rollout_ref.rollout.branched.branch_steps = None   # all k < N − 1
    assert tr._rows_per_prompt() == 3 * 2
    assert _trainer()._rows_per_prompt() == 4                           # not branched: rollout.n
    gen = tr._gen_batch({"prompt": np.array(["a", "b"], dtype=object)}, step=3)
    assert list(gen.non_tensor_batch["prompt"]) == ["a", "b"]          # each prompt once: the worker branches


def test_branched_driver_step_advantages():
    """Rows prompt → k → child (as the workers return them); step_advantages normalised within (prompt, k) across
    the children, at column k; advantages = the same values on train_mask; uid per (prompt, k)."""
    from verl_diffusion.algos.advantages import process_advantages

    tr = _branched_trainer()
    n_rows, N = 8, 4
    branch_step = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    mask = torch.zeros(n_rows, N, dtype=torch.int32)
    mask[torch.arange(n_rows), branch_step] = 1
    gen = tr._gen_batch({"prompt": np.array(["a", "b"], dtype=object)}, step=3)
    out = {"branch_step": branch_step, "train_mask": mask, "rollout_log_probs": torch.randn(n_rows, N)}
    rows = tr._expand_branched(gen, out, step=3)
    assert list(rows["prompt"]) == ["a"] * 4 + ["b"] * 4
    assert list(rows["uid"]) == ["s3-p0-k0"] * 2 + ["s3-p0-k1"] * 2 + ["s3-p1-k0"] * 2 + ["s3-p1-k1"] * 2
    assert out["prompt_ids"].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    rewards = torch.tensor([1.0, 3.0, 2.0, 2.0, 0.0, 4.0, 5.0, 1.0])
    batch = DataProto.from_dict(tensors={**out, "sample_level_rewards": rewards}, non_tensors=rows)
    metrics = tr._compute_branched_advantage(batch)
    step_adv = batch.batch["step_advantages"]
    expect = process_advantages(rewards, out["prompt_ids"], branch_step)
    assert torch.equal(step_adv[torch.arange(n_rows), branch_step], expect)
    assert torch.equal(step_adv * (1 - mask), torch.zeros_like(step_adv))
    assert torch.equal(batch.batch["advantages"], step_adv) and torch.equal(batch.batch["response_mask"], mask)
    # within (prompt, k): ±1 for distinct children (up to ε_adv), 0 for equal rewards
    assert expect[:2].tolist() == pytest.approx([-1.0, 1.0], abs=1e-3) and expect[2:4].tolist() == [0.0, 0.0]
    assert metrics["advantages/abs_max"] == pytest.approx(float(expect.abs().max()))


def test_group_image_std_is_zero_for_identical_groups_and_the_pixel_std_otherwise():
    from verl_diffusion.trainer.metrics import group_image_std

    imgs = torch.zeros(4, 3, 2, 2, dtype=torch.uint8)
    uids = np.array(["a", "a", "b", "b"], dtype=object)
    assert group_image_std(imgs, uids) == 0.0
    imgs[1] = 255  # group a: pixels 0 and 1 -> std 0.5 everywhere; group b identical -> 0
    assert group_image_std(imgs, uids) == pytest.approx(0.25)
    single = np.array(["a", "b", "c", "c"], dtype=object)  # groups of one do not count
    assert group_image_std(imgs, single) == 0.0
