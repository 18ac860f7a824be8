"""EMA of parameters for evaluation, and soft old-policy / KL-EMA averaging (docs/algorithms.md §8).

- :class:`ParamEMA`: evaluation EMA θ̄ with warm-up decay d_n = min((1 + n)/(10 + n), d_max), updated after
  optimizer step n (0-based count of completed steps) when (n + 1) mod I = 0 (docs/algorithms.md §8.1).
  Presets: Flow-GRPO d_max = 0.9, I = 8; DiffusionNFT d_max = 0.9, I = 1; AWM d_max = 0.99.
- :func:`nft_old_policy_decay`, :func:`awm_kl_ema_decay` + :func:`soft_update_`: θ_old ← d·θ_old + (1 − d)·θ
  after each epoch's training (docs/algorithms.md §8.2).

Pure torch; no optimizer or module types are needed, only lists of parameter tensors.
"""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator, Optional

import torch

from verl_diffusion.algos.checks import check_choice

__all__ = ["ema_decay", "ParamEMA", "NFT_SCHEDULE_TYPES", "nft_old_policy_decay", "AWM_KL_EMA_MODES",
           "awm_kl_ema_decay", "soft_update_"]

# DiffusionNFT old-policy schedules (docs/algorithms.md §8.2).
NFT_SCHEDULE_TYPES = (0, 1, 2)
# AWM KL-EMA adapter modes (docs/algorithms.md §8.2).
AWM_KL_EMA_MODES = ("linear", "constant")


def _check_count(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{name}={n!r} is invalid; pass an int >= 0 (number of completed optimizer steps)")
    return n


def _check_decay(name: str, d) -> float:
    try:
        d = float(d)
    except (TypeError, ValueError):
        d = float("nan")
    if not 0.0 <= d <= 1.0:
        raise ValueError(f"{name}={d!r} is invalid; pass a plain float in [0, 1]")
    return d


def ema_decay(n: int, *, decay_max: float) -> float:
    """Warm-up EMA decay after optimizer step n (docs/algorithms.md §8.1): d_n = min((1 + n)/(10 + n), d_max).

    d_0 = 0.1; with d_max = 0.9 the warm-up ends at n = 80. Returns a plain float.
    """
    _check_count("n", n)
    return min((1.0 + n) / (10.0 + n), _check_decay("decay_max", decay_max))


class ParamEMA:
    """Evaluation EMA θ̄ of a list of (trainable) parameters (docs/algorithms.md §8.1).

    θ̄ starts as a copy of θ. ``step(n)`` after optimizer step n: if (n + 1) mod interval = 0,
    θ̄ ← θ̄ + (1 − d_n)·(θ − θ̄). ``swap_in()`` puts θ̄ into the parameters for evaluation / export and
    restores θ bitwise afterwards.

    Args: params: iterable of tensors (pass only trainable ones, e.g. the LoRA parameters).
      decay_max: d_max in [0, 1].  interval: I ≥ 1.  device / dtype: where and how θ̄ is stored
      (default: each parameter's own).
    """

    def __init__(self, params: Iterable[torch.Tensor], *, decay_max: float = 0.9, interval: int = 8,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        self.decay_max = _check_decay("decay_max", decay_max)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval={interval!r} is invalid; pass an int >= 1 (optimizer steps between updates)")
        self.interval = interval
        self.params = list(params)
        with torch.no_grad():
            self.shadow = [p.detach().to(device=device or p.device, dtype=dtype or p.dtype, copy=True)
                           for p in self.params]

    @torch.no_grad()
    def step(self, n: int) -> Optional[float]:
        """Update after optimizer step n (0-based count). Returns the decay used, or None when skipped."""
        _check_count("n", n)
        if (n + 1) % self.interval != 0:
            return None
        d = ema_decay(n, decay_max=self.decay_max)
        for s, p in zip(self.shadow, self.params):
            s.lerp_(p.detach().to(device=s.device, dtype=s.dtype), 1.0 - d)
        return d

    @contextlib.contextmanager
    def swap_in(self) -> Iterator[None]:
        """Context manager: parameters hold θ̄ inside, θ is restored bitwise on exit (even on error)."""
        with torch.no_grad():
            backup = [p.detach().clone() for p in self.params]
            for p, s in zip(self.params, self.shadow):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, b in zip(self.params, backup):
                    p.copy_(b)

    def state_dict(self) -> dict:
        """{"shadow": list of tensors, "decay_max": float, "interval": int}."""
        return {"shadow": [s.detach().clone() for s in self.shadow], "decay_max": self.decay_max,
                "interval": self.interval}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore θ̄ (shapes must match the tracked parameters) and the knobs."""
        shadow = state["shadow"]
        if len(shadow) != len(self.shadow):
            raise ValueError(f"EMA state has {len(shadow)} tensors but {len(self.shadow)} parameters are tracked")
        for i, (s, t) in enumerate(zip(self.shadow, shadow)):
            if s.shape != t.shape:
                raise ValueError(f"EMA state tensor {i} has shape {tuple(t.shape)}, parameter has {tuple(s.shape)}")
            s.copy_(t)
        self.decay_max = _check_decay("decay_max", state.get("decay_max", self.decay_max))
        self.interval = int(state.get("interval", self.interval))


def nft_old_policy_decay(schedule_type: int, n: int) -> float:
    """DiffusionNFT old-policy decay after n optimizer steps (docs/algorithms.md §8.2).

    type 0: 0;  type 1 (default): min(0.001·n, 0.5);  type 2 (OCR): 0 for n < 75, else min(0.0075·(n − 75), 0.999).
    """
    check_choice("schedule_type", schedule_type, NFT_SCHEDULE_TYPES)
    _check_count("n", n)
    if schedule_type == 0:
        return 0.0
    if schedule_type == 1:
        return min(0.001 * n, 0.5)
    return 0.0 if n < 75 else min(0.0075 * (n - 75), 0.999)


def awm_kl_ema_decay(mode: str, n: int, *, decay_max: float = 0.3) -> float:
    """AWM KL-EMA adapter decay (docs/algorithms.md §8.2): ``linear`` min(0.001·n, d_max), ``constant`` d_max."""
    check_choice("mode", mode, AWM_KL_EMA_MODES)
    _check_count("n", n)
    d_max = _check_decay("decay_max", decay_max)
    return min(0.001 * n, d_max) if mode == "linear" else d_max


@torch.no_grad()
def soft_update_(target_params: Iterable[torch.Tensor], source_params: Iterable[torch.Tensor], *,
                 decay: float) -> None:
    """In place θ_old ← d·θ_old + (1 − d)·θ for each pair (docs/algorithms.md §8.2). d = 0 copies θ exactly, d = 1 is a no-op."""
    d = _check_decay("decay", decay)
    targets, sources = list(target_params), list(source_params)
    if len(targets) != len(sources):
        raise ValueError(f"soft_update_: {len(targets)} target tensors but {len(sources)} source tensors")
    for t, s in zip(targets, sources):
        src = s.detach().to(device=t.device, dtype=t.dtype)
        if d == 0.0:
            t.copy_(src)
        elif d != 1.0:
            t.lerp_(src, 1.0 - d)
