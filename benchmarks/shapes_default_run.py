"""The default run (shapes world) over several seeds: held-out strict accuracy before and after RL.

    python benchmarks/shapes_default_run.py --seeds 0 1 2 [hydra overrides ...]

Each seed is one ``python -m verl_diffusion.main_flowgrpo --config-name shapes_cpu trainer.seed=<s> data.seed=<s+1>``
(+ the overrides) in a subprocess; the held-out prompts, their noise and the pretrained model are the same for every
seed, so the "before" accuracy is identical and the gain differs only by the training's randomness (rollout noise,
prompt order). Prints a markdown table (accuracy and reward at every validation, wall time) and the mean gain with
its standard deviation over seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from verl_diffusion.trainer.validation import paired_standard_error


def run_seed(seed: int, overrides: list[str], root: str) -> dict:
    env = dict(os.environ, VERL_DIFFUSION_RUN_ROOT=os.path.join(root, f"seed{seed}"), RAY_DEDUP_LOGS="1")
    t0 = time.time()
    res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name=shapes_cpu", f"trainer.seed={seed}",
                          f"data.seed={seed + 1}", *overrides], capture_output=True, text=True, env=env)
    wall = time.time() - t0
    if res.returncode != 0:
        raise RuntimeError(f"seed {seed} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    with open(os.path.join(env["VERL_DIFFUSION_RUN_ROOT"], "shapes_cpu", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    vals = [(r["step"], r["val/shapes/strict"], r["val/reward_mean"]) for r in rows if "val/shapes/strict" in r]
    # Paired standard error of the strict gain (same prompts and noise): the measurement's own noise for this run.
    strict = []
    for st in (vals[0][0], vals[-1][0]):
        path = os.path.join(env["VERL_DIFFUSION_RUN_ROOT"], "shapes_cpu", "validation", f"step_{st:05d}.jsonl")
        with open(path) as f:
            strict.append([json.loads(line)["shapes/strict"] for line in f])
    se = paired_standard_error(*strict)
    return {"seed": seed, "wall_s": wall, "vals": vals, "se": se, "stdout": res.stdout}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", default=None, help="run directories (default: a temporary directory)")
    args, overrides = p.parse_known_args(argv)
    root = args.root or tempfile.mkdtemp(prefix="shapes_default_")
    results = []
    for s in args.seeds:
        r = run_seed(s, overrides, root)
        results.append(r)
        print(f"seed {s}: " + ", ".join(f"step {st}: strict {a:.3f} reward {rw:.3f}" for st, a, rw in r["vals"])
              + f"  ({r['wall_s']:.0f} s)", flush=True)
    steps = [st for st, _, _ in results[0]["vals"]]
    lines = ["| seed | " + " | ".join(f"step {st}: strict / reward" for st in steps)
             + " | gain ± paired s.e. (points) | wall (s) |", "|---|" + "---|" * len(steps) + "---|---|"]
    gains = []
    for r in results:
        gain = 100 * (r["vals"][-1][1] - r["vals"][0][1])
        gains.append(gain)
        lines.append(f"| {r['seed']} | " + " | ".join(f"{a:.3f} / {rw:.3f}" for _, a, rw in r["vals"])
                     + f" | {gain:+.1f} ± {100 * r['se']:.1f} | {r['wall_s']:.0f} |")
    sd = statistics.stdev(gains) if len(gains) > 1 else float("nan")
    lines.append(f"\nheld-out strict accuracy gain: {statistics.mean(gains):+.1f} ± {sd:.1f} points (mean ± sd over "
                 f"{len(gains)} seeds, {statistics.mean(gains) / sd:.1f} sd)")
    # How much of the spread between seeds the evaluation alone explains: the root mean square of the paired s.e.
    rms_se = 100 * (sum(r["se"] ** 2 for r in results) / len(results)) ** 0.5
    lines.append(f"evaluation noise of one gain (rms paired s.e.): {rms_se:.1f} points")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
