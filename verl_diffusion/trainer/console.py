"""The trainer's console lines: one per step (reward, loss, time, ETA), one per validation, warnings between them."""

from __future__ import annotations

from typing import Optional

from verl_diffusion.trainer.reward_health import failure_summary
from verl_diffusion.trainer.tag_report import BY_COMPOSITION


def warn(line: str) -> None:
    """A warning on the progress stream (stdout, flushed), so it sits between the step lines it concerns."""
    print(f"WARNING: {line}", flush=True)


def validation_line(step: int, m: dict) -> str:
    """One line per validation: mean reward, every strict accuracy a reward reports (val/<reward>/strict), its
    composition-weighted mean over tags (trainer/tag_report.py) and the within-prompt diversity."""
    parts = [f"validation step {step}", f"reward {m['val/reward_mean']:.4f}"]
    for key in sorted(k for k in m if k.startswith("val/") and k.endswith("/strict")):  # per-tag keys end with the tag
        parts.append(f"{key[len('val/'):]} {m[key]:.3f}")
        if key + BY_COMPOSITION in m:
            parts.append(f"by composition {m[key + BY_COMPOSITION]:.3f}")
    if "val/diversity" in m:
        parts.append(f"diversity {m['val/diversity']:.3f}")
    return " | ".join(parts) + f" ({int(m['val/num_images'])} images, ODE)"


def clock(seconds: float) -> str:
    """``1:02:03`` / ``4:05``."""
    seconds = int(round(max(seconds, 0.0)))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def progress_line(step: int, total: int, m: dict, *, elapsed: Optional[float] = None, done: int = 0) -> str:
    """One line per step; with ``elapsed`` (seconds since this segment's first step) and ``done`` (its steps so
    far) it ends with the elapsed time and an ETA at this segment's mean pace (validations included)."""
    parts = [f"step {step}/{total}", f"reward {m.get('reward/mean', float('nan')):.4f}"
             f"±{m.get('reward/std', float('nan')):.4f}"]
    for key, label in (("loss", "loss"), ("actor/pg_loss", "pg"), ("grad_norm", "gnorm"),
                       ("actor/first_micro_log_ratio_abs_max", "|log ratio0|"), ("val/reward_mean", "val")):
        if key in m:
            parts.append(f"{label} {m[key]:.3g}")
    failed = failure_summary(m)
    if failed:
        parts.append(failed)
    parts.append(f"{m.get('timing_s/step', 0.0):.1f}s")
    if elapsed is not None and done > 0:
        parts.append(f"{clock(elapsed)} elapsed, ETA {clock(elapsed / done * max(total - step, 0))}")
    return " | ".join(parts)
