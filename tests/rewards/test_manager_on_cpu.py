"""The verl reward manager: scores a DataProto of images, writes sample_level_rewards and components,
and plugs into verl's reward-loop registry and loader."""

import asyncio

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto

from verl_diffusion.rewards import build_reward
from verl_diffusion.rewards.manager import DiffusionRewardManager, prompt_text, register_reward_managers


def _data(n=4):
    rng = np.random.default_rng(0)
    imgs = np.stack([np.clip(128 + a * rng.standard_normal((3, 16, 16)), 0, 255) for a in (0, 10, 40, 120)][:n])
    return DataProto.from_dict(
        tensors={"images": torch.from_numpy(imgs.astype(np.uint8))},
        non_tensors={
            "prompt": np.array([f'a sign "t{i}"' for i in range(n)], dtype=object),
            "reward_model": np.array([{"style": "rule", "ground_truth": f"t{i}"} for i in range(n)], dtype=object),
            "data_source": np.array(["test"] * n, dtype=object),
        },
    )


def _config():
    return OmegaConf.create({"reward": {"reward_kwargs": {"components": {"jpeg_compressibility": 1.0, "jpeg_incompressibility": 0.25}}}})


def test_compute_writes_rewards_and_components():
    mgr = DiffusionRewardManager(_config(), tokenizer=None, compute_score=None)
    data = _data()
    res = mgr.compute(data)
    comp = data.batch["reward_components/jpeg_compressibility"]
    assert torch.all(comp[1:] < comp[:-1])  # more noise, less compressible
    torch.testing.assert_close(data.batch["sample_level_rewards"], comp * 1.0 + data.batch["reward_components/jpeg_incompressibility"] * 0.25)
    assert data.meta_info["reward_metrics"]["reward/failures/jpeg_compressibility"] == 0.0
    assert res.scores.shape == (4,)
    out = mgr(_data(), return_dict=True)
    assert set(out["reward_extra_info"]) == {"jpeg_compressibility", "jpeg_incompressibility"}


def test_run_single_for_reward_loop():
    mgr = DiffusionRewardManager(_config(), None, None)
    out = asyncio.run(mgr.run_single(_data()[3:4]))
    assert out["reward_score"] < 0 and "jpeg_compressibility" in out["reward_extra_info"]


def test_kwargs_override_config_and_errors_teach():
    mgr = DiffusionRewardManager(_config(), None, None, components={"jpeg_incompressibility": 1.0})
    assert mgr.reward.names == ["jpeg_incompressibility"]
    with pytest.raises(ValueError, match="reward_kwargs.components"):
        DiffusionRewardManager(OmegaConf.create({"reward": {}}), None, None)
    with pytest.raises(ValueError, match="unknown arguments"):
        DiffusionRewardManager(_config(), None, None, colour="red")


def test_prompt_text_from_chat_messages():
    assert prompt_text([{"role": "system", "content": "s"}, {"role": "user", "content": "a cat"}]) == "a cat"
    assert prompt_text(np.array([{"role": "user", "content": "x"}], dtype=object)) == "x"


def test_registered_and_loaded_by_verl():
    from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
    from verl.trainer.ppo.reward import load_reward_manager

    register_reward_managers()
    register_reward_managers()  # idempotent
    assert get_reward_manager_cls("diffusion") is DiffusionRewardManager
    cfg = _config()
    cfg.reward.reward_manager = {"source": "register", "name": "diffusion"}
    cfg.reward.custom_reward_function = {"path": None}
    mgr = load_reward_manager(cfg, tokenizer=None)
    assert isinstance(mgr, DiffusionRewardManager)


def test_unknown_reward_kwargs_keys_and_options_name_the_valid_ones():
    """Issue 12 item 5: a misspelt key under reward.reward_kwargs (or a reward option) is an error listing the
    valid ones, not silently ignored."""
    cfg = OmegaConf.create({"reward": {"reward_kwargs": {"components": {"jpeg_compressibility": 1.0}, "timout": 5}}})
    with pytest.raises(ValueError, match=r"reward\.reward_kwargs has unknown keys \['timout'\]; valid keys: components, "
                                         r"options, penalty, executor, max_workers, timeout"):
        DiffusionRewardManager(config=cfg)
    with pytest.raises(ValueError, match=r"bad options for reward 'jpeg_compressibility': .*qualty.*; valid options: "
                                         r"quality, unit"):
        build_reward({"jpeg_compressibility": 1.0}, options={"jpeg_compressibility": {"qualty": 90}})
