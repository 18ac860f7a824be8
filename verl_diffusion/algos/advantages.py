"""Per-sample advantages for group-relative policy optimisation (docs/algorithms.md §2).

Every statistic is computed over the length-``B`` *sample* vector (the globally gathered batch), never over
a timestep-expanded ``[B, T]`` tensor; :func:`broadcast_to_steps` expands only after normalisation.
All functions are vectorised (scatter / index ops, no Python loop over samples) and pure torch.

Shapes: ``B`` samples, ``M`` reward components, ``T`` steps. ``group_ids`` is any integer labelling
(``[B]`` long); labels need not be contiguous or sorted.
"""

from __future__ import annotations

from typing import Hashable, Iterable, Optional, Sequence, Union

import torch

# Std modes of docs/algorithms.md §2.1: batch-global std (default), within-group std, no division (Dr.GRPO).
STD_MODES = ("global", "group", "none")

# DanceGRPO preset (docs/algorithms.md §2.1): group std, ddof = 1, ε_adv = 1e-8.
DANCE_GRPO_PRESET = {"std_mode": "group", "ddof": 1, "eps": 1e-8}

Weights = Optional[Union[Sequence[float], torch.Tensor]]


def _check_finite(rewards: torch.Tensor) -> None:
    """Raise one ValueError naming the first sample (and component) with a NaN/inf reward."""
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        idx = torch.nonzero(bad)[0].tolist()
        where = f"sample {idx[0]}" + (f", reward component {idx[1]}" if len(idx) > 1 else "")
        raise ValueError(
            f"non-finite reward {rewards[tuple(idx)].item()} at {where}; rewards must be finite "
            f"(a failing reward function should return its penalty value, not NaN)"
        )


def _check_std_mode(std_mode: str) -> None:
    if std_mode not in STD_MODES:
        raise ValueError(f"std_mode={std_mode!r} is unknown; choose one of {sorted(STD_MODES)}")


def _compact_groups(group_ids: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """Map arbitrary integer labels to 0..G−1.  Returns (index [B] long, G)."""
    group_ids = torch.as_tensor(group_ids)
    if group_ids.dim() != 1 or group_ids.shape[0] != n:
        raise ValueError(f"group_ids must have shape [{n}] (one id per sample) but has {tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got dtype {group_ids.dtype}; "
                         f"use group_ids_from_uids(uids)")
    uniq, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, int(uniq.numel())


def _group_mean_std(values: torch.Tensor, index: torch.Tensor, n_groups: int, ddof: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and std of ``values`` [B] (gathered back to [B]).

    Population std for ddof = 0. The std divisor is max(n_g − ddof, 1), so a singleton group has std 0
    (its numerator r − m_g is exactly 0, hence A = 0) instead of NaN.
    """
    counts = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(
        0, index, torch.ones_like(values))
    sums = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)
    mean = (sums / counts)[index]
    centred = values - mean
    sq = torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, index, centred * centred)
    std = (sq / (counts - ddof).clamp_min(1)).sqrt()[index]
    return mean, std


def _sample_std(values: torch.Tensor, ddof: int) -> torch.Tensor:
    """Std of the sample vector [B] with divisor max(B − ddof, 1)."""
    centred = values - values.mean()
    return ((centred * centred).sum() / max(values.shape[0] - ddof, 1)).sqrt()


def _as_rewards(rewards: torch.Tensor, ndim: int) -> torch.Tensor:
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != ndim:
        shape = "[B]" if ndim == 1 else "[B, M]"
        raise ValueError(f"rewards must have shape {shape} (one per sample, never per timestep) "
                         f"but has {tuple(rewards.shape)}")
    if not rewards.dtype.is_floating_point:
        rewards = rewards.to(torch.get_default_dtype())
    _check_finite(rewards)
    return rewards


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, std_mode: str = "global",
                     eps: float = 1e-4, clip: Optional[float] = 5.0, ddof: int = 0) -> torch.Tensor:
    """Group-relative advantages A_i = (r_i − m_g(i)) / (σ + ε_adv), clipped to ±clip (docs/algorithms.md §2.1).

    Args:
        rewards: [B] float, one scalar per sample (globally gathered).
        group_ids: [B] long, group label per sample (e.g. from :func:`group_ids_from_uids`).
        std_mode: ``global`` (σ over all B rewards; P-S / DiffusionNFT), ``group`` (σ_g within the group)
            or ``none`` (Dr.GRPO, no division).
        eps: ε_adv added to the std (not the variance).
        clip: A_max > 0; ``None`` (or ``inf``) disables clipping.
        ddof: std delta degrees of freedom (0 = population std, the default [choice docs/algorithms.md §9.6]).
    Returns:
        [B] advantages, same dtype as rewards. A singleton group gets 0 because it is its own mean.
    """
    _check_std_mode(std_mode)
    rewards = _as_rewards(rewards, 1)
    index, n_groups = _compact_groups(group_ids, rewards.shape[0])
    mean, group_std = _group_mean_std(rewards, index, n_groups, ddof)
    adv = rewards - mean
    if std_mode == "global":
        adv = adv / (_sample_std(rewards, ddof) + eps)
    elif std_mode == "group":
        adv = adv / (group_std + eps)
    return _clip(adv, clip)


def batch_advantages(rewards: torch.Tensor, *, eps: float = 1e-4, clip: Optional[float] = 5.0) -> torch.Tensor:
    """Mode ``batch`` (no grouping; G = 1 by design): A = (r − mean_B r)/(std_B r + ε_adv), clipped (docs/algorithms.md §2.1).

    Args: rewards [B].  Returns: [B].
    """
    rewards = _as_rewards(rewards, 1)
    return _clip((rewards - rewards.mean()) / (_sample_std(rewards, 0) + eps), clip)


def gdpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, weights: Weights = None,
                    eps: float = 1e-6, clip: Optional[float] = 5.0) -> torch.Tensor:
    """GDPO multi-reward advantages (docs/algorithms.md §2.2; used by Flow-DPPO).

    (1) per component, group-normalise with the group std (ddof 0) + ε_g; singleton groups → 0;
    (2) S = Σ_m w_m·Â^(m); (3) batch-whiten S: (S − mean_B S)/√(var_B S + 1e-8); (4) clip to ±clip.

    Args:
        rewards: [B, M] float, one column per reward component.
        group_ids: [B] long.
        weights: M weights (default all 1).
        eps: ε_g of step (1).
        clip: A_max.
    Returns: [B].
    """
    rewards = _as_rewards(rewards, 2)
    w = _weights(weights, rewards)
    index, n_groups = _compact_groups(group_ids, rewards.shape[0])
    # Vectorise over components by transposing to [M, B] and offsetting group ids per component.
    n, m = rewards.shape
    flat_index = (index.unsqueeze(0) + n_groups * torch.arange(m, device=index.device).unsqueeze(1)).reshape(-1)
    flat = rewards.t().reshape(-1)
    mean, std = _group_mean_std(flat, flat_index, n_groups * m, 0)
    norm = ((flat - mean) / (std + eps)).reshape(m, n).t()  # [B, M]
    s = norm @ w  # [B]
    centred = s - s.mean()
    adv = centred / ((centred * centred).mean() + 1e-8).sqrt()
    return _clip(adv, clip)


def sum_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, weights: Weights = None,
                   **group_kwargs) -> torch.Tensor:
    """``sum`` multi-reward mode (docs/algorithms.md §2.2): r = Σ_m w_m·r^(m), then :func:`group_advantages`.

    Args: rewards [B, M]; group_ids [B]; weights M floats (default 1); group_kwargs: std_mode, eps, clip, ddof.
    Returns: [B].
    """
    rewards = _as_rewards(rewards, 2)
    return group_advantages(rewards @ _weights(weights, rewards), group_ids, **group_kwargs)


def dance_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, clip: Optional[float] = 5.0) -> torch.Tensor:
    """DanceGRPO preset (docs/algorithms.md §2.1): group std with ddof = 1 and ε_adv = 1e-8.  [B] → [B]."""
    return group_advantages(rewards, group_ids, clip=clip, **DANCE_GRPO_PRESET)


def broadcast_to_steps(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast normalised per-sample advantages to the trained steps (docs/algorithms.md §2.1).

    Call only *after* normalisation. Args: adv [B]; mask [B, T] (bool/int/float, 1 = trained step).
    Returns: [B, T] = adv[:, None]·mask (0 at untrained steps), dtype of adv.
    """
    if adv.dim() != 1 or mask.dim() != 2 or mask.shape[0] != adv.shape[0]:
        raise ValueError(f"broadcast_to_steps expects adv [B] and mask [B, T]; got adv {tuple(adv.shape)} "
                         f"and mask {tuple(mask.shape)}")
    return adv.unsqueeze(1) * mask.to(adv.dtype)


def advantage_metrics(rewards: torch.Tensor, group_ids: torch.Tensor, adv: torch.Tensor) -> dict[str, float]:
    """Logging metrics of docs/algorithms.md §2.3 (floats, one host sync).

    Args: rewards [B] (or [B, M]: the row sum is summarised); group_ids [B]; adv [B].
    Returns: ``reward/mean``, ``reward/std`` (population), ``reward/zero_std_ratio`` (fraction of groups whose
    rewards are all equal), ``actor/adv_abs_mean`` (mean |A|).
    """
    rewards = torch.as_tensor(rewards).detach()
    if rewards.dim() == 2:
        rewards = rewards.sum(dim=1)
    rewards = rewards.to(torch.float64)
    index, n_groups = _compact_groups(group_ids, rewards.shape[0])
    dev = rewards.device
    gmax = torch.full((n_groups,), -float("inf"), dtype=rewards.dtype, device=dev).scatter_reduce(
        0, index, rewards, reduce="amax")
    gmin = torch.full((n_groups,), float("inf"), dtype=rewards.dtype, device=dev).scatter_reduce(
        0, index, rewards, reduce="amin")
    vals = torch.stack([
        rewards.mean(),
        _sample_std(rewards, 0),
        (gmax == gmin).to(rewards.dtype).mean(),
        adv.detach().to(rewards.dtype).abs().mean(),
    ]).tolist()
    return {"reward/mean": vals[0], "reward/std": vals[1], "reward/zero_std_ratio": vals[2],
            "actor/adv_abs_mean": vals[3]}


def group_ids_from_uids(uids: Iterable[Hashable]) -> torch.Tensor:
    """Integer group ids (first-appearance order) from per-sample uids (str / int / numpy objects).

    Returns: [B] long.
    """
    table: dict = {}
    ids = [table.setdefault(u, len(table)) for u in uids]
    return torch.tensor(ids, dtype=torch.long)


def _weights(weights: Weights, rewards: torch.Tensor) -> torch.Tensor:
    m = rewards.shape[1]
    if weights is None:
        return torch.ones(m, dtype=rewards.dtype, device=rewards.device)
    w = torch.as_tensor(weights, dtype=rewards.dtype, device=rewards.device).reshape(-1)
    if w.shape[0] != m:
        raise ValueError(f"weights has {w.shape[0]} entries but rewards has {m} components (shape [B, M])")
    return w


def _clip(adv: torch.Tensor, clip: Optional[float]) -> torch.Tensor:
    if clip is None or clip == float("inf"):
        return adv
    if not clip > 0:
        raise ValueError(f"clip={clip!r} is invalid; pass A_max > 0 (default 5.0), or None to disable clipping")
    return adv.clamp(-clip, clip)


# ----------------------------------------------------------------------------------------------------
# TempFlow-GRPO process advantages (docs/algorithms.md §3.3)
# ----------------------------------------------------------------------------------------------------


def _branch_groups(prompt_ids: torch.Tensor, branch_step: torch.Tensor, n: int) -> torch.Tensor:
    """One integer group id per sample for the pair (prompt, branch step k).  [B] long."""
    p_idx, _ = _compact_groups(prompt_ids, n)
    k_idx, n_k = _compact_groups(branch_step, n)
    return p_idx * n_k + k_idx


def process_advantages(rewards: torch.Tensor, prompt_ids: Optional[torch.Tensor] = None,
                       branch_step: Optional[torch.Tensor] = None, *, eps: float = 1e-4,
                       clip: Optional[float] = 5.0) -> torch.Tensor:
    """TempFlow-GRPO process (per-step) advantages, normalised within (prompt, k) across children (docs/algorithms.md §3.3).

    A = (r − mean_children r) / (std_children r + ε_adv), std over the K_b children of one (prompt, branch
    step k) only (ddof 0); a single child gets 0 (it is its own mean); clipped to ±clip.

    Two layouts:
      * dense: ``rewards`` [P, K_b, S] (prompt, child, branch step; S = number of branch steps) and no ids;
        statistics over dim 1. Returns [P, K_b, S].
      * flat (the rollout layout of :func:`verl_diffusion.rollout.branched.generate_branched`): ``rewards``
        [B], ``prompt_ids`` [B] and ``branch_step`` [B] (integer labels); a group is a (prompt, k) pair,
        rows need not be sorted. Returns [B].
    Args: eps: ε_adv added to the std.  clip: A_max (None disables).
    """
    if prompt_ids is None and branch_step is None:
        rewards = torch.as_tensor(rewards)
        if rewards.dim() != 3:
            raise ValueError(f"process_advantages: dense rewards must have shape [P, K_b, S] but have "
                             f"{tuple(rewards.shape)}; for the flat layout pass prompt_ids and branch_step")
        if not rewards.dtype.is_floating_point:
            rewards = rewards.to(torch.get_default_dtype())
        _check_finite(rewards.reshape(-1))
        centred = rewards - rewards.mean(dim=1, keepdim=True)
        std = (centred * centred).mean(dim=1, keepdim=True).sqrt()
        return _clip(centred / (std + eps), clip)
    if prompt_ids is None or branch_step is None:
        raise ValueError("process_advantages: pass both prompt_ids and branch_step (flat layout) or neither "
                         "(dense [P, K_b, S] layout)")
    rewards = _as_rewards(rewards, 1)
    groups = _branch_groups(torch.as_tensor(prompt_ids), torch.as_tensor(branch_step), rewards.shape[0])
    return group_advantages(rewards, groups, std_mode="group", eps=eps, clip=clip, ddof=0)


def branched_step_advantages(rewards: torch.Tensor, prompt_ids: torch.Tensor, branch_step: torch.Tensor,
                             num_steps: int, *, eps: float = 1e-4, clip: Optional[float] = 5.0) -> torch.Tensor:
    """The ``step_advantages`` batch key [B, N] of a branched TempFlow rollout (docs/data_flow.md).

    Each child's process advantage (:func:`process_advantages`, flat layout) sits at its own branch step
    k = ``branch_step[i]``; every other column is 0.
    Args: rewards [B] (one per child image); prompt_ids [B]; branch_step [B] long in [0, num_steps − 1];
      num_steps: N.  Returns: [B, N], dtype of rewards (float).
    """
    branch_step = torch.as_tensor(branch_step)
    adv = process_advantages(rewards, prompt_ids, branch_step, eps=eps, clip=clip)
    if branch_step.shape != adv.shape:
        raise ValueError(f"branch_step has shape {tuple(branch_step.shape)}, expected {tuple(adv.shape)}")
    if bool(((branch_step < 0) | (branch_step >= num_steps)).any()):
        raise ValueError(f"branch_step has entries outside [0, {num_steps - 1}] (num_steps N = {num_steps})")
    out = torch.zeros((adv.shape[0], num_steps), dtype=adv.dtype, device=adv.device)
    return out.scatter_(1, branch_step.to(device=adv.device, dtype=torch.long).unsqueeze(1), adv.unsqueeze(1))
