"""One table from several runs of ``compare_algorithms.py`` (one ``--jsonl`` per variant of the settings): the
held-out gain and the learning-signal diagnostics side by side.

    python benchmarks/sweep_report.py benchmarks/results/sweep/*.jsonl [--out table.md]

Per variant (the file's stem) and algorithm, means over its seeds: the held-out strict accuracy (composition-weighted
over tags) at the first and the last validation and the gain; the train reward over the first and last quarter of
the steps; the share of groups whose strict verdict is the same for every image (no strict signal) and whose reward
is (no signal at all); the advantage std; the gradient norm before clipping; the update's relative size |Δθ| / |θ|;
the ratio-clip share and the approximate KL of the ratio losses.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def _mean(xs) -> float:
    v = np.asarray([x for x in xs if x is not None and np.isfinite(x)], dtype=np.float64)
    return float(v.mean()) if v.size else float("nan")


def _quarters(r: dict, key: str) -> tuple[float, float]:
    xs = r.get(key) or []
    n = max(1, len(xs) // 4)
    return _mean(xs[:n]), _mean(xs[-n:])


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def table(files: list[Path]) -> str:
    head = ["variant", "algorithm", "seeds", "steps", "held-out first → last (gain)", "train reward first → last",
            "strict zero-var groups", "reward zero-var groups", "adv std", "grad norm", "|Δθ|/|θ| per step",
            "clip share", "approx KL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for f in files:
        rows = [r for r in rows_of(f) if "error" not in r]
        for algo in dict.fromkeys(r["algorithm"] for r in rows):
            ar = [r for r in rows if r["algorithm"] == algo]
            first = _mean([r["val_strict"][0] for r in ar])
            last = _mean([r["val_strict"][-1] for r in ar])
            gains = [r["val_strict"][-1] - r["val_strict"][0] for r in ar]
            sd = f" ± {100 * np.std(gains, ddof=1):.1f} sd" if len(gains) > 1 else ""
            rq = [_quarters(r, "reward") for r in ar]
            cells = [f.stem, algo, str(len(ar)), str(max(r["steps"][-1] for r in ar)),
                     f"{100 * first:.1f} → {100 * last:.1f} ({100 * (last - first):+.1f}{sd})",
                     f"{_mean([a for a, _ in rq]):.3f} → {_mean([b for _, b in rq]):.3f}"]
            for key, fmt in (("strict_zero_std", "{:.2f}"), ("reward_zero_std", "{:.2f}"), ("adv_std", "{:.3f}"),
                             ("grad_norm", "{:.3g}"), ("update_rel_norm", "{:.2e}"), ("clip_frac", "{:.3f}"),
                             ("approx_kl", "{:.2e}")):
                v = _mean([_mean(r.get(key) or []) for r in ar])
                cells.append(fmt.format(v) if np.isfinite(v) else "—")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("jsonl", nargs="+", type=Path)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    text = table(a.jsonl)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
