"""The verl-facing adapters of registry.py, called through verl's own registries (SPEC §2 numbers)."""

import numpy as np
import pytest
import torch

import verl  # noqa: F401  - loads the plugin through the entry point
from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn
from omegaconf import OmegaConf

REWARDS = torch.tensor([0.0, 1, 2, 3, 5, 5, 5, 5, 7])
UIDS = np.array(["a"] * 4 + ["b"] * 4 + ["c"])
GLOBAL = [-0.694333, -0.231444, 0.231444, 0.694333, 0, 0, 0, 0, 0]
GROUP = [-1.341521, -0.447174, 0.447174, 1.341521, 0, 0, 0, 0, 0]


def test_flow_grpo_estimator_through_verl_matches_spec():
    mask = torch.ones(9, 3, dtype=torch.int32)
    adv, ret = get_adv_estimator_fn("flow_grpo")(sample_level_rewards=REWARDS, response_mask=mask, index=UIDS)
    assert adv.shape == (9, 3)
    torch.testing.assert_close(adv[:, 0], torch.tensor(GLOBAL), atol=1e-6, rtol=0)
    assert torch.equal(adv[:, 0], adv[:, 2]) and torch.equal(adv, ret)


def test_flow_grpo_estimator_group_std_and_token_level_input():
    cfg = OmegaConf.create({"flow_grpo": {"std_mode": "group"}})
    token = torch.zeros(9, 4)
    token[:, -1] = REWARDS  # verl's generic path: the outcome reward on the last token
    adv, _ = get_adv_estimator_fn("flow_grpo")(token_level_rewards=token, response_mask=torch.ones(9, 4),
                                               index=UIDS, config=cfg)
    torch.testing.assert_close(adv[:, 1], torch.tensor(GROUP), atol=1e-6, rtol=0)


def test_flow_grpo_estimator_reads_verl_norm_flag():
    cfg = OmegaConf.create({"norm_adv_by_std_in_grpo": False})
    adv, _ = get_adv_estimator_fn("flow_grpo")(sample_level_rewards=REWARDS, response_mask=torch.ones(9, 1),
                                               index=UIDS, config=cfg)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-1.5, -0.5, 0.5, 1.5, 0, 0, 0, 0, 0]))


def test_gdpo_estimator_reads_reward_components_from_batch():
    batch = {"reward_components/a": torch.tensor([1.0, 0, 1, 1]),
             "reward_components/b": torch.tensor([0.6, 0.2, 0.3, 0.9])}
    adv, _ = get_adv_estimator_fn("flow_grpo_gdpo")(sample_level_rewards=torch.zeros(4), batch=batch,
                                                    response_mask=torch.ones(4, 2), index=np.array([0, 0, 1, 1]))
    torch.testing.assert_close(adv[:, 0], torch.tensor([1.264911, -1.264911, -0.632456, 0.632456]),
                               atol=1e-5, rtol=0)


def test_token_policy_loss_path_on_policy():
    """flow_grpo with kl_coef = 0 runs through verl's PolicyLossFn call: on-policy loss = −mean A."""
    fn = get_policy_loss_fn("flow_grpo")
    lp = torch.randn(4, 3)
    adv = torch.randn(4, 3)
    mask = torch.tensor([[1, 1, 0]] * 4)
    cfg = OmegaConf.create({"policy_loss": {"kl_coef": 0.0}})
    loss, metrics = fn(lp, lp.clone(), adv, mask, "token-mean", cfg)
    torch.testing.assert_close(loss, -adv[:, :2].mean())
    assert metrics["actor/clipfrac"] == 0.0


def test_engine_only_loss_refused_on_token_path_with_reason():
    with pytest.raises(ValueError, match="path_space.*diffusion engine"):
        get_policy_loss_fn("path_space")(torch.zeros(2, 1), torch.zeros(2, 1), torch.ones(2, 1),
                                         torch.ones(2, 1), "token-mean", None)


def test_unknown_loss_mode_lists_valid_names():
    from verl_diffusion.algos.losses import get_loss_spec

    with pytest.raises(ValueError, match=r"loss_mode='nope' is unknown; choose one of \[.*'flow_dppo'.*\]"):
        get_loss_spec("nope")
