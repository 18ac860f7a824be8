"""Soft old-policy copy θ_old of docs/algorithms.md §8.2 (DiffusionNFT's sampling adapter, AWM's KL-EMA adapter).

The worker keeps θ_old as a copy of the *trainable* parameters (the LoRA parameters when LoRA is on; every
parameter on a full fine-tune, i.e. one more copy of the model in the parameters' dtype on each rank's shard).
After each rollout batch's training, with n = number of optimizer steps so far,
θ_old ← d·θ_old + (1 − d)·θ (``algos.ema.soft_update_``), d from the schedule:

* ``none``: no copy is kept; θ_old is the pre-update policy (the behaviour before this option existed);
* ``nft``: ``algos.ema.nft_old_policy_decay(nft_type, n)`` (type 0: 0; 1: min(0.001·n, 0.5); 2: OCR);
* ``awm_linear`` / ``awm_constant``: ``algos.ema.awm_kl_ema_decay`` with ``decay_max`` (README 0.3);
* ``constant``: d = ``decay``.

:meth:`OldPolicy.swap_in` puts θ_old into the parameters without grad and restores θ bitwise afterwards (as
``ParamEMA.swap_in``). FSDP2: the tensors are the local shards (``DTensor.to_local()``), so each rank keeps
and averages only its own shard; callers reshard the module before and after (``worker._reshard``).
Pure torch; no verl.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch

from verl_diffusion.algos.ema import NFT_SCHEDULE_TYPES, awm_kl_ema_decay, nft_old_policy_decay, soft_update_

OLD_POLICY_SCHEDULES = ("none", "nft", "awm_linear", "awm_constant", "constant")


@dataclass(frozen=True)
class OldPolicyConfig:
    """``actor_rollout_ref.actor.old_policy``."""

    # none | nft | awm_linear | awm_constant | constant.
    schedule: str = "none"
    # DiffusionNFT schedule type (docs/algorithms.md §8.2): 0 | 1 (default) | 2 (OCR).
    nft_type: int = 1
    # d_max of the AWM schedules (README 0.3).
    decay_max: float = 0.3
    # d of the ``constant`` schedule.
    decay: Optional[float] = None
    # Sample the training rollouts with θ_old (DiffusionNFT's sampling adapter; AWM off_policy's KL-EMA adapter).
    use_for_rollout: bool = True

    def __post_init__(self):
        if self.schedule not in OLD_POLICY_SCHEDULES:
            raise ValueError(f"actor.old_policy.schedule={self.schedule!r} is unknown; choose one of "
                             f"{list(OLD_POLICY_SCHEDULES)}")
        if isinstance(self.nft_type, bool) or self.nft_type not in NFT_SCHEDULE_TYPES:
            raise ValueError(f"actor.old_policy.nft_type={self.nft_type!r} is invalid; choose one of "
                             f"{list(NFT_SCHEDULE_TYPES)}")
        if not 0.0 <= float(self.decay_max) <= 1.0:
            raise ValueError(f"actor.old_policy.decay_max={self.decay_max!r} must be in [0, 1]")
        if self.schedule == "constant" and (self.decay is None or not 0.0 <= float(self.decay) <= 1.0):
            raise ValueError(f"actor.old_policy.schedule=constant needs decay in [0, 1] (got {self.decay!r})")

    @property
    def enabled(self) -> bool:
        return self.schedule != "none"

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "OldPolicyConfig":
        d = dict(d or {})
        known = {"schedule", "nft_type", "decay_max", "decay", "use_for_rollout"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"actor.old_policy has unknown keys {unknown}; accepted: {sorted(known)}")
        kw: dict[str, Any] = {}
        if d.get("schedule") is not None:
            kw["schedule"] = str(d["schedule"])
        if d.get("nft_type") is not None:
            kw["nft_type"] = int(d["nft_type"])
        if d.get("decay_max") is not None:
            kw["decay_max"] = float(d["decay_max"])
        if d.get("decay") is not None:
            kw["decay"] = float(d["decay"])
        if d.get("use_for_rollout") is not None:
            kw["use_for_rollout"] = bool(d["use_for_rollout"])
        return cls(**kw)

    def decay_at(self, n: int) -> float:
        """d after n optimizer steps (docs/algorithms.md §8.2)."""
        if self.schedule == "nft":
            return nft_old_policy_decay(self.nft_type, n)
        if self.schedule == "awm_linear":
            return awm_kl_ema_decay("linear", n, decay_max=self.decay_max)
        if self.schedule == "awm_constant":
            return awm_kl_ema_decay("constant", n, decay_max=self.decay_max)
        if self.schedule == "constant":
            return float(self.decay)
        raise ValueError("schedule none keeps no θ_old copy")


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 DTensor parameter (shares its storage), else the tensor itself."""
    to_local = getattr(p, "to_local", None)
    return to_local() if callable(to_local) else p


class OldPolicy:
    """θ_old of a list of trainable parameters (local shards), soft-updated by a schedule (docs/algorithms.md §8.2)."""

    def __init__(self, params: Iterable[torch.Tensor], cfg: OldPolicyConfig):
        if not cfg.enabled:
            raise ValueError("OldPolicy needs a schedule other than none")
        self.cfg = cfg
        self.params = list(params)
        with torch.no_grad():
            self.shadow = [local_tensor(p).detach().clone() for p in self.params]
        self.last_decay: Optional[float] = None

    def _locals(self) -> list[torch.Tensor]:
        return [local_tensor(p).detach() for p in self.params]

    @torch.no_grad()
    def update(self, n: int) -> float:
        """θ_old ← d·θ_old + (1 − d)·θ with d = schedule(n), n = optimizer steps so far. Returns d."""
        d = self.cfg.decay_at(n)
        soft_update_(self.shadow, self._locals(), decay=d)
        self.last_decay = d
        return d

    @torch.no_grad()
    def reset(self) -> None:
        """θ_old ← θ (e.g. after loading a checkpoint that has no θ_old)."""
        for s, p in zip(self.shadow, self._locals()):
            s.copy_(p)

    @contextlib.contextmanager
    def swap_in(self) -> Iterator[None]:
        """Parameters hold θ_old inside (no grad); θ is restored bitwise on exit (even on error)."""
        with torch.no_grad():
            locs = self._locals()
            backup = [t.clone() for t in locs]
            for t, s in zip(locs, self.shadow):
                t.copy_(s)
        try:
            with torch.no_grad():
                yield
        finally:
            with torch.no_grad():
                for t, b in zip(self._locals(), backup):
                    t.copy_(b)

    def state_dict(self) -> dict:
        return {"shadow": [s.detach().clone() for s in self.shadow], "schedule": self.cfg.schedule,
                "last_decay": self.last_decay}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        shadow = state["shadow"]
        if len(shadow) != len(self.shadow):
            raise ValueError(f"old-policy state has {len(shadow)} tensors but {len(self.shadow)} parameters are "
                             "tracked (LoRA on/off or the model changed since the checkpoint)")
        for i, (s, t) in enumerate(zip(self.shadow, shadow)):
            if s.shape != t.shape:
                raise ValueError(f"old-policy state tensor {i} has shape {tuple(t.shape)}, the local parameter "
                                 f"shard has {tuple(s.shape)}")
            s.copy_(t)
        self.last_decay = state.get("last_decay", None)
