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


def validation_gain_line(val_history: Sequence[dict]) -> Optional[str]:
    """The end-of-run line comparing the first and the last validation (same prompts and noise): the mean reward and
    every overall strict accuracy a reward reports (``val/<reward>/strict``), each with its change; None with fewer
    than two validations."""
    if len(val_history) < 2:
        return None
    first, last = val_history[0], val_history[-1]
    parts = [f"validation step {first['step']} -> {last['step']}: reward {first['val/reward_mean']:.4f} -> "
             f"{last['val/reward_mean']:.4f} ({last['val/reward_mean'] - first['val/reward_mean']:+.4f})"]
    for key in sorted(k for k in first if k.startswith("val/") and k.endswith("/strict") and k in last):
        a, b = first[key], last[key]
        parts.append(f"{key[len('val/'):]} {a:.3f} -> {b:.3f} ({100 * (b - a):+.1f} points)")
    return " | ".join(parts)


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
