"""verl reward manager for diffusion rollouts: scores a DataProto of decoded images with a MultiReward.

Built on verl 0.9.1's reward-loop mechanism (``verl.experimental.reward_loop.reward_manager``):
``DiffusionRewardManager`` subclasses ``RewardManagerBase``, takes the constructor that
``verl.trainer.ppo.reward.load_reward_manager`` calls (``config, tokenizer, compute_score, **kwargs``) and
implements ``run_single``. The trainer scores whole batches with ``compute(data)``, which writes

    data.batch["sample_level_rewards"]        [B] float32   weighted sum (failures -> penalty)
    data.batch["reward_components/<name>"]    [B] float32   one per reward (GDPO, logging)
    data.meta_info["reward_metrics"]          {"reward/<name>/mean", "reward/failures/<name>", ...}

Input: ``data.batch["images"]`` uint8 [B, 3, H, W]; ``data.non_tensor_batch["prompt"]`` (str, or chat
messages as verl's RLHFDataset yields), ``reward_model`` (dict with ``ground_truth``), optional
``data_source``, ``extra_info``.

Config (``reward.reward_kwargs`` in verl's config; keyword arguments override it)::

    reward:
      reward_manager: {source: register, name: diffusion}
      reward_kwargs:
        components: {ocr: 1.0}                # name -> weight
        options: {ocr: {num_threads: 1}}      # name -> that reward's options
        penalty: 0.0
        executor: sync                        # sync | thread | process
        max_workers: 4
        timeout: null                         # seconds per call in all, every executor (null: no limit)

Nothing here registers at import; ``register_reward_managers()`` does, called by verl_diffusion.registry.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from verl import DataProto
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase

from verl_diffusion.rewards.multi import MultiReward, RewardResult, build_reward

REWARD_MANAGER_NAME = "diffusion"
_BUILD_KEYS = ("components", "options", "penalty", "executor", "max_workers", "timeout")


def prompt_text(prompt: Any) -> str:
    """The text of a prompt cell: a str, or chat messages (the last user message's text content)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        for msg in reversed(prompt):
            if isinstance(msg, Mapping) and msg.get("role", "user") == "user":
                content = msg.get("content", "")
                if isinstance(content, (list, tuple, np.ndarray)):  # [{"type": "text", "text": ...}]
                    return " ".join(c.get("text", "") for c in content if isinstance(c, Mapping))
                return str(content)
    raise ValueError(f"cannot read prompt text from {type(prompt).__name__}: {str(prompt)[:80]!r}")


def _cfg_get(cfg: Any, key: str) -> Any:
    try:
        return cfg.get(key) if cfg is not None else None
    except Exception:
        return None


class DiffusionRewardManager(RewardManagerBase):
    """Scores images with ``build_reward(**reward_kwargs)``. See the module docstring for keys and config."""

    def __init__(
        self,
        config: Any = None,
        tokenizer: Any = None,
        compute_score: Any = None,
        reward_router_address: str | None = None,
        reward_model_tokenizer: Any = None,
        **reward_kwargs: Any,
    ):
        super().__init__(config, tokenizer, compute_score)
        cfg_kwargs = _cfg_get(_cfg_get(config, "reward"), "reward_kwargs") or {}
        unknown_cfg = sorted(set(cfg_kwargs) - set(_BUILD_KEYS))
        if unknown_cfg:
            raise ValueError(f"reward.reward_kwargs has unknown keys {unknown_cfg}; valid keys: {', '.join(_BUILD_KEYS)}")
        kwargs = {k: cfg_kwargs[k] for k in _BUILD_KEYS if k in cfg_kwargs}
        kwargs.update({k: v for k, v in reward_kwargs.items() if k in _BUILD_KEYS})
        unknown = set(reward_kwargs) - set(_BUILD_KEYS)
        if unknown:
            raise ValueError(f"DiffusionRewardManager got unknown arguments {sorted(unknown)}; accepted: {_BUILD_KEYS}")
        if not kwargs.get("components"):
            raise ValueError(
                "DiffusionRewardManager needs reward.reward_kwargs.components, e.g. {jpeg_compressibility: 1.0} "
                "(docs/rewards.md)"
            )
        self.reward: MultiReward = build_reward(**kwargs)

    @staticmethod
    def _inputs(data: DataProto) -> tuple[torch.Tensor, list[str], list[dict]]:
        if "images" not in data.batch.keys():
            raise KeyError("DiffusionRewardManager needs data.batch['images'] (uint8 [B, 3, H, W]) from the rollout")
        images = data.batch["images"]
        ntb = data.non_tensor_batch
        n = images.shape[0]
        if "prompt" in ntb:
            prompts = [prompt_text(p) for p in ntb["prompt"]]
        elif "raw_prompt" in ntb:
            prompts = [prompt_text(p) for p in ntb["raw_prompt"]]
        else:
            raise KeyError("DiffusionRewardManager needs non_tensor_batch['prompt'] (or 'raw_prompt')")
        metadata = []
        for i in range(n):
            row = {}
            for key in ("reward_model", "data_source", "extra_info"):
                if key in ntb:
                    row[key] = ntb[key][i]
            metadata.append(row)
        return images, prompts, metadata

    def compute(self, data: DataProto) -> RewardResult:
        """Score the whole batch; writes ``sample_level_rewards``, ``reward_components/<name>`` and
        ``meta_info['reward_metrics']`` into ``data`` and returns the RewardResult."""
        images, prompts, metadata = self._inputs(data)
        result = self.reward(images, prompts, metadata)
        device = images.device
        data.batch["sample_level_rewards"] = result.scores.to(device)
        for name, comp in result.components.items():
            data.batch[f"reward_components/{name}"] = comp.to(device)
        data.meta_info["reward_metrics"] = dict(result.metrics)
        return result

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict[str, Any]:
        """verl's batch reward-manager call: the [B] rewards, or a dict with ``reward_tensor`` and
        ``reward_extra_info`` (per-component lists) when ``return_dict``."""
        result = self.compute(data)
        if not return_dict:
            return result.scores
        extra = {name: comp.tolist() for name, comp in result.components.items()}
        return {"reward_tensor": result.scores, "reward_extra_info": extra, "reward_metrics": result.metrics}

    async def run_single(self, data: DataProto) -> dict:
        """verl's reward-loop entry: score one row (the reward loop calls it per sample)."""
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(None, lambda: self.reward(*self._inputs(data[-1:])))
        extra = {name: float(comp[0]) for name, comp in result.components.items()}
        extra.update({k: v for k, v in result.metrics.items() if k.startswith("reward/failures/")})
        return {"reward_score": float(result.scores[0]), "reward_extra_info": extra}


def register_reward_managers() -> None:
    """Register ``DiffusionRewardManager`` in verl's reward-loop registry as ``diffusion`` (idempotent).
    Called from verl_diffusion.registry.register_all(); users then set
    ``reward.reward_manager.name=diffusion``."""
    from verl.experimental.reward_loop.reward_manager import register

    register(REWARD_MANAGER_NAME)(DiffusionRewardManager)
