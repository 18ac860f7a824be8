"""Ratio-based per-timestep policy losses: the GRPO family (docs/algorithms.md §3) and Flow-DPPO (docs/algorithms.md §4).

Each loss has three parts, top to bottom in this file:

* a **pure function** ``<name>_loss(tensors..., *, floats...) -> (per-item loss [B], metrics)``: the math of
  the docs/algorithms.md section, line by line, tensors and plain floats only (metrics are detached 0-dim tensors);
* a frozen **config** dataclass with the loss's knobs (working defaults = the published preset);
* a registered **entry** ``entry(q: StepQuantities, batch: StepBatch, cfg) -> LossOutput`` that maps names to
  the pure function, adds the optional KL to the reference (docs/algorithms.md §1.7) and averages over items.

Conventions (docs/algorithms.md §0): log-probs, log-ratios and KLs are per-element means; all losses are minimised; the
loss is the mean over items (masked items contribute 0 and stay in the denominator). Shapes: ``B`` items
(one item = one (sample, step) pair), ``*`` latent dims.

KL to the reference is on when ``cfg.kl_coef > 0`` (``LossSpec.needs_for`` then adds ``REF_VELOCITY``); it
reads q.velocity, q.ref_velocity and the StepBatch fields :data:`KL_BATCH_KEYS`. ``batch_keys`` is static and
the engine hands over exactly those fields, so every entry declares :data:`KL_BATCH_KEYS` too (the rollout
always stores them: ``sigmas``, ``sde_cv``, ``sde_std``); likewise ``VELOCITY`` is declared for the KL (it
costs nothing: the same trainable forward produces the log-prob / mean).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch

from verl_diffusion.algos.kl import KL_MODES, reference_kl
from verl_diffusion.algos.checks import check_choice
from verl_diffusion.algos.loss_spec import register_loss
from verl_diffusion.algos.sde import SAMPLERS, gaussian_step_kl, log_ratio_exact
from verl_diffusion.algos.types import LossOutput, StepBatch, StepNeeds, StepQuantities

__all__ = [
    "KL_BATCH_KEYS",
    "RATIO_KL_MODES",
    "DppoMask",
    "DPPO_MASKS",
    "clipped_surrogate_loss",
    "flow_grpo_loss",
    "guard_log_ratio",
    "grpo_guard_loss",
    "tempflow_grpo_loss",
    "dppo_predictive_terms",
    "dppo_keep_mask",
    "flow_dppo_loss",
    "FlowGrpoConfig",
    "DanceGrpoConfig",
    "GrpoGuardConfig",
    "TempFlowGrpoConfig",
    "FlowDppoConfig",
]

Metrics = dict[str, torch.Tensor]

# KL-to-reference modes of the GRPO family / DPPO (docs/algorithms.md §1.7): a subset of kl.KL_MODES.
RATIO_KL_MODES = tuple(m for m in KL_MODES if m in ("exact", "flow_grpo_legacy"))

# StepBatch fields the reference KL reads when kl_coef > 0 (c^v, τ, t and t_next for Δt; docs/algorithms.md §1.2, §1.7).
KL_BATCH_KEYS = ("c_v", "std", "t", "t_next")


# ----------------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------------


def _work(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cast to a common dtype of at least float32 (docs/algorithms.md §0.5)."""
    wd = torch.float32
    for t in ts:
        wd = torch.promote_types(wd, t.dtype)
    return tuple(t.to(wd) for t in ts)


def _mean_e(u: torch.Tensor) -> torch.Tensor:
    """Per-element mean over the latent dims: [B, *] -> [B]."""
    return u.flatten(1).mean(dim=1)


def _col(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] per-item scalar shaped to broadcast over ``like`` [B, *]."""
    return s.reshape(s.shape[0], *([1] * (like.dim() - 1)))


def _clip_bounds(clip_range: float, clip_range_low: Optional[float], clip_range_high: Optional[float]
                 ) -> tuple[float, float]:
    lo = clip_range if clip_range_low is None else clip_range_low
    hi = clip_range if clip_range_high is None else clip_range_high
    return lo, hi


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, lo: float, hi: float) -> Metrics:
    """clipfrac (+ split ρ > 1 + ε_hi / ρ < 1 − ε_lo), ratio mean/std, approx_kl = ½·mean(log ρ)² (docs/algorithms.md §3.1)."""
    r = ratio.detach()
    above = (r > 1.0 + hi).to(r.dtype)
    below = (r < 1.0 - lo).to(r.dtype)
    return {
        "actor/clipfrac": (above + below).mean(),
        "actor/clipfrac_high": above.mean(),
        "actor/clipfrac_low": below.mean(),
        "actor/ratio_mean": r.mean(),
        "actor/ratio_std": r.std(unbiased=False),
        "actor/approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        "actor/log_ratio_mean": log_ratio.detach().mean(),
    }


def _add_kl(per_item: torch.Tensor, metrics: Metrics, ref_kl: Optional[torch.Tensor], kl_coef: float
            ) -> torch.Tensor:
    """per_item + β_KL·KL (docs/algorithms.md §3.1, §4.2); logs ``actor/kl`` when a KL is given."""
    if ref_kl is None or kl_coef == 0:
        return per_item
    metrics["actor/kl"] = ref_kl.detach().mean()
    return per_item + kl_coef * ref_kl


def _clipped(advantages: torch.Tensor, ratio: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """L^clip = max(−A·ρ, −A·clip(ρ, 1 − ε_lo, 1 + ε_hi)) per item (docs/algorithms.md §3.1)."""
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1.0 - lo, 1.0 + hi))


# ----------------------------------------------------------------------------------------------------
# Pure functions
# ----------------------------------------------------------------------------------------------------


def clipped_surrogate_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, *,
                           clip_range: float, clip_range_low: Optional[float] = None,
                           clip_range_high: Optional[float] = None, ref_kl: Optional[torch.Tensor] = None,
                           kl_coef: float = 0.0) -> tuple[torch.Tensor, Metrics]:
    """Flow-GRPO clipped surrogate (docs/algorithms.md §3.1; Liu et al. 2025, arXiv 2505.05470). Also DanceGRPO, Flow-CPS.

    ρ = exp(ℓ_θ − ℓ_old) in the sampler's log-prob convention;
    L_i = max(−A·ρ, −A·clip(ρ, 1 − ε_lo, 1 + ε_hi)) + β_KL·KL_i.

    Args:
        log_prob: ℓ_θ [B] (with grad).  old_log_prob: ℓ_old [B].  advantages: A [B].
        clip_range: ε_clip; clip_range_low / clip_range_high override ε_lo / ε_hi.
        ref_kl: KL to the reference [B] (docs/algorithms.md §1.7) or None.  kl_coef: β_KL.
    Returns: (per-item loss [B], metrics: clipfrac(_high/_low), ratio_mean/std, approx_kl[, kl]).
    """
    lo, hi = _clip_bounds(clip_range, clip_range_low, clip_range_high)
    log_prob, old_log_prob, advantages = _work(log_prob, old_log_prob, advantages)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    metrics = _ratio_metrics(ratio, log_ratio, lo, hi)
    per_item = _clipped(advantages, ratio, lo, hi)
    return _add_kl(per_item, metrics, ref_kl, kl_coef), metrics


# The Flow-GRPO loss under its registry name (functions are named after the paper's loss).
flow_grpo_loss = clipped_surrogate_loss


def tempflow_grpo_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                       std: torch.Tensor, *, scale: float = 2.25, clip_range: float,
                       clip_range_low: Optional[float] = None, clip_range_high: Optional[float] = None,
                       ref_kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0
                       ) -> tuple[torch.Tensor, Metrics]:
    """TempFlow-GRPO noise-aware weighting (docs/algorithms.md §3.3): L_i = c·τ_k·L^clip_i + β_KL·KL_i.

    Args:
        log_prob, old_log_prob: [B].  advantages: per-step (process) advantages A_k [B].  std: τ_k [B].
        scale: c > 0 (public code 2.25).  clip_range(_low/_high), ref_kl, kl_coef: as
        :func:`clipped_surrogate_loss` (KL with exact τ, docs/algorithms.md §3.3).
    Returns: (per-item loss [B], metrics as clipped_surrogate_loss).
    """
    lo, hi = _clip_bounds(clip_range, clip_range_low, clip_range_high)
    log_prob, old_log_prob, advantages, std = _work(log_prob, old_log_prob, advantages, std)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    metrics = _ratio_metrics(ratio, log_ratio, lo, hi)
    per_item = scale * std * _clipped(advantages, ratio, lo, hi)
    return _add_kl(per_item, metrics, ref_kl, kl_coef), metrics


def guard_log_ratio(mean: torch.Tensor, old_mean: torch.Tensor, x_next: torch.Tensor, std: torch.Tensor
                    ) -> torch.Tensor:
    """GRPO-Guard normalised log-ratio log ρ^G = ⟨μ_θ − μ_old, z⟩_e, z = (x' − μ_old)/τ (docs/algorithms.md §3.2).

    Equals (ℓr + D)·τ = c^v·⟨Δv, z⟩_e; E_z[log ρ^G] = 0 for any Δv.
    Args: mean, old_mean, x_next: [B, *].  std: τ [B].  Returns: [B], dtype at least float32.
    """
    mean, old_mean, x_next, std = _work(mean, old_mean, x_next, std)
    z = (x_next - old_mean) / _col(std, x_next)
    return _mean_e((mean - old_mean) * z)


def grpo_guard_loss(mean: torch.Tensor, old_mean: torch.Tensor, x_next: torch.Tensor, std: torch.Tensor,
                    delta_t: torch.Tensor, advantages: torch.Tensor, *, clip_range: float,
                    clip_range_low: Optional[float] = None, clip_range_high: Optional[float] = None,
                    ref_kl: Optional[torch.Tensor] = None, kl_coef: float = 0.0
                    ) -> tuple[torch.Tensor, Metrics]:
    """GRPO-Guard RatioNorm + step reweighting (docs/algorithms.md §3.2).

    log ρ^G = (ℓr + D)·τ = ⟨Δμ, z⟩_e = c^v·⟨Δv, z⟩_e with Δμ = μ_θ − μ_old, z = (x' − μ_old)/τ;
    L_i = max(−A·ρ^G, −A·clip(ρ^G, 1 − ε_lo, 1 + ε_hi)) / Δt_k + β_KL·KL_i. Each item uses its own τ, Δt.

    Args:
        mean: μ_θ [B, *] (with grad).  old_mean: μ_old [B, *].  x_next: x' [B, *].  std: τ_k [B].
        delta_t: Δt_k = t_k − t_{k+1} > 0 [B].  advantages: [B].  clip / KL args as clipped_surrogate_loss.
    Returns: (per-item loss [B], metrics as clipped_surrogate_loss, ratio = ρ^G).
    """
    lo, hi = _clip_bounds(clip_range, clip_range_low, clip_range_high)
    mean, old_mean, x_next, std, delta_t, advantages = _work(mean, old_mean, x_next, std, delta_t, advantages)
    log_ratio = guard_log_ratio(mean, old_mean, x_next, std)
    ratio = torch.exp(log_ratio)
    metrics = _ratio_metrics(ratio, log_ratio, lo, hi)
    per_item = _clipped(advantages, ratio, lo, hi) / delta_t
    return _add_kl(per_item, metrics, ref_kl, kl_coef), metrics


class DppoMask(str, enum.Enum):
    """Flow-DPPO mask variants (docs/algorithms.md §4.2)."""

    # Block iff D > δ and A·(ρ − 1) > 0.
    ORIGINAL = "original"
    # Block iff D > δ and A·(ℓr − D) > 0.
    FIRST_ORDER = "first_order"
    # Block iff D̂ = D + λF + λ²Q > δ and F + λQ > 0 [choice docs/algorithms.md §9.8].
    PREDICTIVE = "predictive"


DPPO_MASKS = tuple(m.value for m in DppoMask)


def dppo_predictive_terms(advantages: torch.Tensor, log_ratio: torch.Tensor, divergence: torch.Tensor,
                          std: torch.Tensor, residual_sq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First- and second-order terms of the predicted divergence D̂ = D + λF + λ²Q (docs/algorithms.md §4.2, §4.3).

    F = A·ρ·(ℓr − D)/τ²,  Q = A²·ρ²·‖x' − μ_θ‖²_e/(2τ⁶),  ρ = exp(ℓr).

    Args: advantages A, log_ratio ℓr, divergence D, std τ, residual_sq ‖x' − μ_θ‖²_e: all [B].
    Returns: (F [B], Q [B]).
    """
    ratio = torch.exp(log_ratio)
    tau2 = std * std
    f = advantages * ratio * (log_ratio - divergence) / tau2
    q = (advantages * ratio) ** 2 * residual_sq / (2.0 * tau2 ** 3)
    return f, q


def dppo_keep_mask(advantages: torch.Tensor, log_ratio: torch.Tensor, divergence: torch.Tensor, *,
                   mask: str = "original", threshold: float = 1e-5, std: Optional[torch.Tensor] = None,
                   residual_sq: Optional[torch.Tensor] = None, predictive_lambda: Optional[float] = None
                   ) -> torch.Tensor:
    """Flow-DPPO trust-region mask M (1 = keep, 0 = blocked), no gradient (docs/algorithms.md §4.2).

    original: block iff D > δ and A·(ρ − 1) > 0 (evaluated as A·ℓr > 0: same sign, no exp round-off);
    first_order: block iff D > δ and A·(ℓr − D) > 0;
    predictive(λ): block iff D̂ > δ and F + λQ > 0, D̂ = D + λF + λ²Q (needs std, residual_sq, λ ≥ 0).
    Works in either convention as long as ℓr, D and δ share it (sum: δ_sum = d·δ; predictive: λ_sum = λ/d).

    Args: advantages A [B], log_ratio ℓr [B], divergence D [B]; std τ [B] and residual_sq ‖x' − μ_θ‖²_e [B]
      (predictive only).
    Returns: M [B] bool.
    """
    check_choice("mask", mask, DPPO_MASKS)
    with torch.no_grad():
        a, lr, d = advantages.detach(), log_ratio.detach(), divergence.detach()
        if mask == DppoMask.ORIGINAL:
            block = (d > threshold) & (a * lr > 0)
        elif mask == DppoMask.FIRST_ORDER:
            block = (d > threshold) & (a * (lr - d) > 0)
        else:
            if std is None or residual_sq is None or predictive_lambda is None or predictive_lambda < 0:
                raise ValueError("mask='predictive' needs std [B], residual_sq [B] and predictive_lambda >= 0")
            lam = float(predictive_lambda)
            f, q = dppo_predictive_terms(a, lr, d, std.detach(), residual_sq.detach())
            block = (d + lam * f + lam * lam * q > threshold) & (f + lam * q > 0)
        return ~block


def flow_dppo_loss(mean: torch.Tensor, old_mean: torch.Tensor, x_next: torch.Tensor, std: torch.Tensor,
                   advantages: torch.Tensor, *, mask: str = "original", threshold: float = 1e-5,
                   predictive_lambda: Optional[float] = None, ref_kl: Optional[torch.Tensor] = None,
                   kl_coef: float = 0.0) -> tuple[torch.Tensor, Metrics]:
    """Flow-DPPO divergence-masked surrogate (docs/algorithms.md §4; no ratio clipping).

    ℓr = exact normalised per-element log-ratio at x' (whatever the rollout's convention), ρ = exp(ℓr),
    D = ‖μ_θ − μ_old‖²_e/(2τ²); L_i = −A·ρ·sg(M_i) + β_KL·KL_i with M from :func:`dppo_keep_mask`.

    Args:
        mean: μ_θ [B, *] (with grad).  old_mean: μ_old [B, *] (anchor).  x_next: x' [B, *].  std: τ_k [B].
        advantages: [B].  mask: one of :data:`DPPO_MASKS`.  threshold: δ (per element).
        predictive_lambda: λ ≥ 0 (predictive only).  ref_kl, kl_coef: optional reference KL.
    Returns: (per-item loss [B], metrics: ratio_mean/std, approx_kl, dppo_mask_frac (blocked fraction),
      dppo_div_mean / dppo_div_max (D)[, dppo_pred_div_mean (D̂)][, kl]).
    """
    check_choice("mask", mask, DPPO_MASKS)
    mean, old_mean, x_next, std, advantages = _work(mean, old_mean, x_next, std, advantages)
    log_ratio = log_ratio_exact(x_next, mean, old_mean, std)
    divergence = gaussian_step_kl(mean, old_mean, std)
    ratio = torch.exp(log_ratio)
    residual_sq = _mean_e((x_next - mean) ** 2) if mask == DppoMask.PREDICTIVE else None
    keep = dppo_keep_mask(advantages, log_ratio, divergence, mask=mask, threshold=threshold, std=std,
                          residual_sq=residual_sq, predictive_lambda=predictive_lambda)
    r = ratio.detach()
    metrics: Metrics = {
        "actor/ratio_mean": r.mean(),
        "actor/ratio_std": r.std(unbiased=False),
        "actor/approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
        "actor/log_ratio_mean": log_ratio.detach().mean(),
        "actor/dppo_mask_frac": (~keep).to(r.dtype).mean(),
        "actor/dppo_div_mean": divergence.detach().mean(),
        "actor/dppo_div_max": divergence.detach().max(),
    }
    if mask == DppoMask.PREDICTIVE:
        with torch.no_grad():
            f, q = dppo_predictive_terms(advantages, log_ratio, divergence, std, residual_sq)
            lam = float(predictive_lambda)
            metrics["actor/dppo_pred_div_mean"] = (divergence + lam * f + lam * lam * q).mean()
    per_item = -advantages * ratio * keep.to(ratio.dtype)
    return _add_kl(per_item, metrics, ref_kl, kl_coef), metrics


# ----------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------


def _check_clip(name: str, clip_range: float, low: Optional[float], high: Optional[float]) -> None:
    for field_name, v in ((f"{name}.clip_range", clip_range), (f"{name}.clip_range_low", low),
                          (f"{name}.clip_range_high", high)):
        if v is not None and not float(v) > 0:
            raise ValueError(f"{field_name}={v!r} is invalid; pass a float > 0 (per-element-mean log-probs "
                             f"need tiny ranges, e.g. 1e-4; docs/algorithms.md §3.1)")


def _check_kl(name: str, kl_coef: float, kl_mode: str, sampler: Optional[str] = None) -> None:
    if not float(kl_coef) >= 0:
        raise ValueError(f"{name}.kl_coef={kl_coef!r} is invalid; pass β_KL >= 0 (0 turns the reference KL off)")
    check_choice(f"{name}.kl_mode", kl_mode, RATIO_KL_MODES)
    if sampler is not None:
        check_choice(f"{name}.sampler", sampler, SAMPLERS)


@dataclass(frozen=True)
class FlowGrpoConfig:
    """Flow-GRPO (docs/algorithms.md §3.1). Defaults: the SD3.5 GenEval / OCR preset."""

    # ε_clip: symmetric clip range of ρ = exp(ℓ_θ − ℓ_old). Tiny because log-probs are per-element means.
    clip_range: float = 1e-4
    # ε_lo (lower side, ρ ≥ 1 − ε_lo); None = clip_range.
    clip_range_low: Optional[float] = None
    # ε_hi (upper side, ρ ≤ 1 + ε_hi); None = clip_range.
    clip_range_high: Optional[float] = None
    # β_KL on the KL to the reference policy; 0 turns it (and the reference forward) off. PickScore: 0.01.
    kl_coef: float = 0.04
    # KL formula (docs/algorithms.md §1.7): exact | flow_grpo_legacy (÷2g² instead of ÷2τ²; what the published β assume).
    kl_mode: str = "flow_grpo_legacy"
    # Rollout sampler (rollout.sde.type); only flow_grpo_legacy reads it (CPS legacy = exact).
    sampler: str = "flow_sde"

    def __post_init__(self):
        _check_clip("flow_grpo", self.clip_range, self.clip_range_low, self.clip_range_high)
        _check_kl("flow_grpo", self.kl_coef, self.kl_mode, self.sampler)


@dataclass(frozen=True)
class DanceGrpoConfig:
    """DanceGRPO (docs/algorithms.md §3.1 preset): the Flow-GRPO surrogate on Dance-SDE steps; group-std advantages (§2.1)."""

    # ε_clip (symmetric).
    clip_range: float = 1e-4
    # ε_lo; None = clip_range.
    clip_range_low: Optional[float] = None
    # ε_hi; None = clip_range.
    clip_range_high: Optional[float] = None
    # β_KL; the DanceGRPO preset trains without a reference KL.
    kl_coef: float = 0.0
    # KL formula when kl_coef > 0 (docs/algorithms.md §1.7).
    kl_mode: str = "exact"
    # Rollout sampler (rollout.sde.type); only flow_grpo_legacy reads it.
    sampler: str = "dance"

    def __post_init__(self):
        _check_clip("dance_grpo", self.clip_range, self.clip_range_low, self.clip_range_high)
        _check_kl("dance_grpo", self.kl_coef, self.kl_mode, self.sampler)


@dataclass(frozen=True)
class GrpoGuardConfig:
    """GRPO-Guard (docs/algorithms.md §3.2). Defaults: the published preset (Flow-SDE, exact log-probs, group std)."""

    # ε_clip on ρ^G = exp(c^v·⟨Δv, z⟩_e).
    clip_range: float = 2e-6
    # ε_lo; None = clip_range.
    clip_range_low: Optional[float] = None
    # ε_hi; None = clip_range.
    clip_range_high: Optional[float] = None
    # β_KL; the preset uses none.
    kl_coef: float = 0.0
    # KL formula when kl_coef > 0 (docs/algorithms.md §1.7).
    kl_mode: str = "exact"
    # Rollout sampler; only flow_grpo_legacy reads it.
    sampler: str = "flow_sde"

    def __post_init__(self):
        _check_clip("grpo_guard", self.clip_range, self.clip_range_low, self.clip_range_high)
        _check_kl("grpo_guard", self.kl_coef, self.kl_mode, self.sampler)


@dataclass(frozen=True)
class TempFlowGrpoConfig:
    """TempFlow-GRPO (docs/algorithms.md §3.3): c·τ_k·L^clip with per-step (process) advantages."""

    # c > 0: constant in front of τ_k·L^clip (public code 2.25).
    scale: float = 2.25
    # ε_clip (symmetric).
    clip_range: float = 1e-4
    # ε_lo; None = clip_range.
    clip_range_low: Optional[float] = None
    # ε_hi; None = clip_range.
    clip_range_high: Optional[float] = None
    # β_KL; off by default [choice: the papers give no value].
    kl_coef: float = 0.0
    # KL formula: docs/algorithms.md §3.3 uses exact τ_k.
    kl_mode: str = "exact"
    # Rollout sampler; only flow_grpo_legacy reads it.
    sampler: str = "flow_sde"

    def __post_init__(self):
        if not float(self.scale) > 0:
            raise ValueError(f"tempflow_grpo.scale={self.scale!r} is invalid; pass c > 0 (public code: 2.25)")
        _check_clip("tempflow_grpo", self.clip_range, self.clip_range_low, self.clip_range_high)
        _check_kl("tempflow_grpo", self.kl_coef, self.kl_mode, self.sampler)


@dataclass(frozen=True)
class FlowDppoConfig:
    """Flow-DPPO (docs/algorithms.md §4). Defaults: original mask, δ = 1e-5, no reference KL."""

    # Mask variant: original | first_order | predictive (docs/algorithms.md §4.2).
    mask: str = "original"
    # δ: per-element-mean divergence threshold with exact τ normalisation (same for Flow-SDE and CPS).
    threshold: float = 1e-5
    # λ = η_μ/d of the predictive mask; read only when mask = predictive, then must be > 0. The paper gives no
    # default; 3e-4 is our [choice]: a per-element velocity change of ~1e-2 at SD3.5 scale (d = 65,536,
    # τ ≈ 0.35, |c^v| ≈ 0.1) makes λ²Q comparable to δ. Tune it per model.
    predictive_lambda: float = 3e-4
    # β_KL on the exact KL to the reference (docs/algorithms.md §4.2, optional).
    kl_coef: float = 0.0
    # KL formula when kl_coef > 0 (docs/algorithms.md §4.2: exact).
    kl_mode: str = "exact"
    # Rollout sampler; only flow_grpo_legacy reads it.
    sampler: str = "flow_sde"

    def __post_init__(self):
        check_choice("flow_dppo.mask", self.mask, DPPO_MASKS)
        if not float(self.threshold) > 0:
            raise ValueError(f"flow_dppo.threshold={self.threshold!r} is invalid; pass δ > 0 (default 1e-5)")
        if self.mask == DppoMask.PREDICTIVE and not float(self.predictive_lambda) > 0:
            raise ValueError(f"flow_dppo.predictive_lambda={self.predictive_lambda!r} is invalid for "
                             f"mask='predictive'; pass λ > 0 (λ = η_μ/d, docs/algorithms.md §4.3; default 3e-4)")
        _check_kl("flow_dppo", self.kl_coef, self.kl_mode, self.sampler)


# ----------------------------------------------------------------------------------------------------
# Registered entries
# ----------------------------------------------------------------------------------------------------


def _check_inputs(q: StepQuantities, batch: StepBatch, q_names: tuple[str, ...], loss_name: str) -> None:
    """Batch shapes (StepBatch.check_shapes) and the declared step quantities: present, [B]/[B, *] consistent."""
    batch.check_shapes()
    n = batch.advantages.shape[0]
    missing = [name for name in q_names if getattr(q, name) is None]
    if missing:
        raise ValueError(f"loss {loss_name!r} needs StepQuantities {missing} but they are None; "
                         f"the engine must compute the loss's declared needs (LossSpec.needs_for)")
    bad = {name: tuple(getattr(q, name).shape) for name in q_names if getattr(q, name).shape[0] != n}
    if bad:
        raise ValueError(f"loss {loss_name!r}: StepQuantities shape mismatch: advantages has {n} items but {bad}")
    ref = batch.x_next if batch.x_next is not None else batch.x_t
    if ref is not None:
        bad = {name: tuple(getattr(q, name).shape) for name in q_names
               if getattr(q, name).dim() > 1 and getattr(q, name).shape != ref.shape}
        if bad:
            raise ValueError(f"loss {loss_name!r}: StepQuantities latent shape mismatch: batch latents are "
                             f"{tuple(ref.shape)} but {bad}")


def _reference_kl(q: StepQuantities, batch: StepBatch, cfg, loss_name: str) -> Optional[torch.Tensor]:
    """KL_{i,k} to the reference (docs/algorithms.md §1.7) when cfg.kl_coef > 0, else None.  [B]."""
    if not cfg.kl_coef > 0:
        return None
    batch.require(KL_BATCH_KEYS, loss_name)
    _check_inputs(q, batch, ("velocity", "ref_velocity"), loss_name)
    return reference_kl(cfg.kl_mode, velocity=q.velocity, ref_velocity=q.ref_velocity, c_v=batch.c_v,
                        std=batch.std, t=batch.t, dt=batch.t - batch.t_next, sampler=cfg.sampler)


def _output(per_item: torch.Tensor, metrics: Metrics) -> LossOutput:
    """Mean over items (masked items stay in the denominator); metrics to floats in one host sync."""
    names = list(metrics)
    values = torch.stack([metrics[k].detach().to(torch.float64).reshape(()) for k in names]).tolist() if names else []
    return LossOutput(loss=per_item.mean(), metrics=dict(zip(names, values)))


def _keys(*names: str) -> tuple[str, ...]:
    """The loss's own StepBatch fields followed by the reference-KL fields (deduplicated, ordered)."""
    return tuple(dict.fromkeys(names + KL_BATCH_KEYS))


_GRPO_NEEDS = StepNeeds.LOG_PROB | StepNeeds.VELOCITY  # VELOCITY: only read by the reference KL
_GRPO_KEYS = _keys("advantages", "old_log_prob")


@register_loss("flow_grpo", needs=_GRPO_NEEDS, batch_keys=_GRPO_KEYS, config=FlowGrpoConfig)
def flow_grpo_entry(q: StepQuantities, batch: StepBatch, cfg: FlowGrpoConfig) -> LossOutput:
    """Flow-GRPO (docs/algorithms.md §3.1): clipped surrogate on q.log_prob vs batch.old_log_prob + β·KL."""
    batch.require(("advantages", "old_log_prob"), "flow_grpo")
    _check_inputs(q, batch, ("log_prob",), "flow_grpo")
    per_item, metrics = clipped_surrogate_loss(
        q.log_prob, batch.old_log_prob, batch.advantages, clip_range=cfg.clip_range,
        clip_range_low=cfg.clip_range_low, clip_range_high=cfg.clip_range_high,
        ref_kl=_reference_kl(q, batch, cfg, "flow_grpo"), kl_coef=cfg.kl_coef)
    return _output(per_item, metrics)


@register_loss("dance_grpo", needs=_GRPO_NEEDS, batch_keys=_GRPO_KEYS, config=DanceGrpoConfig)
def dance_grpo_entry(q: StepQuantities, batch: StepBatch, cfg: DanceGrpoConfig) -> LossOutput:
    """DanceGRPO (docs/algorithms.md §3.1 preset): the Flow-GRPO surrogate; Dance-SDE coefficients come from the sampler."""
    batch.require(("advantages", "old_log_prob"), "dance_grpo")
    _check_inputs(q, batch, ("log_prob",), "dance_grpo")
    per_item, metrics = clipped_surrogate_loss(
        q.log_prob, batch.old_log_prob, batch.advantages, clip_range=cfg.clip_range,
        clip_range_low=cfg.clip_range_low, clip_range_high=cfg.clip_range_high,
        ref_kl=_reference_kl(q, batch, cfg, "dance_grpo"), kl_coef=cfg.kl_coef)
    return _output(per_item, metrics)


_GUARD_KEYS = _keys("advantages", "old_mean", "x_next", "std", "t", "t_next")


@register_loss("grpo_guard", needs=StepNeeds.MEAN | StepNeeds.VELOCITY, batch_keys=_GUARD_KEYS,
               config=GrpoGuardConfig)
def grpo_guard_entry(q: StepQuantities, batch: StepBatch, cfg: GrpoGuardConfig) -> LossOutput:
    """GRPO-Guard (docs/algorithms.md §3.2): log ρ^G = ⟨μ_θ − μ_old, z⟩_e (= c^v·⟨Δv, z⟩_e), clipped, ÷ Δt_k."""
    batch.require(_GUARD_KEYS, "grpo_guard")
    _check_inputs(q, batch, ("mean",), "grpo_guard")
    per_item, metrics = grpo_guard_loss(
        q.mean, batch.old_mean, batch.x_next, batch.std, batch.t - batch.t_next, batch.advantages,
        clip_range=cfg.clip_range, clip_range_low=cfg.clip_range_low, clip_range_high=cfg.clip_range_high,
        ref_kl=_reference_kl(q, batch, cfg, "grpo_guard"), kl_coef=cfg.kl_coef)
    return _output(per_item, metrics)


# step_advantages is optional (branched rollouts only), so it is not a required batch key.
_TEMPFLOW_KEYS = _keys("advantages", "old_log_prob", "std")


@register_loss("tempflow_grpo", needs=_GRPO_NEEDS, batch_keys=_TEMPFLOW_KEYS, config=TempFlowGrpoConfig)
def tempflow_grpo_entry(q: StepQuantities, batch: StepBatch, cfg: TempFlowGrpoConfig) -> LossOutput:
    """TempFlow-GRPO (docs/algorithms.md §3.3): c·τ_k·L^clip with batch.step_advantages (fallback: batch.advantages)."""
    batch.require(_TEMPFLOW_KEYS, "tempflow_grpo")
    _check_inputs(q, batch, ("log_prob",), "tempflow_grpo")
    adv = batch.step_advantages if batch.step_advantages is not None else batch.advantages
    per_item, metrics = tempflow_grpo_loss(
        q.log_prob, batch.old_log_prob, adv, batch.std, scale=cfg.scale, clip_range=cfg.clip_range,
        clip_range_low=cfg.clip_range_low, clip_range_high=cfg.clip_range_high,
        ref_kl=_reference_kl(q, batch, cfg, "tempflow_grpo"), kl_coef=cfg.kl_coef)
    return _output(per_item, metrics)


_DPPO_KEYS = _keys("advantages", "old_mean", "x_next", "std")


@register_loss("flow_dppo", needs=StepNeeds.MEAN | StepNeeds.VELOCITY, batch_keys=_DPPO_KEYS,
               config=FlowDppoConfig)
def flow_dppo_entry(q: StepQuantities, batch: StepBatch, cfg: FlowDppoConfig) -> LossOutput:
    """Flow-DPPO (docs/algorithms.md §4): exact ℓr and D from q.mean vs batch.old_mean at batch.x_next, masked, no clip."""
    batch.require(_DPPO_KEYS, "flow_dppo")
    _check_inputs(q, batch, ("mean",), "flow_dppo")
    per_item, metrics = flow_dppo_loss(
        q.mean, batch.old_mean, batch.x_next, batch.std, batch.advantages, mask=cfg.mask,
        threshold=cfg.threshold,
        predictive_lambda=cfg.predictive_lambda if cfg.mask == DppoMask.PREDICTIVE else None,
        ref_kl=_reference_kl(q, batch, cfg, "flow_dppo"), kl_coef=cfg.kl_coef)
    return _output(per_item, metrics)
