"""The driver's share of a step between rollout and update: scoring the images with the reward components
(failures counted per reward, reward_health.py) and the advantages through verl's registered estimator."""

from __future__ import annotations

import torch
from verl import DataProto
from verl.trainer.ppo.core_algos import get_adv_estimator_fn

from verl_diffusion.trainer.artifacts import row_metadata
from verl_diffusion.trainer.console import warn
from verl_diffusion.trainer.metrics import advantage_summary, group_image_std, reward_metrics


class ScoringMixin:
    """Rewards and advantages of a step's batch (the trainer's ``reward_fn``, ``reward_health``, ``no_signal``)."""

    def _compute_reward(self, batch: DataProto, images: torch.Tensor, step: int = 0) -> dict[str, float]:
        """Score the step's images; failures per reward are counted, reported in the metrics and the progress
        line, and a warning marks each fault's start and end (reward_health.RewardHealth)."""
        meta = row_metadata(batch.non_tensor_batch, len(batch))
        res = self.reward_fn(images, list(batch.non_tensor_batch["prompt"]), meta)
        batch.batch["sample_level_rewards"] = res.scores.float()
        for name, c in res.components.items():
            batch.batch[f"reward_components/{name}"] = c.float()
        out = reward_metrics(res.scores, batch.non_tensor_batch["uid"], res.components, res.failures,
                             details=res.details)
        # mode collapse / reward hacking shows as groups of near-identical images (benchmarks/compare_algorithms.py)
        out["rollout/group_image_std"] = group_image_std(images, batch.non_tensor_batch["uid"])
        out.update({f"reward/{k}" if not k.startswith("reward/") else k: float(v)
                    for k, v in (res.metrics or {}).items() if isinstance(v, (int, float))})
        health, events = self.reward_health.update(step, res.failures or {}, len(batch),
                                                   getattr(res, "causes", None))
        out.update(health)
        signal_line = self.no_signal.update(step, out)
        for line in events + ([signal_line] if signal_line else []):
            warn(line)
        return out

    def _compute_advantage(self, batch: DataProto) -> dict[str, float]:
        """verl's registered estimator (``algorithm.adv_estimator``) on sample rewards, broadcast to steps."""
        batch.batch["response_mask"] = batch.batch["train_mask"]
        fn = get_adv_estimator_fn(self.config.algorithm.adv_estimator)
        kwargs = dict(sample_level_rewards=batch.batch["sample_level_rewards"],
                      response_mask=batch.batch["response_mask"], index=batch.non_tensor_batch["uid"],
                      config=self.config.algorithm)
        comp = sorted(k for k in batch.batch.keys() if str(k).startswith("reward_components/"))
        if comp and self.config.algorithm.adv_estimator == "flow_grpo_gdpo":
            kwargs["reward_components"] = torch.stack([batch.batch[k] for k in comp], dim=-1)
        adv, returns = fn(**kwargs)
        batch.batch["advantages"] = adv.float()
        batch.batch["returns"] = returns.float()
        return advantage_summary(adv, batch.batch["response_mask"])
