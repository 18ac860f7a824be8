"""Driver-side train-mask edits: DanceGRPO's per-sample step subset (SPEC §3.1) and zero-advantage filtering
(SPEC §2.3)."""

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl_diffusion.trainer.flowgrpo_trainer import RayFlowGRPOTrainer
from verl_diffusion.trainer.train_masks import steps_to_keep, subsample_train_steps


def _window(B=64, N=10, lo=0, hi=10):
    m = torch.zeros(B, N, dtype=torch.int32)
    m[:, lo:hi] = 1
    return m


def test_steps_to_keep_is_dancegrpos_floor_with_at_least_one():
    n = torch.tensor([10, 5, 3, 1, 0, 2])
    assert steps_to_keep(n, 0.6).tolist() == [6, 3, 1, 1, 0, 1]
    assert steps_to_keep(n, 1.0).tolist() == n.tolist()
    assert steps_to_keep(torch.tensor([10]), 0.01).tolist() == [1]


def test_fraction_inside_the_window_and_independent_per_sample():
    mask = _window(B=256, N=10, lo=1, hi=9)                 # 8 window steps per sample
    out = subsample_train_steps(mask, 0.6, torch.Generator().manual_seed(0))
    assert out.dtype == mask.dtype and out.shape == mask.shape
    assert torch.all(out.sum(dim=1) == 4)                   # ⌊0.6·8⌋ = 4 per sample
    assert torch.all(out[:, 0] == 0) and torch.all(out[:, 9] == 0)   # never outside the window
    # independent per sample: many distinct subsets, each window step chosen ~ half of the time
    assert len({tuple(r.tolist()) for r in out}) > 50
    freq = out[:, 1:9].float().mean(dim=0)
    assert torch.all((freq - 0.5).abs() < 0.12), freq


def test_at_least_one_step_and_unchanged_at_one():
    mask = torch.tensor([[1, 0, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.int32)
    out = subsample_train_steps(mask, 0.1, torch.Generator().manual_seed(1))
    assert out.sum(dim=1).tolist() == [1, 1, 0]
    assert torch.all(out <= mask)
    assert subsample_train_steps(mask, 1.0) is mask
    with pytest.raises(ValueError, match="train_step_fraction"):
        subsample_train_steps(mask, 0.0)


def test_deterministic_given_the_seed():
    mask = _window()
    a = subsample_train_steps(mask, 0.6, torch.Generator().manual_seed(5))
    b = subsample_train_steps(mask, 0.6, torch.Generator().manual_seed(5))
    c = subsample_train_steps(mask, 0.6, torch.Generator().manual_seed(6))
    assert torch.equal(a, b) and not torch.equal(a, c)


def _trainer(frac=1.0, filt=False, seed=0):
    tr = object.__new__(RayFlowGRPOTrainer)
    tr.config = OmegaConf.create({
        "algorithm": {"adv_estimator": "flow_grpo", "norm_adv_by_std_in_grpo": True,
                      "flow_grpo": {"std_mode": "global", "adv_eps": 1e-4, "adv_clip_max": 5.0,
                                    "filter_zero_advantage": filt}},
        "trainer": {"seed": seed},
        "data": {"train_batch_size": 2},
        "actor_rollout_ref": {"actor": {"ppo_epochs": 1, "ppo_mini_batch_size": 2, "train_step_fraction": frac},
                              "rollout": {"n": 4, "recompute_old_log_prob": False}}})
    return tr


def _batch(rewards=(1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 1.0), N=10):
    B = len(rewards)
    return DataProto.from_dict(
        tensors={"sample_level_rewards": torch.tensor(rewards), "train_mask": _window(B, N),
                 "rollout_log_probs": torch.randn(B, N)},
        non_tensors={"uid": np.array(["a"] * 4 + ["b"] * (B - 4), dtype=object)})


def test_trainer_step_subset_is_seeded_by_step_and_feeds_advantages():
    tr = _trainer(frac=0.6)
    b1, b2, b3 = _batch(), _batch(), _batch()
    m = tr._subsample_train_steps(b1, step=3)
    tr._subsample_train_steps(b2, step=3)                   # a resumed run at the same step draws the same
    tr._subsample_train_steps(b3, step=4)
    assert torch.equal(b1.batch["train_mask"], b2.batch["train_mask"])
    assert not torch.equal(b1.batch["train_mask"], b3.batch["train_mask"])
    assert torch.all(b1.batch["train_mask"].sum(dim=1) == 6)
    assert m["actor/window_fraction"] == pytest.approx(1.0)
    tr._compute_advantage(b1)
    adv, mask = b1.batch["advantages"], b1.batch["train_mask"]
    assert torch.all(adv[mask == 0] == 0) and torch.all(adv[:4][mask[:4] == 1] != 0)
    # default: untouched
    b = _batch()
    before = b.batch["train_mask"]
    assert _trainer()._subsample_train_steps(b, step=3) == {}
    assert b.batch["train_mask"] is before
