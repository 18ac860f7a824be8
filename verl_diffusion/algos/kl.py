"""KL-to-reference regularisers, per element and per item (docs/algorithms.md §1.7 GRPO family, §7.6 path-space).

All modes are functions of Δv = v_θ(x_t, t) − v_ref(x_t, t) at the same state (per-element means, §0.3):

| mode | KL_{i,k} | needs |
|---|---|---|
| ``exact`` | (c_v)²·‖Δv‖²_e/(2τ²) = D_ref of §1.2 (GRPO family default) | c_v, std |
| ``gaussian_step`` | same formula as ``exact`` (§7.6 name; = ``girsanov`` at Flow-SDE steps k ≥ 1) | c_v, std |
| ``flow_grpo_legacy`` | flow_sde / dance: (c_v)²·‖Δv‖²_e/(2g²) = exact × Δt; cps: = exact | c_v, std (+ dt) |
| ``v_space`` | ‖Δv‖²_e (path-space default, β = 1e-4) | — |
| ``girsanov`` | w̃(t)·Δt·‖Δv‖²_e, w̃ = (1+η)²(1−t)/(4ηt), η = a²/2 | t, dt, noise_level |

``dt`` may be given with either sign; Δt = |dt| is used. Results are [B] in at least float32 and keep the
graph through ``velocity`` (``ref_velocity`` is expected without grad).
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_diffusion.algos.checks import check_choice
from verl_diffusion.algos.sde import SAMPLERS

__all__ = ["KL_MODES", "KL_MODE_NEEDS", "reference_kl", "girsanov_weight"]

# KL-to-reference modes (docs/algorithms.md §1.7, §7.6).
KL_MODES = ("exact", "flow_grpo_legacy", "v_space", "girsanov", "gaussian_step")

# Arguments each mode reads besides the two velocities (flow_grpo_legacy also reads dt for flow_sde/dance).
KL_MODE_NEEDS = {
    "exact": ("c_v", "std"),
    "gaussian_step": ("c_v", "std"),
    "flow_grpo_legacy": ("c_v", "std"),
    "v_space": (),
    "girsanov": ("t", "dt", "noise_level"),
}


def _mean_e(u: torch.Tensor) -> torch.Tensor:
    return u.flatten(1).mean(dim=1)


def _col(c, b: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-sample scalar (float, 0-dim or [B]) as a [B] tensor of ``dtype``."""
    c = torch.as_tensor(c).to(dtype)
    return c.expand(b) if c.dim() == 0 else c


def girsanov_weight(t: torch.Tensor, *, noise_level: float) -> torch.Tensor:
    """w̃(t) = (1+η)²(1−t)/(4ηt) with η = a²/2 (docs/algorithms.md §7.1, §7.6). Singular as t → 0 or a → 0. t: [B]."""
    eta = float(noise_level) ** 2 / 2.0
    return (1.0 + eta) ** 2 * (1.0 - t) / (4.0 * eta * t)


def reference_kl(mode: str, *, velocity: torch.Tensor, ref_velocity: torch.Tensor,
                 c_v: Optional[torch.Tensor] = None, std: Optional[torch.Tensor] = None,
                 t: Optional[torch.Tensor] = None, dt: Optional[torch.Tensor] = None,
                 sampler: str = "flow_sde", noise_level: Optional[float] = None) -> torch.Tensor:
    """Per-item KL to the reference policy, per-element mean (docs/algorithms.md §1.7, §7.6; table in the module doc).

    Args:
      mode: one of :data:`KL_MODES`.
      velocity: v_θ(x_t, t) [B, *] (with grad).  ref_velocity: v_ref(x_t, t) [B, *].
      c_v, std: sampler coefficients of the step, [B] (or 0-dim); std must be > 0.
      t: flow time of x_t [B].  dt: step size [B] (either sign; Δt = |dt|).
      sampler: one of SAMPLERS (decides flow_grpo_legacy: ×Δt for flow_sde / dance, unchanged for cps).
      noise_level: a (Flow-SDE noise level), girsanov only, > 0.
    Returns: KL [B], dtype at least float32.
    """
    check_choice("kl_mode", mode, KL_MODES)
    check_choice("sampler", sampler, SAMPLERS)
    given = {"c_v": c_v, "std": std, "t": t, "dt": dt, "noise_level": noise_level}
    needs = list(KL_MODE_NEEDS[mode])
    if mode == "flow_grpo_legacy" and sampler in ("flow_sde", "dance"):
        needs.append("dt")
    missing = [k for k in needs if given[k] is None]
    if missing:
        raise ValueError(f"reference_kl(mode={mode!r}, sampler={sampler!r}) needs {needs}; got None for {missing}")
    if mode in ("exact", "gaussian_step", "flow_grpo_legacy") and sampler == "ode":
        raise ValueError(f"reference_kl(mode={mode!r}) is undefined for sampler='ode' (std = 0); "
                         f"use mode='v_space' or a stochastic sampler")

    wd = torch.promote_types(torch.promote_types(torch.float32, velocity.dtype), ref_velocity.dtype)
    b = velocity.shape[0]
    sq = _mean_e((velocity.to(wd) - ref_velocity.to(wd)) ** 2)  # ‖Δv‖²_e  [B]
    if mode == "v_space":
        return sq
    if mode == "girsanov":
        a = float(noise_level)
        if not a > 0.0:
            raise ValueError(f"noise_level={noise_level!r} is invalid for kl_mode='girsanov'; pass a > 0 "
                             f"(η = a²/2 appears in a denominator)")
        w = girsanov_weight(_col(t, b, torch.float64), noise_level=a).to(wd)
        return w * _col(dt, b, wd).abs() * sq
    s = _col(std, b, wd)
    if bool((s <= 0).any()):
        raise ValueError(f"reference_kl(mode={mode!r}): std has entries <= 0 (ODE / last CPS step / "
                         f"noise_level=0); the Gaussian step KL is undefined there: mask those steps")
    cv = _col(c_v, b, wd)
    kl = cv * cv * sq / (2.0 * s * s)
    if mode == "flow_grpo_legacy" and sampler in ("flow_sde", "dance"):
        kl = kl * _col(dt, b, wd).abs()
    return kl
