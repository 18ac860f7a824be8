"""Metric families of a training step (``area/name``): reward, advantages, actor, timing, throughput."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch


def _flat(values: Any) -> list[float]:
    """Nested lists / tensors of numbers → flat list of floats."""
    if isinstance(values, torch.Tensor):
        return [float(x) for x in values.reshape(-1).tolist()]
    if isinstance(values, (list, tuple, np.ndarray)):
        out: list[float] = []
        for v in values:
            out.extend(_flat(v))
        return out
    try:
        return [float(values)]
    except (TypeError, ValueError):
        return []


def reduce_worker_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Worker metrics (dict of per-rank lists of per-micro-step lists) → mean per key.

    ``actor/log_ratio_abs_max`` also keeps its max and its first micro-step value (the on-policy check).
    """
    out: dict[str, float] = {}
    for k, v in metrics.items():
        vals = _flat(v)
        if not vals:
            continue
        if k.endswith("_max"):
            out[k] = float(np.max(vals))
        else:
            out[k] = float(np.mean(vals))
    if "actor/log_ratio_abs_max" in metrics:
        v = metrics["actor/log_ratio_abs_max"]
        # per-rank lists: the first micro-step of each rank
        firsts = [(_flat(r) or [0.0])[0] for r in v] if isinstance(v, list) and v and isinstance(v[0], list) \
            else _flat(v)[:1]
        out["actor/first_micro_log_ratio_abs_max"] = float(np.max(firsts)) if firsts else 0.0
    return out


def reward_metrics(rewards: torch.Tensor, group_ids: np.ndarray, components: Mapping[str, torch.Tensor],
                   failures: Mapping[str, int] | None = None,
                   details: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
    """reward/mean, std, min, max, zero_std_ratio (groups whose samples all scored the same: they carry no
    advantage), components; for each per-image ``<reward>/strict`` detail, ``reward/<reward>/strict/zero_std_ratio``
    (groups all right or all wrong: the all-correct metric gives them nothing to learn from) and
    ``reward/<reward>/strict/all_wrong_ratio``."""
    r = rewards.float()
    ids = np.asarray(group_ids)
    masks = [torch.as_tensor(ids == g) for g in np.unique(ids)]
    zero = [float(r[m].std(unbiased=False)) < 1e-8 for m in masks if int(m.sum()) > 0]
    out = {"reward/mean": float(r.mean()), "reward/std": float(r.std(unbiased=False)),
           "reward/min": float(r.min()), "reward/max": float(r.max()),
           "reward/zero_std_ratio": float(np.mean(zero)) if zero else 0.0}
    for key, v in (details or {}).items():
        if not key.endswith("/strict") or v.numel() != r.numel():
            continue
        v = v.float()
        groups = [v[m] for m in masks if int(m.sum()) > 0 and not torch.isnan(v[m]).any()]
        if groups:
            out[f"reward/{key}/zero_std_ratio"] = float(np.mean([float(g.std(unbiased=False)) < 1e-8 for g in groups]))
            out[f"reward/{key}/all_wrong_ratio"] = float(np.mean([float(g.max()) == 0.0 for g in groups]))
    for name, c in components.items():
        out[f"reward/{name}/mean"] = float(c.float().mean())
    for name, n in (failures or {}).items():
        out[f"reward/{name}/failures"] = float(n)
    return out


def group_image_std(images: torch.Tensor, group_ids: np.ndarray) -> float:
    """Within-group diversity of a rollout batch: for each group (prompt), the standard deviation of each
    pixel value across the group's images, averaged over pixels and channels, in [0, 1] units of the image
    range; then averaged over groups of two or more. 0 means every image of a group is the same (mode
    collapse). images: [B, 3, H, W] uint8 (or float in [0, 1]); group_ids: [B]."""
    x = images.detach().float()
    if not images.is_floating_point():
        x = x / 255.0
    ids = np.asarray(group_ids)
    stds = [float(x[torch.as_tensor(ids == g)].std(dim=0, unbiased=False).mean()) for g in np.unique(ids)
            if int((ids == g).sum()) >= 2]
    return float(np.mean(stds)) if stds else 0.0


def advantage_summary(adv: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    a = adv[mask.bool()].float()
    if a.numel() == 0:
        return {"advantages/mean": 0.0, "advantages/std": 0.0, "advantages/abs_max": 0.0}
    return {"advantages/mean": float(a.mean()), "advantages/std": float(a.std(unbiased=False)),
            "advantages/abs_max": float(a.abs().max())}
