"""Rewards for flow-matching RL: OCR (rapidocr, or a VLM judge), PickScore, HPSv3, JPEG (in)compressibility,
LAION aesthetic, GenEval, the shapes world.

    from verl_diffusion.rewards import build_reward
    reward = build_reward({"ocr": 1.0, "pickscore": 0.5}, options={"pickscore": {"model_path": "/models/pickscore"}})
    result = reward(images_uint8_bchw, prompts, metadata)   # RewardResult: scores [B], components, failures, metrics

Importing this package loads no model and touches no verl registry (``manager.register_reward_managers``
does that, called from ``verl_diffusion.registry``). See docs/rewards.md.
"""

from verl_diffusion.rewards import aesthetic, geneval, hpsv3, jpeg, ocr, pickscore, shapes, vlm_ocr  # noqa: F401  (fill REWARDS)
from verl_diffusion.rewards.base import REWARDS, Reward, RewardOutput, get_reward_cls, register_reward
from verl_diffusion.rewards.multi import EXECUTORS, MultiReward, RewardResult, build_reward

__all__ = [
    "EXECUTORS",
    "REWARDS",
    "MultiReward",
    "Reward",
    "RewardOutput",
    "RewardResult",
    "build_reward",
    "get_reward_cls",
    "register_reward",
]
