"""Driver-side edits of the rollout's ``train_mask`` [B, N] (which (sample, step) items the loss sees).

* :func:`subsample_train_steps`: DanceGRPO's per-sample random subset of the trained steps (docs/algorithms.md §3.1 preset:
  a random 60% of the steps per sample), ``actor_rollout_ref.actor.train_step_fraction``;
* :func:`filter_zero_advantage`: docs/algorithms.md §2.3, samples with A_i = 0 leave the policy-loss items
  (``algorithm.flow_grpo.filter_zero_advantage``). They stay in the batch, so the worker's per-step
  ``prepare`` (path-space ĝ / KDE pool) still sees every member of every group.

Pure torch; the trainer calls both on the driver (``TrainMaskMixin``, from its config), so the mask the worker trains
on is the one the driver logs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from verl import DataProto


def steps_to_keep(n_window: torch.Tensor, fraction: float) -> torch.Tensor:
    """Steps kept per sample: ⌊fraction·|W_i|⌋ (DanceGRPO's ``int(len · fraction)``), at least 1 when |W_i| ≥ 1."""
    n = torch.floor(n_window.double() * float(fraction) + 1e-9).long()
    return torch.where(n_window > 0, n.clamp(min=1), torch.zeros_like(n))


def subsample_train_steps(train_mask: torch.Tensor, fraction: float,
                          generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """A random subset of each sample's window steps, drawn independently per sample.

    ``train_mask`` [B, N] (1 = step in the sample's SDE window); returns a mask of the same shape and dtype
    with ``steps_to_keep(|W_i|, fraction)`` ones per row, all inside the row's window. ``fraction >= 1`` returns
    the mask unchanged. Deterministic given ``generator``'s seed.
    """
    fraction = float(fraction)
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"actor_rollout_ref.actor.train_step_fraction={fraction} must be in (0, 1]")
    if fraction >= 1.0:
        return train_mask
    window = train_mask.bool()
    scores = torch.rand(train_mask.shape, generator=generator, dtype=torch.float64)
    scores = scores.masked_fill(~window, float("inf"))
    # rank of each step among the row's window steps by its random score (0 = smallest)
    rank = torch.argsort(torch.argsort(scores, dim=1), dim=1)
    keep = steps_to_keep(window.sum(dim=1), fraction)
    return ((rank < keep[:, None]) & window).to(train_mask.dtype)


def filter_zero_advantage(train_mask: torch.Tensor, advantages: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Drop samples whose advantage is exactly 0 from the trained items (docs/algorithms.md §2.3).

    ``advantages`` [B, N] is A_i broadcast onto ``train_mask``. Returns the new mask and
    ``{"actor/filtered_frac": dropped samples / samples with a trained step, "actor/filter_skipped": 0|1}``.
    When every sample has A_i = 0 nothing is dropped (``filter_skipped`` = 1): an update with no trained item
    has no forward and FSDP's gradient clipping needs one; with all A_i = 0 the policy term is 0 anyway.
    """
    trained = train_mask.bool().any(dim=1)
    zero = ((advantages * train_mask.to(advantages.dtype)) == 0).all(dim=1) & trained
    n_trained = int(trained.sum())
    if n_trained == 0 or bool(zero[trained].all()):
        return train_mask, {"actor/filtered_frac": 0.0, "actor/filter_skipped": float(n_trained > 0)}
    mask = train_mask * (~zero).to(train_mask.dtype)[:, None]
    return mask, {"actor/filtered_frac": float(zero.sum()) / n_trained, "actor/filter_skipped": 0.0}


class TrainMaskMixin:
    """The driver's train-mask edits of a step (a mixin of ``RayFlowGRPOTrainer``), from its config."""

    def _subsample_train_steps(self, batch: DataProto, step: int) -> dict[str, float]:
        """DanceGRPO's per-sample random subset of the window steps (``actor.train_step_fraction``, docs/algorithms.md §3.1),
        drawn from ``trainer.seed`` and the step only, so a resumed run draws the same subsets."""
        frac = float(self.config.actor_rollout_ref.actor.get("train_step_fraction", 1.0))
        if frac >= 1.0:
            return {}
        seed = (int(self.config.trainer.get("seed", 0)) + int(step)) * 1000 + 7
        gen = torch.Generator().manual_seed(seed)
        mask = batch.batch["train_mask"]
        batch.batch["train_mask"] = subsample_train_steps(mask, frac, gen)
        return {"actor/window_fraction": float(mask.float().mean())}

    def _filter_zero_advantage(self, batch: DataProto) -> dict[str, float]:
        """docs/algorithms.md §2.3: samples with A_i = 0 leave the policy-loss items (``algorithm.flow_grpo.filter_zero_advantage``);
        they stay in the batch, so the worker's prepare hook (KDE pool) still sees whole groups."""
        sub = self.config.algorithm.get("flow_grpo", None) or {}
        if not bool(sub.get("filter_zero_advantage", False)):
            return {}
        mask, metrics = filter_zero_advantage(batch.batch["train_mask"], batch.batch["advantages"])
        batch.batch["train_mask"] = mask
        batch.batch["response_mask"] = mask
        batch.batch["advantages"] = batch.batch["advantages"] * mask.to(batch.batch["advantages"].dtype)
        return metrics
