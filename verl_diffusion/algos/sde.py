"""The shared SDE kernel: grid, sampler coefficients, Gaussian step, log-prob and KL (docs/algorithms.md §1).

Every stochastic sampler is an affine-Gaussian step (docs/algorithms.md §1.2)::

    μ = c_x·x + c_v·v,        x' = μ + τ·z,  z ~ N(0, I)

so a sampler is nothing but a rule for the three per-sample scalars ``(c_x, c_v, τ)``. The rollout and the
training engine both call :func:`sampler_coefficients`, :func:`step_mean` and :func:`gaussian_log_prob`
from this module, so that the on-policy log-prob recomputed in training is bitwise the rollout's. For that
reason the functions here are deterministic and contain no Python branch on tensor *values* in the
computation itself (the only value checks raise errors, e.g. a log-prob asked for at τ = 0).

Conventions (docs/algorithms.md §0): flow time t = 1 is noise, t = 0 is data; grid t_0 = 1 > … > t_N = 0 ("sigmas");
step k maps t_k → t_{k+1}, dt = t_{k+1} − t_k < 0, Δt = −dt. Log-probs and KLs are per-element means over
the latent dims (docs/algorithms.md §0.3). Shapes: ``B`` samples, ``*`` latent dims.

Dtypes: coefficients are computed in float64 and returned in the dtype of the time tensors given
(``sigmas`` / ``t``). Means follow torch type promotion of ``x``, ``v`` and the coefficients, at least
float32; log-probs and KLs are computed in at least float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from verl_diffusion.algos.checks import check_choice

__all__ = [
    "SAMPLERS",
    "LOG_PROB_CONVENTIONS",
    "make_grid",
    "StepCoefficients",
    "flow_sde_coefficients",
    "cps_coefficients",
    "dance_coefficients",
    "ode_coefficients",
    "sampler_coefficients",
    "step_mean",
    "gaussian_log_prob",
    "StepOutput",
    "sde_step",
    "flow_sde_step",
    "cps_step",
    "dance_step",
    "ode_step",
    "gaussian_step_kl",
    "log_ratio_exact",
    "total_variation",
]

# Sampler names (docs/algorithms.md §1.3–§1.6).
SAMPLERS = ("flow_sde", "cps", "dance", "ode")
# Log-prob conventions (docs/algorithms.md §1.2 `exact`, §1.4 `unnormalized` = −‖x' − μ‖²_e).
LOG_PROB_CONVENTIONS = ("exact", "unnormalized")

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


# ----------------------------------------------------------------------------------------------------
# Grid
# ----------------------------------------------------------------------------------------------------


def make_grid(num_steps: int, shift: float = 3.0, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Shifted sampling grid t_0 = 1 > … > t_N = 0 (docs/algorithms.md §1.1).

    u_k = 1 − k/N, t_k = S·u_k / (1 + (S − 1)·u_k); S = 1 is uniform, SD3/SD3.5 use S = 3.
    Computed in float64, returned in ``dtype``. Model-specific grids may be passed explicitly to
    :func:`sampler_coefficients` instead.

    Args: num_steps: N ≥ 1.  shift: S > 0.
    Returns: sigmas [N+1], sigmas[0] = 1 and sigmas[N] = 0 exactly.
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps={num_steps!r} is invalid; pass an int >= 1 (number of sampling steps N)")
    if not (float(shift) > 0.0 and math.isfinite(float(shift))):
        raise ValueError(f"shift={shift!r} is invalid; pass a finite float > 0 (SD3: 3.0, uniform grid: 1.0)")
    u = 1.0 - torch.arange(num_steps + 1, dtype=torch.float64) / num_steps
    s = float(shift)
    t = s * u / (1.0 + (s - 1.0) * u)
    return t.to(dtype)


# ----------------------------------------------------------------------------------------------------
# Coefficients
# ----------------------------------------------------------------------------------------------------


@dataclass
class StepCoefficients:
    """Per-sample coefficients of one affine-Gaussian step (docs/algorithms.md §1.2): μ = c_x·x + c_v·v, std τ.

    Each field is [B] (or a 0-dim tensor for one shared step), same dtype.
    """

    c_x: torch.Tensor
    c_v: torch.Tensor
    std: torch.Tensor


TensorLike = Union[torch.Tensor, float]


def _f64(t: TensorLike) -> torch.Tensor:
    # Straight to float64: ``torch.as_tensor(0.9)`` would round a Python float through float32 first
    # (the default dtype), and 1 − t_sub would then miss Δt (std 0.69999992 instead of 0.7 at t = 1).
    return torch.as_tensor(t, dtype=torch.float64)


def _out_dtype(t: TensorLike) -> torch.dtype:
    return t.dtype if isinstance(t, torch.Tensor) and t.is_floating_point() else torch.float32


def _check_noise_level(name: str, value: float, upper: Optional[float] = None) -> float:
    try:
        a = float(value)
    except (TypeError, ValueError):
        a = float("nan")
    ok = math.isfinite(a) and a >= 0.0 and (upper is None or a <= upper)
    if not ok:
        rng = f"[0, {upper}]" if upper is not None else ">= 0"
        raise ValueError(f"{name}={value!r} is invalid; pass a plain float in {rng}")
    return a


def _coefficients_from_g(t: torch.Tensor, dt: torch.Tensor, g: torch.Tensor) -> tuple:
    """Flow-SDE-form step with diffusion g (docs/algorithms.md §1.3 / §1.5), all float64: (c_x, c_v, τ)."""
    g2 = g * g
    c_x = 1.0 + g2 * dt / (2.0 * t)
    c_v = (1.0 + g2 * (1.0 - t) / (2.0 * t)) * dt
    std = g * torch.sqrt(-dt)
    return c_x, c_v, std


def flow_sde_coefficients(t: TensorLike, t_next: TensorLike, *, noise_level: float,
                          t_sub: TensorLike) -> StepCoefficients:
    """Flow-SDE (Flow-GRPO) coefficients (docs/algorithms.md §1.3; Liu et al. 2025, arXiv 2505.05470).

    g = a·√(t / (1 − t̃)) with t̃ = t if t < 1 else ``t_sub`` (σ = 1 substitution: only the denominator);
    c_x = 1 + g²·dt/(2t), c_v = (1 + g²·(1 − t)/(2t))·dt, τ = g·√Δt. At t = 1: c_x = 1 − a²/2, c_v = dt,
    τ = a. a = 0 gives the Euler ODE step.

    Args: t, t_next: [B] (or 0-dim) times of the step, t > t_next.  noise_level: a ≥ 0.
      t_sub: the grid's t_1 (float or [B]), used in place of t in the denominator where t = 1.
    Returns: StepCoefficients, [B] each, in t's dtype (float64 internally).
    """
    a = _check_noise_level("noise_level", noise_level)
    t64, tn64 = _f64(t), _f64(t_next)
    dt = tn64 - t64
    t_tilde = torch.where(t64 < 1.0, t64, _f64(t_sub))
    g = a * torch.sqrt(t64 / (1.0 - t_tilde))
    c_x, c_v, std = _coefficients_from_g(t64, dt, g)
    out = _out_dtype(t)
    return StepCoefficients(c_x.to(out), c_v.to(out), std.to(out))


def cps_coefficients(t: TensorLike, t_next: TensorLike, *, noise_level: float) -> StepCoefficients:
    """Coefficient-preserving sampling (Flow-CPS) coefficients (docs/algorithms.md §1.4).

    τ = t'·sin(aπ/2), r = t'·cos(aπ/2) (t' = t_next); μ = (1 − t')·x̂0 + r·x̂1 with x̂0 = x − t·v,
    x̂1 = x + (1 − t)·v, i.e. c_x = (1 − t') + r, c_v = −t·(1 − t') + r·(1 − t). The last step (t' = 0)
    has τ = 0; a = 0 gives the Euler ODE step.

    Args: t, t_next: [B] (or 0-dim).  noise_level: a ∈ [0, 1].
    Returns: StepCoefficients, [B] each, in t's dtype (float64 internally).
    """
    a = _check_noise_level("noise_level", noise_level, upper=1.0)
    t64, tn64 = _f64(t), _f64(t_next)
    std = tn64 * math.sin(a * math.pi / 2.0)
    r = tn64 * math.cos(a * math.pi / 2.0)
    c_x = (1.0 - tn64) + r
    c_v = -t64 * (1.0 - tn64) + r * (1.0 - t64)
    out = _out_dtype(t)
    return StepCoefficients(c_x.to(out), c_v.to(out), std.to(out))


def dance_coefficients(t: TensorLike, t_next: TensorLike, *, noise_level: float) -> StepCoefficients:
    """Dance-SDE (DanceGRPO) coefficients (docs/algorithms.md §1.5): Flow-SDE form with constant g = η_D.

    c_x = 1 + η_D²·dt/(2t), c_v = (1 + η_D²·(1 − t)/(2t))·dt, τ = η_D·√Δt. η_D = 0 gives Euler.

    Args: t, t_next: [B] (or 0-dim), t > 0.  noise_level: η_D ≥ 0 (default in presets 0.3).
    Returns: StepCoefficients, [B] each, in t's dtype (float64 internally).
    """
    eta = _check_noise_level("noise_level", noise_level)
    t64, tn64 = _f64(t), _f64(t_next)
    dt = tn64 - t64
    g = torch.full_like(t64, eta)
    c_x, c_v, std = _coefficients_from_g(t64, dt, g)
    out = _out_dtype(t)
    return StepCoefficients(c_x.to(out), c_v.to(out), std.to(out))


def ode_coefficients(t: TensorLike, t_next: TensorLike) -> StepCoefficients:
    """Euler ODE step (docs/algorithms.md §1.6): c_x = 1, c_v = dt, τ = 0 (no log-prob).

    Args: t, t_next: [B] (or 0-dim).
    Returns: StepCoefficients, [B] each, in t's dtype.
    """
    t64, tn64 = _f64(t), _f64(t_next)
    dt = tn64 - t64
    out = _out_dtype(t)
    return StepCoefficients(torch.ones_like(dt).to(out), dt.to(out), torch.zeros_like(dt).to(out))


def sampler_coefficients(sampler: str, sigmas: torch.Tensor, step: Union[int, torch.Tensor], *,
                         noise_level: float) -> StepCoefficients:
    """Coefficients of step k (t_k → t_{k+1}) for a named sampler on a grid (docs/algorithms.md §1.2–§1.6).

    Args:
      sampler: one of :data:`SAMPLERS`.
      sigmas: grid [N+1] (shared) or [B, N+1] (per sample), t_0 = 1 > … > t_N = 0; any explicit grid.
      step: int k ∈ [0, N−1], or LongTensor [B] (one step per sample).
      noise_level: a (flow_sde, cps) or η_D (dance); ignored by ``ode``.
    Returns: StepCoefficients in sigmas' dtype (computed in float64): [B] each, or 0-dim when sigmas is
      [N+1] and step is an int. Flow-SDE's σ = 1 substitution uses the grid's own t_1.
    """
    check_choice("sampler", sampler, SAMPLERS)
    if sigmas.dim() not in (1, 2) or sigmas.shape[-1] < 2:
        raise ValueError(f"sigmas.shape={tuple(sigmas.shape)} is invalid; pass [N+1] or [B, N+1] with N >= 1")
    n = sigmas.shape[-1] - 1
    if isinstance(step, torch.Tensor):
        idx = step.to(device=sigmas.device, dtype=torch.long)
        if sigmas.dim() == 1:
            t, t_next, t_sub = sigmas[idx], sigmas[idx + 1], sigmas[1].expand(idx.shape)
        else:
            t = sigmas.gather(1, idx.view(-1, 1)).squeeze(1)
            t_next = sigmas.gather(1, (idx + 1).view(-1, 1)).squeeze(1)
            t_sub = sigmas[:, 1]
    else:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < n:
            raise ValueError(f"step={step!r} is invalid; pass an int in [0, {n - 1}] (N = {n} steps)")
        t, t_next, t_sub = sigmas[..., step], sigmas[..., step + 1], sigmas[..., 1]
    if sampler == "flow_sde":
        return flow_sde_coefficients(t, t_next, noise_level=noise_level, t_sub=t_sub)
    if sampler == "cps":
        return cps_coefficients(t, t_next, noise_level=noise_level)
    if sampler == "dance":
        return dance_coefficients(t, t_next, noise_level=noise_level)
    return ode_coefficients(t, t_next)


# ----------------------------------------------------------------------------------------------------
# Mean, log-prob, step
# ----------------------------------------------------------------------------------------------------


def _per_sample(c: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape a [B] (or 0-dim) per-sample scalar to broadcast over ``like`` [B, *]."""
    if c.dim() == 0:
        return c
    return c.reshape(c.shape[0], *([1] * (like.dim() - 1)))


def _mean_e(u: torch.Tensor) -> torch.Tensor:
    """Per-element mean over all non-batch dims: [B, *] -> [B]."""
    return u.flatten(1).mean(dim=1)


def _work_dtype(*ts: torch.Tensor) -> torch.dtype:
    dt = torch.float32
    for t in ts:
        dt = torch.promote_types(dt, t.dtype)
    return dt


def step_mean(x: torch.Tensor, v: torch.Tensor, coef: StepCoefficients) -> torch.Tensor:
    """Mean of the step, μ = c_x·x + c_v·v (docs/algorithms.md §1.2).

    Args: x, v: [B, *].  coef: [B] (or 0-dim) each, broadcast over the latent dims.
    Returns: μ [B, *] in the promoted dtype of x, v and the coefficients, at least float32 (docs/algorithms.md §0.5; also
      for 0-dim coefficients, which torch promotion would otherwise let bf16 latents override).
    """
    wd = _work_dtype(x, v, coef.c_x, coef.c_v)
    return _per_sample(coef.c_x.to(wd), x) * x.to(wd) + _per_sample(coef.c_v.to(wd), v) * v.to(wd)


def _check_convention(convention: str) -> None:
    check_choice("convention", convention, LOG_PROB_CONVENTIONS)


def _log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, convention: str) -> torch.Tensor:
    """Unchecked per-element-mean log-prob; std must be > 0 for ``exact``. [B]."""
    wd = _work_dtype(x_next, mean, std)
    sq = _mean_e((x_next.to(wd) - mean.to(wd)) ** 2)
    if convention == "unnormalized":
        return -sq
    s = std.to(wd)
    return -sq / (2.0 * s * s) - torch.log(s) - _HALF_LOG_2PI


def _refuse_zero_std(std: torch.Tensor, what: str) -> None:
    if bool((std <= 0).any()):
        raise ValueError(
            f"{what}: std contains {int((std <= 0).sum())} entries <= 0 (ODE step, last CPS step or "
            f"noise_level=0); the step is deterministic and has no log-prob. Train only steps with std > 0 "
            f"(SDE window, train_mask)."
        )


def gaussian_log_prob(x_next: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, *,
                      convention: str = "exact") -> torch.Tensor:
    """Log-prob of x' under N(μ, τ²I), per-element mean (docs/algorithms.md §1.2, §1.4).

    exact: ℓ = −‖x' − μ‖²_e/(2τ²) − log τ − ½·log(2π).  unnormalized: ℓ^u = −‖x' − μ‖²_e.
    Refuses τ ≤ 0 (ODE step, last CPS step, a = 0) with a ValueError for both conventions.

    Args: x_next, mean: [B, *].  std: [B] (or 0-dim).  convention: one of LOG_PROB_CONVENTIONS.
    Returns: [B], dtype at least float32.
    """
    _check_convention(convention)
    _refuse_zero_std(std, "gaussian_log_prob")
    return _log_prob(x_next, mean, _per_sample_1d(std, x_next), convention)


def _per_sample_1d(std: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """std as [B] (expanding a 0-dim std to the batch)."""
    return std.expand(like.shape[0]) if std.dim() == 0 else std


@dataclass
class StepOutput:
    """Result of one sampler step (docs/algorithms.md §1.2).

    next_x: x' [B, *].  mean: μ [B, *].  std: τ [B].  log_prob: ℓ(x' | x) [B], or None when τ = 0 for the
    whole batch (entries with τ = 0 in a mixed batch are 0 and must be masked).  noise: z [B, *] used
    (None for :func:`ode_step`).
    """

    next_x: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    log_prob: Optional[torch.Tensor]
    noise: Optional[torch.Tensor]


def sde_step(x: torch.Tensor, v: torch.Tensor, coef: StepCoefficients, *, noise: Optional[torch.Tensor] = None,
             generator: Optional[torch.Generator] = None, convention: str = "exact") -> StepOutput:
    """One affine-Gaussian step x' = μ + τ·z and its log-prob (docs/algorithms.md §1.2).

    Draws z ~ N(0, I) with ``generator`` (shape and dtype of x) unless ``noise`` is given; z is always drawn
    (even where τ = 0), so the RNG stream does not depend on coefficient values. The log-prob uses exactly
    the computation of :func:`gaussian_log_prob`, so recomputing it in training is bitwise identical.

    Args: x, v: [B, *].  coef: [B] (or 0-dim) each.  noise: z [B, *] or None.  convention: see
      LOG_PROB_CONVENTIONS.
    Returns: StepOutput (log_prob None when τ = 0 for every sample).
    """
    _check_convention(convention)
    mean = step_mean(x, v, coef)
    if noise is None:
        noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
    std = _per_sample_1d(coef.std, x)
    next_x = mean + _per_sample(std, mean) * noise
    positive = std > 0
    if not bool(positive.any()):
        log_prob = None
    else:
        safe_std = torch.where(positive, std, torch.ones_like(std))
        lp = _log_prob(next_x, mean, safe_std, convention)
        log_prob = torch.where(positive, lp, torch.zeros_like(lp))
    return StepOutput(next_x=next_x, mean=mean, std=std, log_prob=log_prob, noise=noise)


def flow_sde_step(x: torch.Tensor, v: torch.Tensor, t: TensorLike, t_next: TensorLike, *, noise_level: float,
                  t_sub: TensorLike, noise: Optional[torch.Tensor] = None,
                  generator: Optional[torch.Generator] = None, convention: str = "exact") -> StepOutput:
    """Flow-SDE step (docs/algorithms.md §1.3): :func:`flow_sde_coefficients` + :func:`sde_step`. t, t_next: [B] or 0-dim."""
    coef = flow_sde_coefficients(t, t_next, noise_level=noise_level, t_sub=t_sub)
    return sde_step(x, v, coef, noise=noise, generator=generator, convention=convention)


def cps_step(x: torch.Tensor, v: torch.Tensor, t: TensorLike, t_next: TensorLike, *, noise_level: float,
             noise: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
             convention: str = "exact") -> StepOutput:
    """CPS step (docs/algorithms.md §1.4): :func:`cps_coefficients` + :func:`sde_step`. t, t_next: [B] or 0-dim."""
    coef = cps_coefficients(t, t_next, noise_level=noise_level)
    return sde_step(x, v, coef, noise=noise, generator=generator, convention=convention)


def dance_step(x: torch.Tensor, v: torch.Tensor, t: TensorLike, t_next: TensorLike, *, noise_level: float,
               noise: Optional[torch.Tensor] = None, generator: Optional[torch.Generator] = None,
               convention: str = "exact") -> StepOutput:
    """Dance-SDE step (docs/algorithms.md §1.5): :func:`dance_coefficients` + :func:`sde_step`. t, t_next: [B] or 0-dim."""
    coef = dance_coefficients(t, t_next, noise_level=noise_level)
    return sde_step(x, v, coef, noise=noise, generator=generator, convention=convention)


def ode_step(x: torch.Tensor, v: torch.Tensor, t: TensorLike, t_next: TensorLike) -> StepOutput:
    """Euler ODE step x' = x + v·dt (docs/algorithms.md §1.6); draws no noise, log_prob None, std zeros [B]."""
    coef = ode_coefficients(t, t_next)
    mean = step_mean(x, v, coef)
    return StepOutput(next_x=mean, mean=mean, std=_per_sample_1d(coef.std, x), log_prob=None, noise=None)


# ----------------------------------------------------------------------------------------------------
# KL, log-ratio, TV
# ----------------------------------------------------------------------------------------------------


def gaussian_step_kl(mean_a: torch.Tensor, mean_b: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Exact per-step KL between N(μ_a, τ²I) and N(μ_b, τ²I), per element: ‖μ_a − μ_b‖²_e/(2τ²) (docs/algorithms.md §1.2).

    Symmetric in a, b. With μ = c_x·x + c_v·v at the same x: D = (c_v)²·‖Δv‖²_e/(2τ²).
    Refuses τ ≤ 0.

    Args: mean_a, mean_b: [B, *].  std: [B] (or 0-dim).
    Returns: D [B], dtype at least float32.
    """
    _refuse_zero_std(std, "gaussian_step_kl")
    std = _per_sample_1d(std, mean_a)
    wd = _work_dtype(mean_a, mean_b, std)
    s = std.to(wd)
    return _mean_e((mean_a.to(wd) - mean_b.to(wd)) ** 2) / (2.0 * s * s)


def log_ratio_exact(x_next: torch.Tensor, mean: torch.Tensor, old_mean: torch.Tensor,
                    std: torch.Tensor) -> torch.Tensor:
    """Exact per-element log-ratio ℓr = ℓ_θ − ℓ_old at the stored x' (docs/algorithms.md §1.2).

    ℓr = (‖x' − μ_old‖²_e − ‖x' − μ_θ‖²_e)/(2τ²) (log τ cancels) = (c_v/τ)·⟨Δv, z⟩_e − D.
    Exactly 0 when mean and old_mean are equal. Refuses τ ≤ 0.

    Args: x_next, mean (μ_θ), old_mean (μ_old): [B, *].  std: [B] (or 0-dim).
    Returns: [B], dtype at least float32.
    """
    _refuse_zero_std(std, "log_ratio_exact")
    std = _per_sample_1d(std, x_next)
    wd = _work_dtype(x_next, mean, old_mean, std)
    s = std.to(wd)
    xn = x_next.to(wd)
    return (_mean_e((xn - old_mean.to(wd)) ** 2) - _mean_e((xn - mean.to(wd)) ** 2)) / (2.0 * s * s)


def total_variation(kl: torch.Tensor, d: int) -> torch.Tensor:
    """Total variation between the two step Gaussians, for monitoring (docs/algorithms.md §1.2).

    TV = 2Φ(√(d·D/2)) − 1 = erf(√(d·D)/2), with D the per-element KL and d the latent size.

    Args: kl: D [B] (per element).  d: elements per sample.
    Returns: TV [B] in [0, 1).
    """
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d={d!r} is invalid; pass the number of latent elements per sample (int >= 1)")
    return torch.erf(torch.sqrt(kl.clamp_min(0) * d) / 2.0)
