"""Forward-noising matching losses with their authors' reference constants: DiffusionNFT (docs/algorithms.md §5) and
AWM (docs/algorithms.md §6), plus the time-drawing helpers the engine calls for them.

Both evaluate the network at x_t = (1−t)·x0 + t·ε with a fresh ε at a time drawn from the rollout grid
(``StateSource.FORWARD_NOISING``); they are the §7.7 presets ``nft`` / ``awm`` of the path-space family
up to the per-item factors stated in docs/algorithms.md §7.7 (tests/algos/test_matching_losses_on_cpu.py checks them).
Shapes: ``B`` items, ``*`` latent dims; reductions are per-element means (docs/algorithms.md §0.3). Pure torch + stdlib.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from verl_diffusion.algos.kl import reference_kl
from verl_diffusion.algos.checks import check_choice
from verl_diffusion.algos.loss_spec import LOSSES, LossSpec, register_loss
from verl_diffusion.algos.path_space import transform_advantages
from verl_diffusion.algos.tensor_ops import bcast as _bcast, mean_e as _mean_e
from verl_diffusion.algos.types import LossOutput, StateSource, StepBatch, StepNeeds, StepQuantities

NFT_ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
AWM_PHIS = ("uniform", "t", "t2", "ghuber")


# ---------------------------------------------------------------------------------------------------
# Time drawing (docs/algorithms.md §5.2, §6) and forward noising
# ---------------------------------------------------------------------------------------------------

def draw_nft_time_indices(num_samples: int, num_steps: int, *, fraction: float = 0.99,
                          generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """DiffusionNFT training times (docs/algorithms.md §5.2): per sample, the grid indices {0, …, N−1} in an independent
    random order, first ⌊fraction·N⌋ kept (at least 1).  Returns LongTensor [num_samples, ⌊fraction·N⌋];
    use ``sigmas[idx]`` for the times."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be ≥ 1")
    k = max(1, int(math.floor(fraction * num_steps + 1e-9)))
    keys = torch.rand(num_samples, num_steps, generator=generator)
    return torch.argsort(keys, dim=1)[:, :k]


def draw_awm_time_indices(num_steps: int, num_train_times: int, *, fraction: float = 1.0,
                          generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """AWM stratified training times (docs/algorithms.md §6): split the indices {1, …, ⌊N·f⌋} into ``num_train_times``
    equal strata and draw one index uniformly per stratum (share the result across the micro-batch).
    Returns LongTensor [num_train_times], increasing."""
    m = int(math.floor(num_steps * fraction + 1e-9))
    if not 1 <= num_train_times <= m:
        raise ValueError(f"num_train_times={num_train_times} must be in [1, ⌊N·f⌋ = {m}] (N={num_steps}, f={fraction})")
    edges = [1 + (j * m) // num_train_times for j in range(num_train_times + 1)]   # stratum j: [e_j, e_{j+1})
    lo = torch.tensor(edges[:-1])
    width = torch.tensor(edges[1:]) - lo
    u = torch.rand(num_train_times, generator=generator)
    return lo + torch.minimum((u * width).long(), width - 1)


def forward_noise(x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """x_t = (1−t)·x0 + t·ε (docs/algorithms.md §0.1).  x0, noise [B, *]; t [B].  Returns [B, *]."""
    tb = _bcast(t, x0)
    return (1 - tb) * x0 + tb * noise


# ---------------------------------------------------------------------------------------------------
# DiffusionNFT (docs/algorithms.md §5)
# ---------------------------------------------------------------------------------------------------

def nft_advantages(advantages: torch.Tensor, *, adv_clip_max: float = 5.0, mode: str = "all") -> torch.Tensor:
    """A' of docs/algorithms.md §5.2: clamp(A, ±A_max)/A_max, then mode positive_only (A' ≥ 0) | negative_only (A' ≤ 0) |
    one_only (1[A > 0]) | binary (sign A) | all (as is).  [B] -> [B]."""
    check_choice("adv_mode", mode, NFT_ADV_MODES)
    a = transform_advantages("nft", advantages, adv_clip_max=adv_clip_max)
    if mode == "positive_only":
        return a.clamp_min(0)
    if mode == "negative_only":
        return a.clamp_max(0)
    if mode == "one_only":
        return (advantages > 0).to(a.dtype)
    if mode == "binary":
        return torch.sign(advantages).to(a.dtype)
    return a


def diffusion_nft_loss(velocity: torch.Tensor, old_velocity: torch.Tensor, x_t: torch.Tensor, t: torch.Tensor,
                       x0: torch.Tensor, advantages: torch.Tensor, *, beta: float = 1.0,
                       adv_clip_max: float = 5.0, adv_mode: str = "all"):
    """Reference DiffusionNFT policy loss per item (docs/algorithms.md §5.2), KL excluded.

    r = clamp((A'+1)/2, 0, 1); v⁺ = β·v_θ + (1−β)·v_old; v⁻ = (1+β)·v_old − β·v_θ; x̂0^± = x_t − t·v^±;
    W^± = max(mean_e|x̂0^± − x0|, 1e-5) in fp64 without grad; L^± = ‖x̂0^± − x0‖²_e / W^±;
    item = A_max·(r·L⁺ + (1−r)·L⁻)/β.

    Args: velocity (v_θ, grad) [B, *]; old_velocity (v_old, no grad) [B, *]; x_t, x0 [B, *]; t [B];
    advantages [B] (already §2.1-normalised).  Returns (item loss [B], metrics dict).
    """
    a = nft_advantages(advantages, adv_clip_max=adv_clip_max, mode=adv_mode)
    r = ((a + 1) / 2).clamp(0, 1).to(velocity.dtype)
    v_old = old_velocity.detach()
    v_pos = beta * velocity + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * velocity
    tb = _bcast(t.to(velocity.dtype), velocity)
    err_pos = x_t - tb * v_pos - x0
    err_neg = x_t - tb * v_neg - x0
    with torch.no_grad():
        w_pos = _mean_e(err_pos.double().abs()).clamp_min(1e-5)
        w_neg = _mean_e(err_neg.double().abs()).clamp_min(1e-5)
    l_pos = _mean_e(err_pos * err_pos) / w_pos.to(err_pos.dtype)
    l_neg = _mean_e(err_neg * err_neg) / w_neg.to(err_neg.dtype)
    item = adv_clip_max * (r * l_pos + (1 - r) * l_neg) / beta
    metrics = {"actor/nft_loss_pos": float(l_pos.detach().mean()), "actor/nft_loss_neg": float(l_neg.detach().mean()),
               "actor/nft_weight_pos": float(w_pos.mean()), "actor/nft_weight_neg": float(w_neg.mean()),
               "actor/nft_r_mean": float(r.detach().mean())}
    return item, metrics


def nft_paper_loss(velocity: torch.Tensor, old_velocity: torch.Tensor, cond_velocity: torch.Tensor,
                   advantages: torch.Tensor, *, beta: float = 1.0) -> torch.Tensor:
    """Paper form L^NFT = R̂·‖v⁺ − v‖²_e + (1 − R̂)·‖v⁻ − v‖²_e, R̂ = (A + 1)/2 (docs/algorithms.md §5.3).  Returns [B]."""
    v_old = old_velocity.detach()
    r = ((advantages + 1) / 2).to(velocity.dtype)
    v_pos = beta * velocity + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * velocity
    return r * _mean_e((v_pos - cond_velocity) ** 2) + (1 - r) * _mean_e((v_neg - cond_velocity) ** 2)


@dataclass(frozen=True)
class DiffusionNFTConfig:
    """Knobs of the ``diffusion_nft`` loss (docs/algorithms.md §5, reference constants)."""

    # β_NFT: 1.0 default; 0.1 for OCR / multi-reward.
    beta: float = 1.0
    # A_max of the advantage clip; A' = clamp(A, ±A_max)/A_max and the loss is scaled by A_max.
    adv_clip_max: float = 5.0
    # A' variant: all | positive_only | negative_only | one_only | binary.
    adv_mode: str = "all"
    # β_KL of ‖v_θ − v_ref‖²_e (v_space, docs/algorithms.md §5.2).
    kl_coef: float = 1e-4
    # Fraction of the grid times trained per sample (docs/algorithms.md §5.2): first ⌊0.99·N⌋ of a random order.
    time_fraction: float = 0.99
    xt_source: str = "forward_noising"

    def __post_init__(self):
        check_choice("adv_mode", self.adv_mode, NFT_ADV_MODES)
        if self.beta <= 0 or self.adv_clip_max <= 0:
            raise ValueError(f"beta={self.beta} and adv_clip_max={self.adv_clip_max} must be > 0")
        if self.xt_source != "forward_noising":
            raise ValueError("diffusion_nft trains on forward-noised states; xt_source must be 'forward_noising'")


def _add_v_space_kl(loss: torch.Tensor, metrics: dict, q: StepQuantities, kl_coef: float,
                    loss_name: str) -> torch.Tensor:
    """loss + β_KL·mean‖v_θ − v_ref‖²_e (docs/algorithms.md §5.2, §6) when β_KL > 0; logs ``actor/kl``."""
    if kl_coef <= 0:
        return loss
    if q.ref_velocity is None:
        raise ValueError(f"{loss_name}: kl_coef={kl_coef} > 0 but StepQuantities.ref_velocity is None; "
                         "the engine must compute REF_VELOCITY (LossSpec.needs_for adds it when kl_coef > 0)")
    kl = reference_kl("v_space", velocity=q.velocity, ref_velocity=q.ref_velocity)
    metrics["actor/kl"] = float(kl.detach().float().mean())
    return loss + kl_coef * kl.mean()


def _state(batch: StepBatch) -> torch.Tensor:
    return batch.x_t if batch.x_t is not None else forward_noise(batch.x0, batch.t, batch.noise)


@register_loss("diffusion_nft", needs=StepNeeds.VELOCITY | StepNeeds.OLD_VELOCITY_FRESH,
               batch_keys=("advantages", "x0", "noise", "t"), config=DiffusionNFTConfig,
               state_source=StateSource.FORWARD_NOISING)
def diffusion_nft_entry(q: StepQuantities, batch: StepBatch, cfg: DiffusionNFTConfig) -> LossOutput:
    """Registered ``diffusion_nft``: A_max·mean[(r·L⁺ + (1−r)·L⁻)/β] + β_KL·mean‖v_θ − v_ref‖²_e (docs/algorithms.md §5.2)."""
    batch.require(("advantages", "x0", "noise", "t"), "diffusion_nft")
    if q.velocity is None or q.old_velocity is None:
        raise ValueError("diffusion_nft needs StepQuantities.velocity and the fresh no-grad old_velocity "
                         "(StepNeeds.VELOCITY | OLD_VELOCITY_FRESH)")
    item, metrics = diffusion_nft_loss(q.velocity, q.old_velocity, _state(batch), batch.t, batch.x0,
                                       batch.advantages, beta=cfg.beta, adv_clip_max=cfg.adv_clip_max,
                                       adv_mode=cfg.adv_mode)
    loss = item.mean()
    metrics["actor/nft_policy_loss"] = float(loss.detach())
    loss = _add_v_space_kl(loss, metrics, q, cfg.kl_coef, "diffusion_nft")
    return LossOutput(loss=loss, metrics=metrics)


# ---------------------------------------------------------------------------------------------------
# AWM (docs/algorithms.md §6)
# ---------------------------------------------------------------------------------------------------

def awm_phi(m: torch.Tensor, t: torch.Tensor, *, phi: str = "uniform", ghuber_power: float = 0.25) -> torch.Tensor:
    """Time weighting φ(m, t) of AWM (docs/algorithms.md §6): uniform m | t·m | t²·m | t·((m+1e-10)^p − 1e-10^p)/p.  [B]."""
    check_choice("phi", phi, AWM_PHIS)
    t = t.to(m.dtype)
    if phi == "uniform":
        return m
    if phi == "t":
        return t * m
    if phi == "t2":
        return t * t * m
    p = ghuber_power
    return t * ((m + 1e-10) ** p - 1e-10 ** p) / p


def awm_log_prob(velocity: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, *,
                 phi: str = "uniform", ghuber_power: float = 0.25) -> torch.Tensor:
    """Surrogate log-prob ℓ^AWM = −φ(‖v − (ε − x0)‖²_e, t) (docs/algorithms.md §6).  Returns [B]."""
    m = _mean_e((velocity - (noise - x0)) ** 2)
    return -awm_phi(m, t, phi=phi, ghuber_power=ghuber_power)


def awm_loss(velocity: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
             advantages: torch.Tensor, *, old_velocity: Optional[torch.Tensor] = None, phi: str = "uniform",
             clip_range: float = 1.0, adv_clip_max: float = 5.0, adv_scale: float = 1.0,
             ghuber_power: float = 0.25):
    """AWM clipped policy loss per item (docs/algorithms.md §6), KL terms excluded.

    ρ = exp(ℓ_θ − ℓ_old); ℓ_old from ``old_velocity`` (θ_old at the identical (x_t, t, ε)) or, when None,
    ℓ_old = sg(ℓ_θ) (on-policy, ρ ≡ 1). item = max(−A''ρ, −A''·clip(ρ, 1 ± ε_c)), A'' = clamp(A)/A_max·a_max.
    Args: velocity [B, *] (grad); noise, x0 [B, *]; t, advantages [B].  Returns (item loss [B], metrics).
    """
    a = transform_advantages("awm", advantages, adv_clip_max=adv_clip_max, awm_scale=adv_scale).to(velocity.dtype)
    lp = awm_log_prob(velocity, noise, x0, t, phi=phi, ghuber_power=ghuber_power)
    if old_velocity is None:
        lp_old = lp.detach()
    else:
        with torch.no_grad():
            lp_old = awm_log_prob(old_velocity, noise, x0, t, phi=phi, ghuber_power=ghuber_power)
    ratio = torch.exp(lp - lp_old)
    item = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_range, 1 + clip_range))
    with torch.no_grad():
        metrics = {"actor/awm_ratio_mean": float(ratio.mean()),
                   "actor/awm_clipfrac": float(((ratio - 1).abs() > clip_range).float().mean()),
                   "actor/awm_match_loss": float(-lp.mean())}
    return item, metrics


@dataclass(frozen=True)
class AWMConfig:
    """Knobs of the ``awm`` loss (docs/algorithms.md §6, README defaults)."""

    # Time weighting φ: uniform | t | t2 | ghuber (p = ghuber_power).
    phi: str = "uniform"
    ghuber_power: float = 0.25
    # Ratio clip ε_c; 1.0 leaves the clip inactive (default); ~1e-5 when an EMA-KL term is used.
    clip_range: float = 1.0
    # A'' = clamp(A, ±A_max)/A_max·a_max.
    adv_clip_max: float = 5.0
    adv_scale: float = 1.0
    # β_KL of ‖v_θ − v_ref‖²_e.
    kl_coef: float = 0.003
    # Stratified time draw (docs/algorithms.md §6): T_train strata over indices {1, …, ⌊N·f⌋}.
    num_train_times: int = 1
    time_fraction: float = 1.0
    xt_source: str = "forward_noising"
    # docs/algorithms.md §6 option off_policy: ρ against θ_old at the identical (x_t, t, ε) (a no-grad forward per item in
    # prepare_steps, as DiffusionNFT's v_old). θ_old is the §8.2 KL-EMA adapter kept by the worker with
    # actor.old_policy (awm_linear / awm_constant, which also samples the rollout); with schedule none it is the
    # weights before this rollout's update (d = 0).
    off_policy: bool = False

    def __post_init__(self):
        check_choice("phi", self.phi, AWM_PHIS)
        if self.clip_range <= 0 or self.adv_clip_max <= 0:
            raise ValueError(f"clip_range={self.clip_range} and adv_clip_max={self.adv_clip_max} must be > 0")
        if self.xt_source != "forward_noising":
            raise ValueError("awm trains on forward-noised states; xt_source must be 'forward_noising'")


@register_loss("awm", needs=StepNeeds.VELOCITY, batch_keys=("advantages", "x0", "noise", "t"), config=AWMConfig,
               state_source=StateSource.FORWARD_NOISING)
def awm_entry(q: StepQuantities, batch: StepBatch, cfg: AWMConfig) -> LossOutput:
    """Registered ``awm``: mean[max(−A''ρ, −A''·clip(ρ, 1±ε_c))] + β_KL·mean‖v_θ − v_ref‖²_e (docs/algorithms.md §6).

    On-policy by default (ℓ_old = sg(ℓ_θ)); with ``off_policy=True`` the engine supplies ``q.old_velocity``
    (θ_old at the identical fresh state: the soft KL-EMA copy of ``actor.old_policy``, else the pre-update
    weights) and the ratio is off-policy against it. The β_ema term (KL-EMA adapter) is not part of this loss.
    """
    batch.require(("advantages", "x0", "noise", "t"), "awm")
    if q.velocity is None:
        raise ValueError("awm needs StepQuantities.velocity (StepNeeds.VELOCITY)")
    if cfg.off_policy and q.old_velocity is None:
        raise ValueError("awm with off_policy=True needs the fresh no-grad v_old (StepNeeds.OLD_VELOCITY_FRESH) in "
                         "StepQuantities.old_velocity; AWMLossSpec.needs_for adds it")
    item, metrics = awm_loss(q.velocity, batch.noise, batch.x0, batch.t, batch.advantages,
                             old_velocity=q.old_velocity, phi=cfg.phi, clip_range=cfg.clip_range,
                             adv_clip_max=cfg.adv_clip_max, adv_scale=cfg.adv_scale, ghuber_power=cfg.ghuber_power)
    loss = item.mean()
    metrics["actor/awm_policy_loss"] = float(loss.detach())
    loss = _add_v_space_kl(loss, metrics, q, cfg.kl_coef, "awm")
    return LossOutput(loss=loss, metrics=metrics)


class AWMLossSpec(LossSpec):
    """``awm`` spec whose needs follow the config: ``off_policy=True`` adds OLD_VELOCITY_FRESH."""

    def needs_for(self, cfg) -> StepNeeds:
        needs = super().needs_for(cfg)
        if getattr(cfg, "off_policy", False):
            needs |= StepNeeds.OLD_VELOCITY_FRESH
        return needs


LOSSES["awm"] = AWMLossSpec(**{f.name: getattr(LOSSES["awm"], f.name) for f in dataclasses.fields(LossSpec)})
