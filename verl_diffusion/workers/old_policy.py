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
from typing import Any, Iterable, Iterator, Mapping, Optional

import torch

from verl_diffusion.algos.ema import soft_update_
from verl_diffusion.config.schema import OLD_POLICY_SCHEDULES, OldPolicyConfig  # noqa: F401  (re-exported)

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
