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


# ---------------------------------------------------------------- zero-advantage filtering (SPEC §2.3)

def test_filter_zero_advantage_numbers():
    from verl_diffusion.trainer.train_masks import filter_zero_advantage

    mask = torch.tensor([[1, 1, 0]] * 5 + [[0, 0, 0]], dtype=torch.int32)
    a = torch.tensor([0.5, 0.0, -0.5, 0.0, 1.0, 0.0])
    out, m = filter_zero_advantage(mask, a[:, None] * mask)
    assert out.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0], [1, 1, 0], [0, 0, 0]]
    assert m == {"actor/filtered_frac": pytest.approx(2 / 5), "actor/filter_skipped": 0.0}
    # every trained sample has A = 0: nothing is dropped (an update needs a forward)
    out, m = filter_zero_advantage(mask, torch.zeros(6, 3))
    assert out is mask and m == {"actor/filtered_frac": 0.0, "actor/filter_skipped": 1.0}


def test_trainer_filters_after_advantages_only_when_asked():
    # group b = [0, 0, 0, 1] -> nonzero A; group a = [2, 2, 2, 2] -> A = 0 for all four
    rewards = (2.0, 2.0, 2.0, 2.0, 0.0, 0.0, 0.0, 1.0)
    tr, b = _trainer(filt=True), _batch(rewards)
    tr._compute_advantage(b)
    m = tr._filter_zero_advantage(b)
    assert m["actor/filtered_frac"] == pytest.approx(0.5)
    assert torch.all(b.batch["train_mask"][:4] == 0) and torch.all(b.batch["train_mask"][4:] == 1)
    assert torch.equal(b.batch["response_mask"], b.batch["train_mask"])
    b2 = _batch(rewards)
    _trainer()._compute_advantage(b2)
    assert _trainer()._filter_zero_advantage(b2) == {} and torch.all(b2.batch["train_mask"] == 1)


def _kde_rows(gen, a, B=6, N=4, shape=(2, 3)):
    from verl_diffusion.algos import sde

    sig = sde.make_grid(N, 3.0, dtype=torch.float32)
    coefs = [sde.sampler_coefficients("flow_sde", sig, k, noise_level=0.7) for k in range(N)]
    mask = torch.ones(B, N, dtype=torch.int32)
    return {"all_latents": torch.randn(B, N + 1, *shape, generator=gen), "sigmas": sig.expand(B, N + 1).clone(),
            "sde_cx": torch.stack([c.c_x for c in coefs]).expand(B, N).clone(),
            "sde_cv": torch.stack([c.c_v for c in coefs]).expand(B, N).clone(),
            "sde_std": torch.stack([c.std for c in coefs]).expand(B, N).clone(),
            "old_velocities": torch.randn(B, N, *shape, generator=gen), "train_mask": mask,
            "advantages": a[:, None] * mask, "group_ids": torch.arange(B) // 3}


def _kde_loss():
    from verl_diffusion.workers.step_loss import make_step_loss

    return make_step_loss("path_space", {"preset": "ps_kde", "kl_coef": 0.0, "kde_bandwidth": 1.0})


def test_filtered_samples_stay_kde_pool_members():
    """The loss sees only kept items, but ĝ of a kept sample is the one computed over its whole group."""
    from verl_diffusion.trainer.train_masks import filter_zero_advantage
    from verl_diffusion.workers.step_loss import PREP_PREFIX, prepare_steps, run_step_loss

    a = torch.tensor([0.8, 0.0, -0.8, 1.2, -0.4, 0.0])        # samples 1 and 5 have A = 0
    rows = _kde_rows(torch.Generator().manual_seed(7), a)
    loss, key, k = _kde_loss(), PREP_PREFIX + "value_direction", 1
    full = prepare_steps(loss, rows)[key][:, k]                # every sample trained
    rows["train_mask"], m = filter_zero_advantage(rows["train_mask"], rows["advantages"])
    assert m["actor/filtered_frac"] == pytest.approx(2 / 6)
    rows.update(prepare_steps(loss, rows))
    keep = torch.tensor([0, 2, 3, 4])
    torch.testing.assert_close(rows[key][keep, k], full[keep])
    # without the zero-advantage members in the pool the kept samples' ĝ would differ
    sub = {n: (v[keep] if n != "prep/value_direction" else v) for n, v in rows.items()}
    sub["group_ids"] = torch.tensor([0, 0, 1, 1])
    without = prepare_steps(loss, sub)[key][:, k]
    assert not torch.allclose(rows[key][keep, k], without)
    out, n, _, _ = run_step_loss(loss, rows, k, velocity_fn=lambda x, t, r: 0.9 * x)
    assert n == 4 and torch.isfinite(out.loss)


def test_untrained_pool_member_keeps_its_advantage():
    """Per-sample step subsets: a sample not trained at k is still a KDE pool member with its own A_j."""
    from verl_diffusion.workers.step_loss import PREP_PREFIX, prepare_steps

    a = torch.tensor([0.8, 0.3, -1.1, 1.2, -0.4, -0.8])
    rows = _kde_rows(torch.Generator().manual_seed(8), a)
    loss, key, k = _kde_loss(), PREP_PREFIX + "value_direction", 1
    full = prepare_steps(loss, rows)[key][:, k]
    rows["train_mask"] = rows["train_mask"].clone()
    rows["train_mask"][0, k] = 0                               # sample 0 trains other steps, not k
    rows["advantages"] = a[:, None] * rows["train_mask"]        # the estimator broadcasts onto the mask only
    got = prepare_steps(loss, rows)[key][:, k]
    torch.testing.assert_close(got[1:], full[1:])
