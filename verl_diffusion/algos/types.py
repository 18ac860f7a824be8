"""The contract between a loss and the engine that calls it per timestep (docs/loss_interface.md).

A loss declares, with :class:`StepNeeds` flags, which θ-dependent step quantities it reads. The engine
computes exactly those (one trainable forward for ``VELOCITY``; one adapter-disabled forward for
``REF_VELOCITY``; one no-grad forward with the old weights for ``OLD_VELOCITY_FRESH``) and hands them
over as :class:`StepQuantities`. Everything θ-independent (stored at rollout, or precomputed right after
it, such as advantages and the path-space direction ĝ) travels in :class:`StepBatch`.

Shapes: ``B`` = items in the micro-batch (one item = one (sample, step) pair, docs/algorithms.md §0.4); ``*`` = latent
dims (C, H, W[, F]). Per-item scalars are ``[B]``. Everything here is pure torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Optional

import torch


class StepNeeds(enum.Flag):
    """Step quantities a loss reads (docs/algorithms.md §1.2 names). Combine with ``|``."""

    NONE = 0
    # v_θ(x_t, t) with grad: one trainable forward.
    VELOCITY = enum.auto()
    # μ_θ = c^x·x_t + c^v·v_θ of the sampler (docs/algorithms.md §1.2); derived from VELOCITY, no extra forward.
    MEAN = enum.auto()
    # ℓ_θ(x_next | x_t), exact per-element-mean Gaussian log-prob (docs/algorithms.md §1.2); derived from MEAN.
    LOG_PROB = enum.auto()
    # v_ref(x_t, t) without grad: reference = base model (LoRA adapter disabled) or a frozen copy.
    REF_VELOCITY = enum.auto()
    # v_old(x_t, t) recomputed without grad from θ_old at a *fresh* state (forward_noising, docs/algorithms.md §7.3).
    # Trajectory losses read the cached StepBatch.old_velocity instead and never set this.
    OLD_VELOCITY_FRESH = enum.auto()


class StateSource(str, enum.Enum):
    """Where the item's state x_t comes from (docs/algorithms.md §7.3)."""

    # Stored rollout states x_{t_k}, k in the trained steps.
    TRAJECTORY = "trajectory"
    # x_t = (1 − t)·x0 + t·ε with fresh ε at a drawn grid time (AWM / DiffusionNFT).
    FORWARD_NOISING = "forward_noising"


@dataclass
class StepBatch:
    """θ-independent inputs of one micro-batch of items. Fields a loss does not use may be ``None``.

    Filled by the rollout (stored) or right after it (advantages, ĝ). Which fields must be present is
    derived from the loss spec (``LossSpec.batch_keys``) and checked before any forward pass.
    """

    # Per-sample advantage broadcast to the item, after §2.1 normalisation and clipping.  [B]
    advantages: torch.Tensor
    # State the network is evaluated at.  [B, *]
    x_t: Optional[torch.Tensor] = None
    # Flow time of x_t (t ∈ (0, 1]).  [B]
    t: Optional[torch.Tensor] = None
    # Stored next state x_{t_{k+1}} (trajectory).  [B, *]
    x_next: Optional[torch.Tensor] = None
    # Flow time of x_next.  [B]
    t_next: Optional[torch.Tensor] = None
    # Sampler coefficients of this step (docs/algorithms.md §1.2): μ = c_x·x + c_v·v, std τ.  [B] each
    c_x: Optional[torch.Tensor] = None
    c_v: Optional[torch.Tensor] = None
    std: Optional[torch.Tensor] = None
    # Rollout log-prob ℓ_old of x_next (exact convention unless the sampler says otherwise).  [B]
    old_log_prob: Optional[torch.Tensor] = None
    # Rollout mean μ_old (GRPO-Guard, Flow-DPPO).  [B, *]
    old_mean: Optional[torch.Tensor] = None
    # Cached v_old at x_t (path-space trajectory mode).  [B, *]
    old_velocity: Optional[torch.Tensor] = None
    # Clean endpoint x0 of the item's own trajectory.  [B, *]
    x0: Optional[torch.Tensor] = None
    # Fresh forward-noising ε (forward_noising mode).  [B, *]
    noise: Optional[torch.Tensor] = None
    # Precomputed θ-independent path-space direction ĝ (docs/algorithms.md §7.4).  [B, *]
    value_direction: Optional[torch.Tensor] = None
    # Group id per item (int).  [B]
    group_ids: Optional[torch.Tensor] = None
    # Process advantage per item for branched TempFlow rollouts (docs/algorithms.md §3.3); falls back to advantages.  [B]
    step_advantages: Optional[torch.Tensor] = None

    def require(self, names: tuple[str, ...], loss_name: str) -> None:
        """Raise one clear line naming the loss and the missing fields."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(
                f"loss {loss_name!r} needs StepBatch fields {missing} but they are None; "
                f"the rollout must store them (see docs/loss_interface.md)"
            )

    def check_shapes(self) -> None:
        """Raise one line naming the tensors whose leading (item) dimension disagrees."""
        sizes = {f.name: getattr(self, f.name).shape[0] for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor) and getattr(self, f.name).dim() > 0}
        n = self.advantages.shape[0]
        bad = {k: v for k, v in sizes.items() if v != n}
        if bad:
            raise ValueError(f"StepBatch shape mismatch: advantages has {n} items but {bad}")
        latent = {f.name: tuple(getattr(self, f.name).shape[1:]) for f in fields(self)
                  if isinstance(getattr(self, f.name), torch.Tensor) and getattr(self, f.name).dim() > 1}
        if len(set(latent.values())) > 1:
            raise ValueError(f"StepBatch latent shape mismatch between tensors: {latent}")


@dataclass
class StepQuantities:
    """θ-dependent quantities the engine computed for the declared :class:`StepNeeds`."""

    # v_θ(x_t, t), with grad.  [B, *]
    velocity: Optional[torch.Tensor] = None
    # μ_θ, with grad.  [B, *]
    mean: Optional[torch.Tensor] = None
    # ℓ_θ(x_next | x_t), with grad.  [B]
    log_prob: Optional[torch.Tensor] = None
    # v_ref(x_t, t), no grad.  [B, *]
    ref_velocity: Optional[torch.Tensor] = None
    # v_old at a fresh forward-noised state, no grad.  [B, *]
    old_velocity: Optional[torch.Tensor] = None


@dataclass
class LossOutput:
    """A scalar to minimise and the metrics a user watches (``actor/...`` names, detached floats)."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)
