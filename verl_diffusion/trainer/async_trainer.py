"""``diffusion_async``: the standalone replica samples batch k+1 while the actor trains on batch k (one-step
staleness; docs/replica_modes.md). Registered in verl's V1 trainer registry (``trainer.v1.trainer_mode``).

It is :class:`~verl_diffusion.trainer.flowgrpo_trainer.RayFlowGRPOTrainer` (the sync trainer) with three changes:

* generation is split in submit / collect: right after batch k's rollout is collected, batch k+1's request goes to
  the replica, which samples it during reward, advantages and the actor update of batch k. The weight sync at the
  end of step k (verl's ``CheckpointEngineManager``, a real backend) reaches the replica after that request, so batch
  k+1 is sampled with the weights of step k − 1 and trained by the actor at step k + 1: ratio ≠ 1.
* the replicas do not sleep after sampling (they are sampling the next batch).
* old log-probs are always the rollout's (docs/algorithms.md §0.4: θ_old is the policy that produced the rollout; §3.1: ℓ_old
  recorded at rollout). Recomputing them with the actor's current weights, as the sync trainer does off-policy,
  would measure the ratio against θ_{k} instead of the sampler's θ_{k-1} and hide the staleness the loss must clip.
  (Losses that read a fresh θ_old velocity, docs/algorithms.md §5–7, compute it with the pre-update actor, as in sync mode.)

The dataloader is read one batch ahead (:class:`LookaheadLoader`); its checkpointed state is the one after batch
k, so a resumed run re-reads batch k+1 (and samples it with the resumed weights: async runs resume exactly where
they stopped, but not bit-identically to an uninterrupted async run, unlike sync ones).

Metrics: ``async/rollout_wait_s`` (time the driver waited for batch k's rollout) and ``async/overlap_ratio`` =
1 − wait / rollout time (the share of the replica's sampling hidden behind the previous step's training; 0 for a
batch sampled without lookahead).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from verl.trainer.ppo.v1.trainer_base import register_trainer

from verl import DataProto
from verl_diffusion.trainer.flowgrpo_trainer import RayFlowGRPOTrainer

__all__ = ["TRAINER_NAME", "RayFlowGRPOAsyncTrainer", "LookaheadLoader", "overlap_ratio"]

TRAINER_NAME = "diffusion_async"


def overlap_ratio(wait_s: float, rollout_s: float) -> float:
    """Share of a rollout's ``rollout_s`` seconds that ran while the driver did other work (it waited ``wait_s``)."""
    if rollout_s <= 0:
        return 0.0
    return min(max(1.0 - wait_s / rollout_s, 0.0), 1.0)


class LookaheadLoader:
    """Iterates a stateful dataloader one batch ahead: while batch k is yielded, ``next_batch`` is batch k+1, also
    across an epoch's end (the next epoch's iterator is started early and its first batch carried over; the
    sampler's order depends only on (seed, epoch)), and ``state_dict()`` is the loader's state right after batch k
    (what a sync run checkpoints)."""

    def __init__(self, loader):
        self.loader = loader
        self.next_batch: Optional[dict] = None
        self._state = None
        self._carry = None      # (iterator, its first batch) of the next epoch, started during the previous one

    def __len__(self) -> int:
        return len(self.loader)

    def _first(self):
        it = iter(self.loader)
        try:
            return it, next(it)
        except StopIteration:
            return None

    def __iter__(self):
        started, self._carry = (self._carry or self._first()), None
        if started is None:
            return
        it, current = started
        while True:
            self._state = self.loader.state_dict()
            try:
                upcoming, last = next(it), False
            except StopIteration:
                self._carry = self._first()
                upcoming, last = (self._carry[1] if self._carry else None), True
            self.next_batch = upcoming
            yield current
            if last:
                return
            current = upcoming

    def state_dict(self):
        return self._state if self._state is not None else self.loader.state_dict()

    def load_state_dict(self, state) -> None:
        self._state, self._carry = None, None
        self.loader.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


@register_trainer(TRAINER_NAME)
class RayFlowGRPOAsyncTrainer(RayFlowGRPOTrainer):
    """One-step-stale asynchronous trainer over standalone diffusers replicas (module docstring)."""

    # The config check reads it (config/schema.py): sampling ahead needs a standalone replica.
    samples_ahead = True

    def _setup(self):
        if self.run_config.actor_rollout_ref.rollout.placement != "standalone":
            raise ValueError("trainer.v1.trainer_mode=diffusion_async samples the next batch while the actor trains: "
                             "set actor_rollout_ref.rollout.placement=standalone (a colocated sampler shares the "
                             "actor's process and weights)")
        self._pending: Optional[dict] = None
        super()._setup()

    def _init_dataloader(self):
        super()._init_dataloader()
        self.train_dataloader = LookaheadLoader(self.train_dataloader)

    # ------------------------------------------------------------------ hooks

    def on_sample_end(self):
        """The replicas keep sampling (the next batch): no sleep."""
        return None

    # ------------------------------------------------------------------ generation

    def _generate(self, batch: DataProto, step: int) -> tuple[DataProto, dict]:
        """Training batch k: the prefetched answer when its request went out during step k − 1 (else sampled now),
        then batch k+1's request. Validation requests are served in order, without lookahead."""
        if batch.meta_info.get("validate", False):
            return super()._generate(batch, step)
        pending, self._pending = self._pending, None
        if pending is not None and (pending["step"] != step or not _same_rows(pending["gen"], batch)):
            pending = None    # e.g. the first step after a resume: the request was for another batch
        if pending is None:
            pending = {"step": step, "gen": batch, "refs": self._submit_generation(batch, step), "ahead": False}
        start = time.perf_counter()
        out, metrics = self._collect_generation(pending["refs"])
        wait = time.perf_counter() - start
        rollout = max(metrics.get("perf/rollout_time", [0.0]) or [0.0])
        metrics["async/rollout_wait_s"] = [wait]
        metrics["async/overlap_ratio"] = [overlap_ratio(wait, rollout) if pending["ahead"] else 0.0]
        self._prefetch(step + 1)
        return out, metrics

    def _prefetch(self, step: int) -> None:
        """Send batch ``step``'s request now, if the dataloader has it and the run trains that step."""
        upcoming = getattr(self.train_dataloader, "next_batch", None)
        if upcoming is None or step > int(self.total_training_steps):
            return
        gen = self._gen_batch(upcoming, step)
        self._pending = {"step": step, "gen": gen, "refs": self._submit_generation(gen, step), "ahead": True}

    # ------------------------------------------------------------------ old log-probs

    def _compute_old_log_prob(self, batch: DataProto) -> dict[str, float]:
        """θ_old = the sampler's weights (docs/algorithms.md §0.4, §3.1): the rollout's log-probs, whatever the epochs or
        mini-batches (module docstring)."""
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
        return {}


def _same_rows(a: DataProto, b: DataProto) -> bool:
    """The prefetched request is for the batch this step built (same prompts and group uids)."""
    import numpy as np

    for key in ("prompt", "uid"):
        x, y = a.non_tensor_batch.get(key), b.non_tensor_batch.get(key)
        if x is None or y is None or len(x) != len(y) or not np.array_equal(np.asarray(x), np.asarray(y)):
            return False
    return True
