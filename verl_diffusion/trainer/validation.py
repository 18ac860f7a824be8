"""Validation images: a grid PNG per validation, a reward curve and a before/after grid at the end."""

from __future__ import annotations

import math
import os
from typing import Optional, Sequence

import numpy as np
import torch


def image_grid(images: torch.Tensor, *, cols: Optional[int] = None, pad: int = 2) -> np.ndarray:
    """uint8 [B, 3, H, W] → one uint8 HxWx3 grid (rows of ``cols`` images, white padding)."""
    b, c, h, w = images.shape
    cols = cols or min(b, max(1, int(math.ceil(math.sqrt(b)))))
    rows = int(math.ceil(b / cols))
    grid = np.full((rows * (h + pad) + pad, cols * (w + pad) + pad, 3), 255, dtype=np.uint8)
    imgs = images.permute(0, 2, 3, 1).cpu().numpy()
    for i in range(b):
        r, col = divmod(i, cols)
        y, x = pad + r * (h + pad), pad + col * (w + pad)
        grid[y:y + h, x:x + w] = imgs[i][..., :3]
    return grid


def save_grid(images: torch.Tensor, path: str, *, cols: Optional[int] = None, scale: int = 1) -> str:
    from PIL import Image

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    img = Image.fromarray(image_grid(images, cols=cols))
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    img.save(path)
    return path


def save_before_after(before: torch.Tensor, after: torch.Tensor, path: str, *, scale: int = 2,
                      labels: Sequence[str] = ("before", "after"), cols: int = 16) -> str:
    """Validation images before training above the same prompts and seeds after it.

    The images are cut into chunks of ``cols``; each chunk is a "before" row directly above its "after" row (so a
    person compares each image with the one under it, also for the 96 prompts of the shapes run), chunks separated
    by a white band. Each row is labelled on a white left margin so the picture reads on its own.
    """
    from PIL import Image, ImageDraw

    n = before.shape[0]
    chunks = [(i, min(i + cols, n)) for i in range(0, n, cols)] or [(0, 0)]
    rows = []
    for k, (a, b) in enumerate(chunks):
        for imgs, text in zip((before[a:b], after[a:b]), labels):
            rows.append((image_grid(imgs, cols=max(1, b - a)) if b > a else np.full((1, 1, 3), 255, np.uint8),
                         text, k > 0 and text == labels[0]))
    width = max(r.shape[1] for r, _, _ in rows)
    gap = 6  # output pixels between chunks
    margin = 7 * max(len(t) for t in labels) + 10  # output pixels: PIL's default font is ~6 px a character
    height = sum(r.shape[0] * scale + (gap if new_chunk else 0) for r, _, new_chunk in rows)
    canvas = Image.new("RGB", (width * scale + margin, height), "white")
    draw = ImageDraw.Draw(canvas)
    y = 0
    for grid, text, new_chunk in rows:
        y += gap if new_chunk else 0
        img = Image.fromarray(grid)
        if scale > 1:
            img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
        canvas.paste(img, (margin, y))
        draw.text((4, y + img.height // 2 - 6), text, fill=(0, 0, 0))
        y += img.height
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    canvas.save(path)
    return path


def write_validation_scores(path: str, prompts: Sequence[str], seeds: Sequence[int], scores: torch.Tensor,
                            details: dict) -> str:
    """One JSON line per validation image, in the grid's order: prompt, noise seed, reward and every per-image detail
    the reward reports (e.g. ``shapes/strict``; NaN, "not applicable", becomes null). Written whole or not at all."""
    import json

    cols = {k: v.float().tolist() for k, v in details.items()}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
            row = {"prompt": prompt, "seed": int(seed), "reward": float(scores[i])}
            row.update({k: (None if math.isnan(v[i]) else v[i]) for k, v in cols.items()})
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)
    return path


def paired_standard_error(before: Sequence[float], after: Sequence[float]) -> Optional[float]:
    """Standard error of a validation gain, mean(after − before), when both validations scored the same images'
    prompts and noise: sd_i(after_i − before_i) / sqrt(n) (sample sd, n − 1). It measures how far the gain on these
    n draws can sit from the gain on the whole held-out distribution for this one trained model; the spread between
    training seeds comes on top. Pairs with a NaN (an image whose reward failed) are left out. None when the two lists
    differ in length or fewer than 2 pairs remain."""
    if len(before) != len(after):
        return None
    d = np.asarray(after, dtype=np.float64) - np.asarray(before, dtype=np.float64)
    d = d[np.isfinite(d)]
    return float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) >= 2 else None


def validation_gain_line(val_history: Sequence[dict]) -> Optional[str]:
    """The end-of-run line comparing the first and the last validation (same prompts and noise): the mean reward and
    every overall strict accuracy a reward reports (``val/<reward>/strict``), each with its change, and its paired
    standard error (:func:`paired_standard_error`) where both validations carry per-image values
    (``per_image[key]``); None with fewer than two validations."""
    if len(val_history) < 2:
        return None
    first, last = val_history[0], val_history[-1]

    pa, pb = first.get("per_image") or {}, last.get("per_image") or {}

    def se(key: str) -> Optional[float]:
        return paired_standard_error(pa[key], pb[key]) if key in pa and key in pb else None

    r0, r1, s = first["val/reward_mean"], last["val/reward_mean"], se("val/reward_mean")
    n_paired = len(pa["val/reward_mean"]) if s is not None else 0
    pm = "" if s is None else f" ± {s:.4f}"
    parts = [f"validation step {first['step']} -> {last['step']}: reward {r0:.4f} -> {r1:.4f} ({r1 - r0:+.4f}{pm})"]
    for key in sorted(k for k in first if k.startswith("val/") and k.endswith("/strict") and k in last):
        a, b, s = first[key], last[key], se(key)
        pm = "" if s is None else f" ± {100 * s:.1f}"
        parts.append(f"{key[len('val/'):]} {a:.3f} -> {b:.3f} ({100 * (b - a):+.1f}{pm} points)")
    line = " | ".join(parts)
    return line + (f" (± paired standard error over the {n_paired} validation images)" if n_paired else "")


def save_reward_curve(steps: Sequence[int], rewards: Sequence[float], path: str, *,
                      val_steps: Sequence[int] = (), val_rewards: Sequence[float] = (),
                      val_accuracy: Sequence[float] = (), accuracy_label: str = "validation strict accuracy") -> str:
    """Train reward per step and validation reward per validation; with ``val_accuracy`` (one per validation
    step, e.g. the shapes reward's strict accuracy) a second axis in [0, 1] on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(list(steps), list(rewards), marker="o", ms=3, label="train reward (mean)")
    if len(val_steps):
        ax.plot(list(val_steps), list(val_rewards), marker="s", ms=4, label="validation reward (ODE)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if len(val_accuracy):
        ax2 = ax.twinx()
        ax2.plot(list(val_steps), list(val_accuracy), marker="D", ms=4, color="tab:green", label=accuracy_label)
        ax2.set_ylabel("strict accuracy")
        ax2.set_ylim(0.0, 1.0)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def log_images(tracker, key: str, images: torch.Tensor, step: int) -> list[str]:
    """Send a validation grid to the image-capable backends of verl's ``Tracking`` (wandb, tensorboard).

    Returns the backends that received it (console / file trackers take scalars only).
    """
    loggers = getattr(tracker, "logger", {}) or {}
    grid = image_grid(images)
    sent = []
    if "wandb" in loggers:
        import wandb

        wandb.log({key: wandb.Image(grid)}, step=step)
        sent.append("wandb")
    if "tensorboard" in loggers:
        loggers["tensorboard"].writer.add_image(key, grid, step, dataformats="HWC")
        sent.append("tensorboard")
    return sent
