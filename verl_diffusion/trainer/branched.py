"""TempFlow-GRPO's branched rollout on the driver (a mixin of ``RayFlowGRPOTrainer``): rows per prompt, the per-row
data of a branched batch and its process advantages (docs/algorithms.md §3.3; the math: algos/advantages.py)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from verl import DataProto

from verl_diffusion.config.schema import BranchedSettings
from verl_diffusion.trainer.metrics import advantage_summary


def branched_advantages(rewards: torch.Tensor, prompt_ids: torch.Tensor, branch_step: torch.Tensor,
                        train_mask: torch.Tensor, *, eps: float = 1e-4, clip: Optional[float] = 5.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """TempFlow process advantages of a branched batch (docs/algorithms.md §3.3), driver side.

    Args: rewards [B] (one per child image); prompt_ids [B] global prompt index; branch_step [B]; train_mask [B, N].
    Returns (step_advantages [B, N]: the child's advantage, normalised within (prompt, k) across the children, at
    column k; advantages [B, N]: the same values on ``train_mask``, the per-sample fallback that tempflow_grpo reads
    when ``step_advantages`` is absent).
    """
    from verl_diffusion.algos.advantages import branched_step_advantages

    step_adv = branched_step_advantages(rewards.float(), prompt_ids, branch_step, int(train_mask.shape[1]),
                                        eps=eps, clip=clip)
    return step_adv, step_adv * train_mask.to(step_adv.dtype)


class BranchedMixin:
    """Rows per prompt and the branched batch's uids and advantages; plain rollouts when the branched rollout is off."""

    def _branched(self) -> Optional[BranchedSettings]:
        """The TempFlow branched rollout's settings (children, branch steps) when enabled, else None."""
        return self.run_config.actor_rollout_ref.rollout.branched

    def _rows_per_prompt(self) -> int:
        """Rows of a step per prompt: rollout.n, or |branch steps| × num_children for a branched rollout."""
        return self.run_config.actor_rollout_ref.rollout.rows_per_prompt

    def _expand_branched(self, gen: DataProto, out_batch, step: int) -> dict:
        """Per-row non-tensor data of a branched batch (rows prompt-major, then k, then child, also across workers:
        each worker gets a contiguous block of prompts); uid per (prompt, k); global prompt_ids and group_ids."""
        rpp = self._rows_per_prompt()
        kb = self._branched().num_children
        rows = {k: np.repeat(v, rpp, axis=0) for k, v in gen.non_tensor_batch.items()}
        n_prompts = len(gen)
        prompt_ids = torch.arange(n_prompts).repeat_interleave(rpp)
        ks = out_batch["branch_step"].cpu().long()
        rows["uid"] = np.array([f"s{step}-p{int(p)}-k{int(k)}" for p, k in zip(prompt_ids, ks)], dtype=object)
        out_batch["prompt_ids"] = prompt_ids
        out_batch["group_ids"] = torch.arange(len(prompt_ids)) // kb
        return rows

    def _compute_branched_advantage(self, batch: DataProto) -> dict[str, float]:
        """docs/algorithms.md §3.3: ``step_advantages`` within (prompt, k) across children; ``advantages`` = the same values."""
        sub = self.config.algorithm.get("flow_grpo", None) or {}
        clip = sub.get("adv_clip_max", 5.0)
        step_adv, adv = branched_advantages(
            batch.batch["sample_level_rewards"], batch.batch["prompt_ids"], batch.batch["branch_step"],
            batch.batch["train_mask"], eps=float(sub.get("adv_eps", 1e-4)), clip=None if clip is None else float(clip))
        batch.batch["response_mask"] = batch.batch["train_mask"]
        batch.batch["step_advantages"] = step_adv.float()
        batch.batch["advantages"] = adv.float()
        batch.batch["returns"] = adv.float()
        return advantage_summary(adv, batch.batch["response_mask"])
