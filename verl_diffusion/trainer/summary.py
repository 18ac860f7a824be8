"""The lines a finished run prints: the train reward's first and last quarter, the validation gain with its paired
standard error, the per-tag table, and where the artifacts and the model are. Read from the run directory
(metrics.jsonl, validation/), so a run resumed over several processes is summarised whole."""

from __future__ import annotations

import os

from verl_diffusion.trainer.run_dir import METRICS_NAME, MetricsLog
from verl_diffusion.trainer.validation import tag_table_from_run_dir, val_history_from_run_dir, validation_gain_line


def summary_lines(summary: dict) -> list[str]:
    """The end-of-run lines for ``run_flowgrpo``'s summary dict (run_dir, artifact paths, model)."""
    run_dir = summary["run_dir"]
    rows = MetricsLog(os.path.join(run_dir, METRICS_NAME)).rows()
    out = []
    h = [r for r in rows if "reward/mean" in r]
    if h:
        k = max(1, len(h) // 4)
        first = sum(x["reward/mean"] for x in h[:k]) / k
        last = sum(x["reward/mean"] for x in h[-k:]) / k
        out.append(f"reward: first {k} steps {first:.4f} -> last {k} steps {last:.4f}")
    gain = validation_gain_line(val_history_from_run_dir(run_dir, rows))
    if gain:
        out.append(gain)
    out += tag_table_from_run_dir(run_dir, rows) or []
    out += [f"{key}: {summary[key]}" for key in ("reward_curve", "before_after", "metrics") if key in summary]
    if summary.get("model"):
        out.append(f"model: {summary['model']} (stock diffusers loads it: {summary['model']}/README.md)")
    out.append(f"run dir: {run_dir}")
    return out
