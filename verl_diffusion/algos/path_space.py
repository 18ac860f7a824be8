"""Unified path-space loss family (docs/algorithms.md §7; P-S = "Designing RL for Diffusion Models: A Unified Path-Space View").

Per item (sample i, state x_t at time t), docs/algorithms.md §7.2:

    ℓ = w1(A, t)·‖Δv‖²_e + w2(t)·⟨Δv, ĝ⟩_e + β_KL·KL,     Δv = v_θ(x_t, t) − sg(v_old(x_t, t)),

with a θ-independent direction ĝ (value-gradient estimator, §7.4) computed once per trained step over
complete groups right after the rollout (the ``prepare`` hook), and a weight pair (w1, w2) from the
scale-bounded families of §7.5 or from a preset that recovers an existing method (§7.7).

Shapes: ``B`` items, ``*`` latent dims, ``d`` = number of latent elements per item. Reductions are
per-element means (docs/algorithms.md §0.3) except the KDE bandwidth, which uses the paper's sum convention h.
Pure torch + stdlib.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

from verl_diffusion.algos.kl import KL_MODES, reference_kl
from verl_diffusion.algos.checks import check_choice
from verl_diffusion.algos.tensor_ops import bcast as _bcast, mean_e as _mean_e
from verl_diffusion.algos.loss_spec import LOSSES, LossSpec, register_loss
from verl_diffusion.algos.sde import SAMPLERS, StepCoefficients, step_mean
from verl_diffusion.algos.types import LossOutput, StateSource, StepBatch, StepNeeds, StepQuantities

ESTIMATORS = ("stochastic", "deterministic", "kde")
W1_FAMILIES = ("zero", "t", "one_minus_t", "adv_t", "adv_one_minus_t")
W2_FAMILIES = ("t", "one_minus_t")
XT_SOURCES = tuple(s.value for s in StateSource)
# Weight rules: "family" = §7.5 families; the others are the exact §7.7 preset coefficients.
WEIGHT_RULES = ("family", "flow_grpo", "grpo_guard", "tempflow", "awm", "nft")
# How the anchor advantage is transformed before it enters ĝ and w1 (AWM A'', NFT A').
ADVANTAGE_TRANSFORMS = ("none", "awm", "nft")
# Default KDE bandwidth in the sum convention: h = d / 2000 (docs/algorithms.md §7.4; 32.768 at d = 65,536).
DEFAULT_BANDWIDTH_PER_ELEMENT = 1.0 / 2000.0


# ---------------------------------------------------------------------------------------------------
# Value-gradient estimators (docs/algorithms.md §7.4)
# ---------------------------------------------------------------------------------------------------

def conditional_velocity(x_t: torch.Tensor, t: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """v(x_t, x0) = (x_t − x0)/t (docs/algorithms.md §0.1).  x_t, x0: [B, *]; t: [B] > 0.  Returns [B, *]."""
    return (x_t - x0) / _bcast(t, x_t)


def stochastic_direction(advantages: torch.Tensor, noise_z: torch.Tensor) -> torch.Tensor:
    """Brownian one-sample direction ĝ_sto = A·z (docs/algorithms.md §7.4 row 1).

    Args: advantages [B]; noise_z [B, *] standardized step noise z = (x_{t_{k+1}} − μ_old)/τ_k.
    Returns: [B, *]. Scale s(t) = 1/τ_k (:func:`estimator_scale`).
    """
    return _bcast(advantages.to(noise_z.dtype), noise_z) * noise_z


def step_noise(x_t: torch.Tensor, x_next: torch.Tensor, old_velocity: torch.Tensor, c_x: torch.Tensor,
               c_v: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Standardized noise z = (x_next − μ_old)/τ with μ_old = c^x·x_t + c^v·v_old (docs/algorithms.md §1.2).

    Items with τ = 0 (CPS last step, ODE) get z = 0, so the stochastic estimator skips them (§7.3).
    Shapes: x_t, x_next, old_velocity [B, *]; c_x, c_v, std [B].  Returns [B, *].
    """
    mean = step_mean(x_t, old_velocity, StepCoefficients(c_x, c_v, std))
    safe = torch.where(std > 0, std, torch.ones_like(std))
    z = (x_next - mean) / _bcast(safe, x_t)
    return torch.where(_bcast(std > 0, x_t), z, torch.zeros_like(z))


def deterministic_direction(x_t: torch.Tensor, t: torch.Tensor, x0: torch.Tensor, old_velocity: torch.Tensor,
                            advantages: torch.Tensor) -> torch.Tensor:
    """One-sample direction ĝ_det = −A·(v(x_t, x0) − v_old) (docs/algorithms.md §7.4 row 2; P-S Prop. 3).

    Args: x_t, x0, old_velocity [B, *]; t [B] (> 0); advantages [B].  Returns [B, *]; scale (1−t)/t.
    """
    v = conditional_velocity(x_t, t, x0)
    return -_bcast(advantages.to(v.dtype), v) * (v - old_velocity)


def _group_layout(group_ids: torch.Tensor):
    """Dense (group, slot) coordinates for every item: inv [B], pos [B], n_groups, max group size."""
    _, inv = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(inv)
    order = torch.argsort(inv, stable=True)
    start = torch.cumsum(counts, 0) - counts
    pos = torch.empty_like(inv)
    pos[order] = torch.arange(inv.numel(), device=inv.device) - start[inv[order]]
    return inv, pos, counts.numel(), int(counts.max())


def _kde(x_t, t, x0, old_velocity, advantages, group_ids, bandwidth):
    """Shared KDE core: returns ĝ [B, *], weights ω [B, G_max], member mask [B, G_max]."""
    B = x_t.shape[0]
    shape = x_t.shape
    d = x_t[0].numel()
    h = float(d) * DEFAULT_BANDWIDTH_PER_ELEMENT if bandwidth is None else float(bandwidth)
    if not h > 0:
        raise ValueError(f"kde_bandwidth={bandwidth!r} must be > 0 (sum convention; default d/2000 = {d / 2000})")
    dt = torch.promote_types(x_t.dtype, torch.float32)  # kernel weights in fp32 or better (docs/algorithms.md §0.5)
    xt = x_t.reshape(B, d).to(dt)
    xe = x0.reshape(B, d).to(dt)
    vo = old_velocity.reshape(B, d).to(dt)
    tt = t.to(dt)
    a = advantages.to(dt)
    inv, pos, n_groups, g_max = _group_layout(group_ids)
    contiguous = n_groups * g_max == B and bool((inv == torch.arange(B, device=inv.device) // g_max).all())
    if contiguous:
        # Fast path (the usual layout): equal-size groups stored contiguously -> views, no padding copies.
        X0, XT = xe.view(n_groups, g_max, d), xt.view(n_groups, g_max, d)
        Ap = a.view(n_groups, g_max)
        member = torch.ones(n_groups, g_max, dtype=torch.bool, device=x_t.device)
    else:
        # Padded [n_groups, G_max, ...] copies: each group's items are both anchors and pool members.
        X0 = xe.new_zeros(n_groups, g_max, d)
        X0[inv, pos] = xe
        XT = xt.new_zeros(n_groups, g_max, d)
        XT[inv, pos] = xt
        Ap = a.new_zeros(n_groups, g_max)
        Ap[inv, pos] = a
        member = torch.zeros(n_groups, g_max, dtype=torch.bool, device=x_t.device)
        member[inv, pos] = True
    # ‖x_t,i − (1−t_i)x0_j‖² = ‖x_t,i‖² − 2(1−t_i)⟨x_t,i, x0_j⟩ + (1−t_i)²‖x0_j‖²  (Gram matrix via bmm).
    # ‖x_t,i‖² is the same for every member j of anchor i, so it cancels in the softmax and is dropped.
    gram = torch.bmm(XT, X0.transpose(1, 2))[inv, pos]          # [B, G_max]
    sq0 = torch.linalg.vector_norm(X0, dim=-1).square()[inv]      # [B, G_max]
    s = (1 - tt).unsqueeze(1)
    logits = (2 * s * gram - s * s * sq0) / (2 * h * tt.unsqueeze(1) ** 2)
    mask = member[inv]                                            # [B, G_max]
    if not contiguous:
        logits = logits.masked_fill(~mask, float("-inf"))
    logits = logits - logits.max(dim=1, keepdim=True).values     # max-subtraction
    w = torch.exp(logits)
    w = w / w.sum(dim=1, keepdim=True)
    # ĝ_i = −Σ_j ω_ij A_j (v_ij − v_old,i) = (Σ_j ω_ij A_j x0_j − S_i·x_t,i)/t_i + S_i·v_old,i,  S_i = Σ_j ω_ij A_j.
    wa = w * Ap[inv]                                              # [B, G_max]
    S = wa.sum(dim=1, keepdim=True)                               # [B, 1]
    # Σ_j ω_ij A_j x0_j as one bmm per group: [n_groups, G_max(anchor), G_max(member)] @ [n_groups, G_max, d].
    # Rows are pre-scaled by 1/t_i so the bmm yields (1/t_i)·Σ_j ω_ij A_j x0_j directly.
    inv_t = 1.0 / tt.unsqueeze(1)
    WA = wa.new_zeros(n_groups, g_max, g_max)
    WA[inv, pos] = wa * inv_t
    g = torch.bmm(WA, X0).view(B, d) if contiguous else torch.bmm(WA, X0)[inv, pos]
    g.addcmul_(xt, -S * inv_t).addcmul_(vo, S)
    return g.reshape(shape), w, mask


def kde_value_gradient(x_t: torch.Tensor, t: torch.Tensor, x0: torch.Tensor, old_velocity: torch.Tensor,
                       advantages: torch.Tensor, group_ids: torch.Tensor, *,
                       bandwidth: Optional[float] = None) -> torch.Tensor:
    """Nadaraya–Watson KDE direction (docs/algorithms.md §7.4 row 3; P-S Eq. 10).

    ĝ_i = −Σ_{j∈g(i)} ω_ij·A_j·(v(x_t,i, x0_j) − v_old,i),
    ω_ij = softmax_j(−‖x_t,i − (1−t_i)·x0_j‖² / (2·h·t_i²)) over the *whole* group of anchor i (anchor and
    zero-advantage members included). Every item of the batch is both an anchor (its own x_t, t, v_old)
    and a pool member (its x0, A); groups are given by ``group_ids``, so pass one trained step over
    complete groups (the ``prepare`` hook does). One batched computation: groups are padded to the
    largest size and masked; distances via a Gram matrix (bmm), weighted sums via bmm.

    Args:
        x_t [B, *], t [B] (> 0), x0 [B, *], old_velocity [B, *], advantages [B], group_ids [B] (int).
        bandwidth: h in the sum convention; None → d/2000. h = 1 gives exact posterior weights.
    Returns: ĝ [B, *] in fp32 or better (fp64 in → fp64 out). Scale s(t) = (1−t)/t.
    Cost: O(B·G·d) flops, O(n_groups·G·d) extra memory, no network pass.
    """
    return _kde(x_t, t, x0, old_velocity, advantages, group_ids, bandwidth)[0]


def kde_weights(x_t: torch.Tensor, t: torch.Tensor, x0: torch.Tensor, group_ids: torch.Tensor, *,
                bandwidth: Optional[float] = None):
    """KDE weights of :func:`kde_value_gradient` for monitoring.

    Returns (ω [B, G_max], member mask [B, G_max]); column j is the j-th member of the anchor's group in
    batch order; padded columns have ω = 0 and mask False.
    """
    zeros = torch.zeros(x_t.shape[0], dtype=x_t.dtype, device=x_t.device)
    _, w, mask = _kde(x_t, t, x0, torch.zeros_like(x_t), zeros, group_ids, bandwidth)
    return w, mask


def kde_weight_metrics(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Entropy (nats) and max weight of the KDE weights, averaged over anchors; G_eff = exp(entropy)."""
    p = weights.masked_fill(~mask, 0.0)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(dim=1)
    return {"actor/kde_weight_entropy": float(ent.mean()),
            "actor/kde_weight_max": float(p.max(dim=1).values.mean()),
            "actor/kde_effective_members": float(torch.exp(ent).mean())}


def estimator_scale(estimator: str, t: torch.Tensor, *, std: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scale s(t) with ∇̂V = s(t)·ĝ (docs/algorithms.md §7.4): (1−t)/t for deterministic/KDE, 1/τ_k for stochastic.

    Args: t [B] (> 0); std [B] (τ_k, required for ``stochastic``).  Returns [B].
    """
    check_choice("estimator", estimator, ESTIMATORS)
    if estimator == "stochastic":
        if std is None:
            raise ValueError("estimator_scale('stochastic') needs std=τ_k (s = 1/τ_k, docs/algorithms.md §7.4)")
        return 1.0 / std
    return (1 - t) / t


# ---------------------------------------------------------------------------------------------------
# Weight families (docs/algorithms.md §7.5)
# ---------------------------------------------------------------------------------------------------

def _check_exponent(name: str, exponent: float) -> None:
    if exponent < 0:
        warnings.warn(f"{name} exponent {exponent} < 0 makes the weight unbounded as t → 0 or t → 1; "
                      "docs/algorithms.md §7.5 requires scale-bounded weights (exponent ≥ 0)", stacklevel=3)


def w1_weight(family: str, t: torch.Tensor, advantages: torch.Tensor, *, exponent: float = 1.0,
              constant: float = 1.0) -> torch.Tensor:
    """Off-policy weight w1(A, t) (docs/algorithms.md §7.5): 0 | c·t^α | c·(1−t)^α | c·A·t^α | c·A·(1−t)^α.

    Args: t [B]; advantages [B] (anchor's A_i).  Returns [B]. Warns when α < 0 (unbounded).
    """
    check_choice("w1_family", family, W1_FAMILIES)
    _check_exponent("w1", exponent)
    if family == "zero":
        return torch.zeros_like(t)
    base = t if family in ("t", "adv_t") else 1 - t
    w = constant * base.clamp_min(0) ** exponent
    return w * advantages.to(w.dtype) if family.startswith("adv_") else w


def w2_weight(family: str, t: torch.Tensor, *, exponent: float = 1.0, constant: float = 1.0) -> torch.Tensor:
    """On-policy weight w2(t) (docs/algorithms.md §7.5): c·t^α (default) | c·(1−t)^α.  t [B] -> [B]."""
    check_choice("w2_family", family, W2_FAMILIES)
    _check_exponent("w2", exponent)
    base = t if family == "t" else 1 - t
    return constant * base.clamp_min(0) ** exponent


def preset_weights(rule: str, *, advantages: torch.Tensor, c_v: Optional[torch.Tensor] = None,
                   std: Optional[torch.Tensor] = None, dt: Optional[torch.Tensor] = None,
                   tempflow_c: float = 1.0, nft_beta: float = 1.0):
    """Exact (w1, w2) of the method-recovering presets (docs/algorithms.md §7.7), each [B].

    flow_grpo: (A·(c^v)²/(2τ²), |c^v|/τ); grpo_guard: (0, |c^v|/Δt); tempflow: (c·A·(c^v)²/(2τ), c·|c^v|);
    awm: (A'', 2); nft: (1, 2/β_NFT). ``advantages`` is the already transformed A (A'' or A' for awm/nft).
    |c^v| is taken as −c^v (c^v < 0 for every sampler, docs/algorithms.md §1.2), which keeps the identities exact.
    """
    check_choice("weight_rule", rule, WEIGHT_RULES[1:])
    a = advantages
    if rule == "awm":
        return a, torch.full_like(a, 2.0)
    if rule == "nft":
        return torch.ones_like(a), torch.full_like(a, 2.0 / nft_beta)
    if c_v is None or (rule != "grpo_guard" and std is None) or (rule == "grpo_guard" and dt is None):
        raise ValueError(f"preset weights {rule!r} need the sampler coefficients c_v, std (and Δt for grpo_guard)")
    if rule == "flow_grpo":
        return a * c_v ** 2 / (2 * std ** 2), -c_v / std
    if rule == "grpo_guard":
        return torch.zeros_like(a), -c_v / dt
    return tempflow_c * a * c_v ** 2 / (2 * std), tempflow_c * (-c_v)


def path_space_item_loss(velocity: torch.Tensor, old_velocity: torch.Tensor, direction: torch.Tensor,
                         w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Per-item path-space loss w1·‖Δv‖²_e + w2·⟨Δv, ĝ⟩_e, Δv = v_θ − sg(v_old) (docs/algorithms.md §7.2).

    Args: velocity (with grad), old_velocity, direction [B, *]; w1, w2 [B].  Returns [B].
    Gradient w.r.t. v_θ per element: (2·w1·Δv + w2·ĝ)/d.
    """
    dv = velocity - old_velocity.detach()
    dv2 = _mean_e(dv * dv)
    inner = _mean_e(dv * direction.detach().to(dv.dtype))
    return w1.to(dv2.dtype) * dv2 + w2.to(dv2.dtype) * inner


def transform_advantages(kind: str, advantages: torch.Tensor, *, adv_clip_max: float = 5.0,
                         awm_scale: float = 1.0) -> torch.Tensor:
    """none: A; awm: A'' = clamp(A, ±A_max)/A_max·a_max (docs/algorithms.md §6); nft: A' = clamp(A, ±A_max)/A_max (§5.2)."""
    check_choice("advantage_transform", kind, ADVANTAGE_TRANSFORMS)
    if kind == "none":
        return advantages
    a = advantages.clamp(-adv_clip_max, adv_clip_max) / adv_clip_max
    return a * awm_scale if kind == "awm" else a


# ---------------------------------------------------------------------------------------------------
# Presets (docs/algorithms.md §7.7) and config
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PathSpacePreset:
    """One row of docs/algorithms.md §7.7: estimator, weights and state source (+ the sampler noise P-S used, η)."""

    estimator: str
    weight_rule: str
    xt_source: str
    w1_family: str = "one_minus_t"
    w2_family: str = "t"
    advantage_transform: str = "none"
    # Recommended Flow-SDE noise in P-S η units (a = √(2η), docs/algorithms.md §9.1); informational, the rollout owns it.
    eta: Optional[float] = None


PATH_SPACE_PRESETS: dict[str, PathSpacePreset] = {
    "ps_kde": PathSpacePreset("kde", "family", "trajectory", "one_minus_t", "t", eta=0.005),
    "ps_det": PathSpacePreset("deterministic", "family", "trajectory", "one_minus_t", "t", eta=0.005),
    "ps_sto": PathSpacePreset("stochastic", "family", "trajectory", "zero", "t", eta=0.225),
    "flow_grpo": PathSpacePreset("stochastic", "flow_grpo", "trajectory"),
    "grpo_guard": PathSpacePreset("stochastic", "grpo_guard", "trajectory"),
    "tempflow": PathSpacePreset("stochastic", "tempflow", "trajectory"),
    "awm": PathSpacePreset("deterministic", "awm", "forward_noising", advantage_transform="awm"),
    "nft": PathSpacePreset("deterministic", "nft", "forward_noising", advantage_transform="nft"),
}


@dataclass(frozen=True)
class PathSpaceConfig:
    """Knobs of the ``path_space`` loss (docs/algorithms.md §7). Fields left ``None`` take the preset's value."""

    # Which §7.7 row: ps_kde (P-S recipe, default) | ps_det | ps_sto | flow_grpo | grpo_guard | tempflow | awm | nft.
    preset: str = "ps_kde"
    # Value-gradient estimator: stochastic | deterministic | kde (docs/algorithms.md §7.4). None → preset.
    estimator: Optional[str] = None
    # KDE bandwidth h, sum convention. None → d/2000 (docs/algorithms.md §7.4); 1.0 → exact posterior weights.
    kde_bandwidth: Optional[float] = None
    # w1 family (docs/algorithms.md §7.5): zero | t | one_minus_t | adv_t | adv_one_minus_t. None → preset (family presets only).
    w1_family: Optional[str] = None
    # w1 exponent α1 ≥ 0 and constant c1.
    w1_exponent: float = 1.0
    w1_constant: float = 1.0
    # w2 family: t | one_minus_t. None → preset.
    w2_family: Optional[str] = None
    # w2 exponent α2 ≥ 0 and constant c2.
    w2_exponent: float = 1.0
    w2_constant: float = 1.0
    # State source: trajectory | forward_noising (docs/algorithms.md §7.3). None → preset.
    xt_source: Optional[str] = None
    # Reference KL coefficient β_KL and mode (docs/algorithms.md §7.6): v_space | girsanov | gaussian_step | exact | flow_grpo_legacy.
    kl_coef: float = 1e-4
    kl_mode: str = "v_space"
    # Sampler name and noise level, forwarded to the reference-KL helper for the Gaussian/Girsanov modes.
    sampler: str = "flow_sde"
    noise_level: Optional[float] = None
    # Advantage clip A_max for the awm/nft transforms, and AWM's a_max.
    adv_clip_max: float = 5.0
    awm_adv_scale: float = 1.0
    # NFT β (nft preset: w2 = 2/β) and TempFlow's constant c (tempflow preset; public code uses 2.25).
    nft_beta: float = 1.0
    tempflow_c: float = 1.0

    def __post_init__(self):
        check_choice("preset", self.preset, PATH_SPACE_PRESETS)
        p = PATH_SPACE_PRESETS[self.preset]
        for name in ("estimator", "w1_family", "w2_family", "xt_source"):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(p, name))
        check_choice("estimator", self.estimator, ESTIMATORS)
        check_choice("w1_family", self.w1_family, W1_FAMILIES)
        check_choice("w2_family", self.w2_family, W2_FAMILIES)
        check_choice("xt_source", self.xt_source, XT_SOURCES)
        check_choice("kl_mode", self.kl_mode, KL_MODES)
        check_choice("sampler", self.sampler, SAMPLERS)
        if self.estimator == "stochastic" and self.xt_source != "trajectory":
            raise ValueError("estimator='stochastic' needs xt_source='trajectory' (it reads the stored step noise "
                             "z = (x_{t_{k+1}} − μ_old)/τ, docs/algorithms.md §7.3); use deterministic or kde for forward_noising")
        if self.kde_bandwidth is not None and not self.kde_bandwidth > 0:
            raise ValueError(f"kde_bandwidth={self.kde_bandwidth} must be > 0 or None (→ d/2000)")
        if self.nft_beta <= 0 or self.adv_clip_max <= 0:
            raise ValueError("nft_beta and adv_clip_max must be > 0")
        for name in ("w1_exponent", "w2_exponent"):
            if getattr(self, name) < 0:
                warnings.warn(f"path_space {name}={getattr(self, name)} < 0 gives weights unbounded in t; "
                              "docs/algorithms.md §7.5 asks for scale-bounded weights (exponent ≥ 0)", stacklevel=3)

    @property
    def weight_rule(self) -> str:
        return PATH_SPACE_PRESETS[self.preset].weight_rule

    @property
    def advantage_transform(self) -> str:
        return PATH_SPACE_PRESETS[self.preset].advantage_transform


def path_space_requirements(cfg: PathSpaceConfig):
    """(needs, prepare-input batch keys, loss batch keys) of one config (docs/algorithms.md §7.3, §7.4).

    trajectory: the prepare hook reads x_t, t, x0, old_velocity, advantages, group_ids (+ x_next, c_x, c_v,
    std for stochastic) and writes value_direction; the loss reads value_direction, old_velocity, t,
    advantages (+ sampler coefficients / t_next for the exact presets and Gaussian KL modes).
    forward_noising: x_t = (1−t)·x0 + t·ε (or x0, noise), t, advantages and the fresh no-grad v_old
    (OLD_VELOCITY_FRESH). The prepare hook receives that fresh v_old as ``old_velocity`` (the engine
    computes it over the whole batch before ``prepare``); the KDE control variate needs it at every
    anchor, the one-sample direction is recomputed per item in the loss from ``q.old_velocity``.
    """
    needs = StepNeeds.VELOCITY
    if cfg.kl_coef > 0:
        needs |= StepNeeds.REF_VELOCITY
    rule = cfg.weight_rule
    coef = {"flow_grpo": ("c_v", "std"), "tempflow": ("c_v", "std"), "grpo_guard": ("c_v", "t_next")}.get(rule, ())
    if cfg.kl_coef > 0 and cfg.kl_mode in ("girsanov", "gaussian_step", "exact", "flow_grpo_legacy"):
        coef = tuple(dict.fromkeys(coef + ("c_v", "std", "t_next")))
    if cfg.xt_source == "trajectory":
        prep = ("advantages", "x_t", "t", "x0", "old_velocity", "group_ids")
        if cfg.estimator == "stochastic":
            prep = prep + ("x_next", "c_x", "c_v", "std")
        loss = ("advantages", "t", "old_velocity", "value_direction") + coef
    else:
        needs |= StepNeeds.OLD_VELOCITY_FRESH
        prep = ("advantages", "x_t", "x0", "t")
        if cfg.estimator == "kde":
            prep = prep + ("group_ids", "old_velocity")
        loss = ("advantages", "x_t", "x0", "t", "value_direction") + coef
    return needs, tuple(dict.fromkeys(prep)), tuple(dict.fromkeys(loss))


# Static declaration for the engine (workers/step_loss.py fills exactly these StepBatch fields and checks
# them before the loss): the union over every config of fields a rollout always provides, so one registered
# name serves all presets. Config-precise lists: PathSpaceLossSpec.batch_keys_for / path_space_requirements.
PATH_SPACE_BATCH_KEYS = ("advantages", "x_t", "t", "t_next", "x_next", "c_x", "c_v", "std", "x0",
                         "old_velocity", "group_ids", "value_direction")


def _forward_state(batch: StepBatch) -> torch.Tensor:
    """x_t = (1−t)·x0 + t·ε (docs/algorithms.md §0.1), or the stored x_t when the engine already filled it."""
    if batch.x_t is not None:
        return batch.x_t
    tb = _bcast(batch.t, batch.x0)
    return (1 - tb) * batch.x0 + tb * batch.noise


def _anchor_advantages(batch: StepBatch, cfg: PathSpaceConfig) -> torch.Tensor:
    a = batch.step_advantages if (cfg.weight_rule == "tempflow" and batch.step_advantages is not None) \
        else batch.advantages
    return transform_advantages(cfg.advantage_transform, a, adv_clip_max=cfg.adv_clip_max,
                                awm_scale=cfg.awm_adv_scale)


def compute_value_direction(batch: StepBatch, cfg: PathSpaceConfig,
                            old_velocity: Optional[torch.Tensor] = None) -> torch.Tensor:
    """ĝ [B, *] of ``cfg.estimator`` for the items of ``batch`` (docs/algorithms.md §7.4); θ-independent."""
    a = _anchor_advantages(batch, cfg)
    v_old = batch.old_velocity if old_velocity is None else old_velocity
    if cfg.xt_source == "trajectory":
        x_t = batch.x_t
    else:
        x_t = _forward_state(batch)
    if cfg.estimator == "stochastic":
        z = step_noise(x_t, batch.x_next, v_old, batch.c_x, batch.c_v, batch.std)
        return stochastic_direction(a, z)
    if cfg.estimator == "deterministic":
        if cfg.xt_source == "forward_noising" and batch.noise is not None:
            v = batch.noise - batch.x0  # v(x_t, x0) = ε − x0 exactly on the forward path
            return -_bcast(a.to(v.dtype), v) * (v - v_old)
        return deterministic_direction(x_t, batch.t, batch.x0, v_old, a)
    return kde_value_gradient(x_t, batch.t, batch.x0, v_old, a, batch.group_ids, bandwidth=cfg.kde_bandwidth)


def _prepare(batch: StepBatch, cfg: PathSpaceConfig, with_metrics: bool):
    _, prep_keys, _ = path_space_requirements(cfg)
    v_old = batch.old_velocity
    if cfg.xt_source == "forward_noising":
        if batch.x_t is None:
            batch.require(("x0", "noise", "t"), "path_space (prepare)")
            batch = dataclasses.replace(batch, x_t=_forward_state(batch))
        if cfg.estimator == "deterministic" and v_old is None:
            # The loss recomputes the one-sample direction from the fresh v_old; store the v_old-free part.
            v_old = torch.zeros_like(batch.x_t)
    batch.require(tuple(k for k in prep_keys if k != "old_velocity"), "path_space (prepare)")
    if v_old is None:
        batch.require(("old_velocity",), "path_space (prepare)")
    metrics: dict[str, float] = {}
    if cfg.estimator == "kde":
        a = _anchor_advantages(batch, cfg)
        g, w, mask = _kde(batch.x_t, batch.t, batch.x0, v_old, a, batch.group_ids, cfg.kde_bandwidth)
        if with_metrics:
            metrics.update(kde_weight_metrics(w, mask))
    else:
        g = compute_value_direction(batch, cfg, old_velocity=v_old)
    if with_metrics:
        metrics["actor/ps_estimator_norm"] = float(torch.sqrt(_mean_e(g.float() ** 2)).mean())
    return dataclasses.replace(batch, value_direction=g), metrics


def prepare_path_space_with_metrics(batch: StepBatch, cfg: PathSpaceConfig):
    """:func:`prepare_path_space` plus metrics of the whole step batch: ‖ĝ‖_e and, for the KDE, the weight
    entropy / max weight / effective members (one KDE pass). Returns (batch, metrics)."""
    return _prepare(batch, cfg, True)


def prepare_path_space(batch: StepBatch, cfg: PathSpaceConfig) -> StepBatch:
    """Prepare hook: ĝ for one trained step over the whole batch (complete groups), once after the rollout.

    Writes ``value_direction``; θ-independent (docs/algorithms.md §7.8 "precompute ĝ for every item"). No host syncs
    beyond the group layout; metrics: :func:`prepare_path_space_with_metrics`.
    """
    return _prepare(batch, cfg, False)[0]


def _reference_kl(q: StepQuantities, batch: StepBatch, cfg, dt: Optional[torch.Tensor]) -> torch.Tensor:
    if q.ref_velocity is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} > 0 but StepQuantities.ref_velocity is None; the engine must "
                         "compute REF_VELOCITY (LossSpec.needs_for adds it when kl_coef > 0)")
    return reference_kl(cfg.kl_mode, velocity=q.velocity, ref_velocity=q.ref_velocity, c_v=batch.c_v,
                        std=batch.std, t=batch.t, dt=dt, sampler=cfg.sampler, noise_level=cfg.noise_level)


def path_space_loss_entry(q: StepQuantities, batch: StepBatch, cfg: PathSpaceConfig) -> LossOutput:
    """Registered ``path_space`` loss: mean over items of docs/algorithms.md §7.2 ℓ (+ β_KL·KL)."""
    needs, _, keys = path_space_requirements(cfg)
    if q.velocity is None:
        raise ValueError("path_space needs StepQuantities.velocity (StepNeeds.VELOCITY)")
    forward = cfg.xt_source == "forward_noising"
    if forward:
        if q.old_velocity is None:
            raise ValueError("path_space with xt_source='forward_noising' needs the fresh no-grad v_old "
                             "(StepNeeds.OLD_VELOCITY_FRESH) in StepQuantities.old_velocity")
        v_old = q.old_velocity
        if cfg.estimator == "kde":
            batch.require(("value_direction",), "path_space")
            g = batch.value_direction
        else:  # one-sample direction: per item, from the fresh v_old
            if batch.x_t is None:
                batch.require(("x0", "noise", "t"), "path_space")
            g = compute_value_direction(batch, cfg, old_velocity=v_old)
    else:
        batch.require(keys, "path_space")
        v_old, g = batch.old_velocity, batch.value_direction
    a = _anchor_advantages(batch, cfg)
    dt = (batch.t - batch.t_next) if batch.t_next is not None else None
    if cfg.weight_rule == "family":
        w1 = w1_weight(cfg.w1_family, batch.t, a, exponent=cfg.w1_exponent, constant=cfg.w1_constant)
        w2 = w2_weight(cfg.w2_family, batch.t, exponent=cfg.w2_exponent, constant=cfg.w2_constant)
    else:
        w1, w2 = preset_weights(cfg.weight_rule, advantages=a, c_v=batch.c_v, std=batch.std, dt=dt,
                                tempflow_c=cfg.tempflow_c, nft_beta=cfg.nft_beta)
    item = path_space_item_loss(q.velocity, v_old, g, w1, w2)
    loss = item.mean()
    with torch.no_grad():
        dv = (q.velocity - v_old).float()
        metrics = {
            "actor/ps_estimator_norm": float(torch.sqrt(_mean_e(g.float() ** 2)).mean()),
            "actor/ps_w1_mean": float(w1.float().mean()),
            "actor/ps_w2_mean": float(w2.float().mean()),
            "actor/ps_dv_norm": float(torch.sqrt(_mean_e(dv ** 2)).mean()),
            "actor/ps_policy_loss": float(loss.detach()),
        }
    if cfg.kl_coef > 0:
        kl = _reference_kl(q, batch, cfg, dt)
        loss = loss + cfg.kl_coef * kl.mean()
        metrics["actor/kl"] = float(kl.detach().float().mean())
    return LossOutput(loss=loss, metrics=metrics)


_DEFAULT_NEEDS, _DEFAULT_PREP_KEYS, _DEFAULT_LOSS_KEYS = path_space_requirements(PathSpaceConfig())


@dataclass(frozen=True)
class PathSpaceLossSpec(LossSpec):
    """LossSpec whose needs and batch keys follow the config (estimator, xt_source, preset, KL mode)."""

    def needs_for(self, cfg) -> StepNeeds:
        return path_space_requirements(cfg)[0]

    def batch_keys_for(self, cfg) -> tuple[str, ...]:
        """Union of the prepare-input and loss keys for ``cfg`` (the static ``batch_keys`` is the default)."""
        _, prep, loss = path_space_requirements(cfg)
        return tuple(dict.fromkeys(prep + loss))


register_loss("path_space", needs=_DEFAULT_NEEDS & ~StepNeeds.REF_VELOCITY, batch_keys=PATH_SPACE_BATCH_KEYS,
              config=PathSpaceConfig, state_source=StateSource.TRAJECTORY,
              prepare=prepare_path_space)(path_space_loss_entry)
LOSSES["path_space"] = PathSpaceLossSpec(**{f.name: getattr(LOSSES["path_space"], f.name)
                                            for f in dataclasses.fields(LossSpec)})

# AWM and DiffusionNFT with their reference constants live in matching_losses.py (losses.load_builtin_losses loads it).
