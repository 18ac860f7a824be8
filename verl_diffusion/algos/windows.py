"""SDE windows: which sampling steps are stochastic and trained (docs/algorithms.md §1.8).

A window 𝒲 = {s, …, s + W − 1} with lo ≤ s ≤ hi − W. Steps in 𝒲 use the stochastic sampler, all others
the ODE; only window steps are stored and trained (𝒦 = 𝒲). With the window disabled (``mode="none"``)
all N steps are stochastic and the first ⌊0.99·N⌋ are trained (Flow-GRPO skips the last step).

Modes:
- ``none``: no window (see above).
- ``fixed``: s = lo.
- ``random``: s ~ Uniform{lo, …, hi − W}, drawn once per rollout batch by the caller and shared by every
  sample of the batch (so by all members of a group).
- ``progressive``: s(n) = lo + (⌊n / period⌋·stride) mod (hi − W − lo + 1), n = training iteration
  (MixGRPO: W = 4, N = 25, period = 25, stride = 1).

Presets: Flow-GRPO-Fast W = 2 in [0, N/2); CPS W = 3 in the first half; DPPO contiguous random W = 3 in
[0, N/2) (docs/algorithms.md §9.7). Pure Python + torch (only for the seeded draw).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from verl_diffusion.algos.checks import check_choice

__all__ = ["WINDOW_MODES", "SdeWindowConfig", "window_start", "window_steps", "stochastic_steps",
           "window_bounds"]

# Window modes (docs/algorithms.md §1.8).
WINDOW_MODES = ("none", "fixed", "random", "progressive")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SdeWindowConfig:
    """Where the stochastic (and trained) steps lie (docs/algorithms.md §1.8). Stdlib frozen dataclass, validated on init."""

    # none | fixed | random | progressive.
    mode: str = "fixed"
    # Window size W ≥ 1 (number of consecutive stochastic steps). Ignored by ``none``.
    size: int = 2
    # Lowest allowed window start (inclusive), lo ≥ 0.
    lo: int = 0
    # Exclusive upper end of the window range: the window lies inside [lo, hi). None = ⌊N/2⌋, the first half
    # of the N sampling steps (all presets), resolved when N is known. Must satisfy lo + W ≤ hi ≤ N.
    hi: Optional[int] = None
    # Progressive only: iterations between two slides of the window (P_w ≥ 1).
    period: int = 1
    # Progressive only: steps the window slides by at each slide (S_w ≥ 1).
    stride: int = 1

    def __post_init__(self):
        check_choice("sde_window.mode", self.mode, WINDOW_MODES)
        if not _is_int(self.size) or self.size < 1:
            raise ValueError(f"sde_window.size={self.size!r} is invalid; pass an int >= 1 (window size W)")
        if not _is_int(self.lo) or self.lo < 0:
            raise ValueError(f"sde_window.lo={self.lo!r} is invalid; pass an int >= 0 (lowest window start)")
        if self.hi is not None and (not _is_int(self.hi) or self.hi < self.lo + self.size):
            raise ValueError(
                f"sde_window.hi={self.hi!r} is invalid; pass None (= N//2) or an int >= lo + size = "
                f"{self.lo + self.size}"
            )
        if not _is_int(self.period) or self.period < 1:
            raise ValueError(f"sde_window.period={self.period!r} is invalid; pass an int >= 1 (iterations per slide)")
        if not _is_int(self.stride) or self.stride < 1:
            raise ValueError(f"sde_window.stride={self.stride!r} is invalid; pass an int >= 1 (steps per slide)")


def _check_num_steps(num_steps: int) -> None:
    if not _is_int(num_steps) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r} is invalid; pass an int >= 1 (number of sampling steps N)")


def window_bounds(cfg: SdeWindowConfig, *, num_steps: int) -> tuple[int, int]:
    """Resolved (lo, hi) for N = num_steps: hi = ⌊N/2⌋ when cfg.hi is None; checks lo + W ≤ hi ≤ N."""
    _check_num_steps(num_steps)
    hi = num_steps // 2 if cfg.hi is None else cfg.hi
    if cfg.mode != "none" and not (cfg.lo + cfg.size <= hi <= num_steps):
        raise ValueError(
            f"sde_window (size={cfg.size}, lo={cfg.lo}, hi={cfg.hi} -> {hi}) does not fit num_steps={num_steps}; "
            f"need lo + size <= hi <= num_steps (hi=None means num_steps//2): lower size/lo or set hi"
        )
    return cfg.lo, hi


def window_start(cfg: SdeWindowConfig, *, num_steps: int, iteration: int = 0,
                 generator: Optional[torch.Generator] = None) -> int:
    """Window start s for this rollout batch (docs/algorithms.md §1.8); one value shared by all samples.

    Args: cfg: window config.  num_steps: N.  iteration: training iteration n (progressive).
      generator: seeds the ``random`` draw (torch default RNG when None); draw once per batch.
    Returns: s with lo ≤ s ≤ hi − W (0 for ``none``).
    """
    lo, hi = window_bounds(cfg, num_steps=num_steps)
    if cfg.mode == "none":
        return 0
    if cfg.mode == "fixed":
        return lo
    n_starts = hi - cfg.size - lo + 1
    if cfg.mode == "random":
        return lo + int(torch.randint(n_starts, (1,), generator=generator).item())
    if not _is_int(iteration) or iteration < 0:
        raise ValueError(f"iteration={iteration!r} is invalid; pass the training iteration as an int >= 0")
    return lo + ((iteration // cfg.period) * cfg.stride) % n_starts


def stochastic_steps(cfg: SdeWindowConfig, *, num_steps: int, iteration: int = 0,
                     generator: Optional[torch.Generator] = None) -> list[int]:
    """Steps that use the stochastic sampler: all N for ``none``, else the window {s, …, s + W − 1}."""
    if cfg.mode == "none":
        _check_num_steps(num_steps)
        return list(range(num_steps))
    s = window_start(cfg, num_steps=num_steps, iteration=iteration, generator=generator)
    return list(range(s, s + cfg.size))


def window_steps(cfg: SdeWindowConfig, *, num_steps: int, iteration: int = 0,
                 generator: Optional[torch.Generator] = None) -> list[int]:
    """Trained steps 𝒦 (docs/algorithms.md §1.8): the window {s, …, s + W − 1}, or the first ⌊0.99·N⌋ steps for ``none``.

    Args: as :func:`window_start` (one ``random`` draw per call: call once per rollout batch and share it).
    Returns: sorted list of step indices k ∈ [0, N − 1].
    """
    if cfg.mode == "none":
        _check_num_steps(num_steps)
        return list(range((99 * num_steps) // 100))
    return stochastic_steps(cfg, num_steps=num_steps, iteration=iteration, generator=generator)


def resolve_branch_steps(branch_steps: Optional[Sequence[int]], num_steps: int) -> list[int]:
    """The sorted branch steps of a config (None = every k < N − 1); ValueError names bad entries."""
    n = num_steps
    if branch_steps is None:
        return list(range(n - 1))
    steps = [int(k) for k in branch_steps]
    if not steps or len(set(steps)) != len(steps) or any(k < 0 or k > n - 2 for k in steps):
        raise ValueError(f"branch_steps={list(branch_steps)!r} is invalid; pass distinct ints in [0, {n - 2}] "
                         f"(k < N − 1, N = {n}), or None for all of them")
    return sorted(steps)
