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


def pick_examples(prompts: Sequence[str], n_max: int = 24) -> list[int]:
    """Indices of at most ``n_max`` images for a contact sheet: as many distinct prompts as fit, evenly spread over
    the set's order (a prompt file grouped by tag then yields a few prompts of every tag), each prompt's first image;
    when there are fewer distinct prompts than ``n_max``, more images (other noise seeds) fill the sheet, spread over
    the rest. Sorted so that a prompt's images sit together."""
    n = len(prompts)
    if n <= n_max:
        return list(range(n))
    first: dict[str, int] = {}
    for i, p in enumerate(prompts):
        first.setdefault(p, i)
    unique = list(first.values())

    def spread(items: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        if len(items) <= k:
            return list(items)
        return [items[int(round(j * (len(items) - 1) / (k - 1)))] if k > 1 else items[0] for j in range(k)]

    chosen = spread(unique, n_max)
    taken = set(chosen)
    chosen += spread([i for i in range(n) if i not in taken], n_max - len(chosen))
    order = {p: r for r, p in enumerate(first)}
    return sorted(chosen, key=lambda i: (order[prompts[i]], i))


def verdict(row: Optional[dict]) -> tuple[str, tuple[int, int, int]]:
    """The caption of one scored image (a validation jsonl row): "✓ 0.93" / "✗ 0.41" where the reward reports a
    strict verdict (``<reward>/strict``), else the reward; and its colour."""
    if not row:
        return "-", (90, 90, 90)
    strict = [v for k, v in row.items() if k.endswith("/strict") and v is not None]
    text = f"{float(row.get('reward', float('nan'))):.2f}"
    if not strict:
        return text, (40, 40, 40)
    ok = float(strict[0]) >= 0.5
    return ("\u2713 " if ok else "\u2717 ") + text, ((0, 130, 0) if ok else (190, 0, 0))


def _font(size: int):
    from PIL import ImageFont

    for name in ("DejaVuSans.ttf", "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"):
        try:
            return ImageFont.truetype(name, size)
        except OSError:
            continue
    try:
        return ImageFont.load_default(size=size)
    except TypeError:   # Pillow < 10.1
        return ImageFont.load_default()


def _thumb(image: torch.Tensor, size: int):
    from PIL import Image

    img = Image.fromarray(image.permute(1, 2, 0).cpu().numpy()[..., :3])
    resample = Image.NEAREST if img.width < size else Image.LANCZOS   # small images stay crisp pixels
    return img.resize((size, size), resample)


def _wrap(draw, text: str, font, width: int, lines: int) -> list[str]:
    out, cur = [], ""
    for word in text.split():
        trial = f"{cur} {word}".strip()
        if draw.textlength(trial, font=font) <= width or not cur:
            cur = trial
        else:
            out.append(cur)
            cur = word
    out.append(cur)
    if len(out) > lines:
        out = out[:lines]
        out[-1] = out[-1][: max(1, len(out[-1]) - 2)] + "\u2026"
    return out


def save_sheet(image_sets: Sequence[torch.Tensor], path: str, *, prompts: Sequence[str], idx: Sequence[int],
               row_sets: Sequence[Sequence[Optional[dict]]] = (), title: Optional[str] = None, thumb: int = 128,
               cols: int = 4) -> str:
    """A captioned sheet of the images ``idx``: one cell per index with the image of every set side by side
    (``thumb`` px thumbnails), each image's verdict (✓/✗ and reward, from its set's per-image rows) under it and the
    prompt under the cell; ``title`` on a line above."""
    from PIL import Image, ImageDraw

    font, small = _font(13), _font(12)
    gap, text_h = 10, 3 * 16 + 18
    head = 28 if title else gap
    cell_w = len(image_sets) * (thumb + 4) - 4
    rows = int(math.ceil(len(idx) / cols)) or 1
    width = min(cols, len(idx) or 1) * (cell_w + gap) + gap
    height = head + rows * (thumb + text_h + gap) + (gap if title else 0)
    canvas = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((gap, 6), title, fill=(0, 0, 0), font=font)
    for k, i in enumerate(idx):
        r, c = divmod(k, cols)
        x, y = gap + c * (cell_w + gap), head + r * (thumb + text_h + gap)
        for j, images in enumerate(image_sets):
            canvas.paste(_thumb(images[i], thumb), (x + j * (thumb + 4), y))
            set_rows = row_sets[j] if j < len(row_sets) else ()
            text, colour = verdict(set_rows[i] if i < len(set_rows) else None)
            draw.text((x + j * (thumb + 4) + 2, y + thumb + 2), text, fill=colour, font=font)
        for m, line in enumerate(_wrap(draw, str(prompts[i]), small, cell_w, 3)):
            draw.text((x, y + thumb + 18 + 16 * m), line, fill=(0, 0, 0), font=small)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    canvas.save(path)
    return path


def save_before_after(before: torch.Tensor, after: torch.Tensor, path: str, *, prompts: Sequence[str],
                      before_rows: Sequence[Optional[dict]] = (), after_rows: Sequence[Optional[dict]] = (),
                      labels: Sequence[str] = ("before", "after"), n_max: int = 24, thumb: int = 128,
                      cols: int = 4) -> str:
    """A readable before/after sheet (:func:`save_sheet`): at most ``n_max`` prompts (:func:`pick_examples`), each
    cell the image before training and after it (same prompt and noise) side by side with their verdicts. The full
    set stays in ``validation/``."""
    idx = pick_examples(list(prompts), n_max)
    title = (f"left: {labels[0]}   right: {labels[1]}   (same prompt and noise; {len(idx)} of {len(prompts)} "
             "validation images)")
    return save_sheet([before, after], path, prompts=prompts, idx=idx, row_sets=[before_rows, after_rows],
                      title=title, thumb=thumb, cols=cols)


def read_validation_scores(path: str) -> list[dict]:
    """The rows :func:`write_validation_scores` wrote ([] when the file is missing)."""
    import json

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def write_validation_scores(path: str, prompts: Sequence[str], seeds: Sequence[int], scores: torch.Tensor,
                            details: dict, columns: Optional[dict] = None) -> str:
    """One JSON line per validation image, in the grid's order: prompt, noise seed, reward, every per-image detail
    the reward reports (e.g. ``shapes/strict``; NaN, "not applicable", becomes null) and the text ``columns`` (e.g.
    the image's tag and composition). Written whole or not at all."""
    import json

    cols = {k: v.float().tolist() for k, v in details.items()}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        for i, (prompt, seed) in enumerate(zip(prompts, seeds)):
            row = {"prompt": prompt, "seed": int(seed), "reward": float(scores[i])}
            row.update({k: (None if math.isnan(v[i]) else v[i]) for k, v in cols.items()})
            row.update({k: v[i] for k, v in (columns or {}).items()})
            f.write(json.dumps(row) + "\n")
    os.replace(path + ".tmp", path)
    return path


def val_history_from_run_dir(run_dir: str, rows: Sequence[dict]) -> list[dict]:
    """The validations of a whole run (every resumed segment) as ``validation_gain_line`` reads them: the
    ``val/*`` metrics of each metrics.jsonl row that has them, with the per-image values from
    ``validation/step_<k>.jsonl`` (``val/reward_mean`` ← reward, ``val/<detail>`` ← each per-image detail)."""
    out = []
    for row in rows:
        if "val/reward_mean" not in row:
            continue
        step = int(row["step"])
        images = read_validation_scores(os.path.join(run_dir, "validation", f"step_{step:05d}.jsonl"))
        per_image: dict = {}
        if images:
            per_image["val/reward_mean"] = [float(r["reward"]) for r in images]
            for key in images[0]:
                if key not in ("prompt", "seed", "reward") and f"val/{key}" in row:
                    per_image[f"val/{key}"] = [float("nan") if r.get(key) is None else float(r[key]) for r in images]
        out.append({**{k: v for k, v in row.items() if k == "step" or k.startswith("val/")}, "per_image": per_image})
    return out


def paired_tag_tables(first: Sequence[dict], last: Sequence[dict], *, before: str, after: str
                      ) -> tuple[list[str], dict[str, list[dict]]]:
    """Two validations of the same images (rows of :func:`read_validation_scores`, same order): for each per-image
    strict accuracy, per tag and for the mean over tags, the composition-weighted accuracy in each and the gain with
    its paired standard error (trainer/tag_report.py). Returns the printed lines and, per accuracy key, the rows."""
    from verl_diffusion.trainer.tag_report import tag_gains, table_lines

    lines, tables = [], {}
    for key in sorted(k for k in first[0] if k.endswith("/strict")):
        nan = float("nan")
        table = tag_gains([nan if r[key] is None else r[key] for r in first],
                          [nan if r[key] is None else r[key] for r in last],
                          [r["tag"] for r in first], [r["composition"] for r in first])
        lines.append(f"{key} by tag, every composition weighted equally ({before} -> {after}, "
                     "gain in points ± paired standard error):")
        lines += ["  " + line for line in table_lines(table, before=before, after=after)]
        tables[key] = [vars(r) for r in table]
    return lines, tables


def tag_table_from_run_dir(run_dir: str, rows: Sequence[dict]) -> Optional[list[str]]:
    """The end-of-run table of the first and the last validation (same images): for each per-image strict accuracy,
    per tag and for the mean over tags, the composition-weighted accuracy before and after and the gain with its
    paired standard error (trainer/tag_report.py); also written to ``<run_dir>/heldout_by_tag.json``. None with
    fewer than two validations or no tagged per-image accuracy."""
    import json

    steps = [int(r["step"]) for r in rows if "val/reward_mean" in r]
    if len(steps) < 2:
        return None
    val = os.path.join(run_dir, "validation")
    first = read_validation_scores(os.path.join(val, f"step_{steps[0]:05d}.jsonl"))
    last = read_validation_scores(os.path.join(val, f"step_{steps[-1]:05d}.jsonl"))
    if not first or len(first) != len(last) or "composition" not in first[0]:
        return None
    lines, tables = paired_tag_tables(first, last, before=f"step {steps[0]}", after=f"step {steps[-1]}")
    report = {"first_step": steps[0], "last_step": steps[-1], **tables}
    if lines:
        with open(os.path.join(run_dir, "heldout_by_tag.json.tmp"), "w") as f:
            json.dump(report, f, indent=1)
        os.replace(os.path.join(run_dir, "heldout_by_tag.json.tmp"), os.path.join(run_dir, "heldout_by_tag.json"))
    return lines or None


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


def caption(prompt: str, row: Optional[dict]) -> str:
    """A tracker image's caption: the prompt and its verdict (``a red circle | ✓ 0.93``)."""
    return f"{prompt} | {verdict(row)[0]}"


def log_images(tracker, key: str, images: torch.Tensor, step: int, captions: Sequence[str] = (),
               n_max: int = 16) -> list[str]:
    """Send images with their captions (prompt and verdict) to the image-capable backends of verl's ``Tracking``:
    wandb as captioned images (at most ``n_max``), tensorboard as a grid with the captions as text.

    Returns the backends that received them (console / file trackers take scalars only).
    """
    loggers = getattr(tracker, "logger", {}) or {}
    captions = list(captions) or [""] * len(images)
    idx = pick_examples(captions, n_max) if any(captions) else list(range(min(n_max, len(images))))
    sent = []
    if "wandb" in loggers:
        import wandb

        wandb.log({key: [wandb.Image(images[i].permute(1, 2, 0).cpu().numpy(), caption=captions[i]) for i in idx]},
                  step=step)
        sent.append("wandb")
    if "tensorboard" in loggers:
        writer = loggers["tensorboard"].writer
        writer.add_image(key, image_grid(images[idx]), step, dataformats="HWC")
        writer.add_text(key + "/captions", "\n\n".join(f"{n}. {captions[i]}" for n, i in enumerate(idx)), step)
        sent.append("tensorboard")
    return sent
