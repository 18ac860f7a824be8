"""The default run (shapes world) over several seeds: held-out strict accuracy before and after RL.

    python benchmarks/shapes_default_run.py --seeds 0 1 2 [hydra overrides ...]

Each seed is one ``python -m verl_diffusion.main_flowgrpo --config-name shapes_cpu trainer.seed=<s> data.seed=<s+1>``
(+ the overrides) in a subprocess; the held-out prompts, their noise and the pretrained model are the same for every
seed, so the "before" accuracy is identical and the gain differs only by the training's randomness (rollout noise,
prompt order). The accuracy is the composition-weighted held-out strict accuracy over the tags
(``val/shapes/strict/by_composition``: every tag weighs the same, every composition within it the same). Prints a
markdown table (accuracy and reward at every validation, the gain with its paired standard error, wall time), the
mean gain with its standard deviation over seeds, and each tag's gain averaged over seeds (from each run's
heldout_by_tag.json) with the number of seeds in which it rose.

``--algorithm NAME`` runs the default run with another loss: the algorithm settings of the race's recipe for NAME
(``compare_algorithms.ALGORITHMS``: the loss, old policy, trained fraction, sampler, advantages), the rest (data,
budget, learning-rate schedule, validation) the default run's.
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
    key = "val/shapes/strict/by_composition"
    vals = [(r["step"], r[key], r["val/reward_mean"]) for r in rows if key in r]
    # Per tag and for the mean over tags: gain and its paired standard error (same prompts and noise), the
    # measurement's own noise for this run (trainer/tag_report.py).
    with open(os.path.join(env["VERL_DIFFUSION_RUN_ROOT"], "shapes_cpu", "heldout_by_tag.json")) as f:
        by_tag = {r["tag"]: r for r in json.load(f)["shapes/strict"]}
    se = by_tag["all tags"]["se"]
    return {"seed": seed, "wall_s": wall, "vals": vals, "se": se, "by_tag": by_tag, "stdout": res.stdout}


def _hydra_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value)


def algorithm_overrides(algo: str) -> list[str]:
    """Hydra overrides that give the default config the algorithm settings of ``algo``'s race recipe: every leaf
    of those settings set (``++``) and every default leaf they lack deleted (``~``), so a sub-config is replaced
    whole, as the race replaces it."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    from compare_algorithms import _select, algorithm_settings, compose
    from omegaconf import OmegaConf

    default = compose("shapes_cpu", [])
    out = []

    def leaves(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from leaves(f"{prefix}.{k}", v)
        else:
            yield prefix, value

    for key, value in algorithm_settings(algo).items():
        current = _select(default, key)
        current = OmegaConf.to_container(current, resolve=True) if OmegaConf.is_config(current) else current
        new = dict(leaves(key, value))
        out += [f"~{k}" for k, _ in leaves(key, current) if k not in new]
        out += [f"++{k}={_hydra_value(v)}" for k, v in new.items()]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--root", default=None, help="run directories (default: a temporary directory)")
    p.add_argument("--algorithm", default=None, help="another loss with its race recipe's settings (default: the config's)")
    args, overrides = p.parse_known_args(argv)
    if args.algorithm:
        overrides = algorithm_overrides(args.algorithm) + overrides
    root = args.root or tempfile.mkdtemp(prefix="shapes_default_")
    results = []
    for s in args.seeds:
        r = run_seed(s, overrides, root)
        results.append(r)
        print(f"seed {s}: " + ", ".join(f"step {st}: strict {a:.3f} reward {rw:.3f}" for st, a, rw in r["vals"])
              + f"  ({r['wall_s']:.0f} s)", flush=True)
    print(report(results))
    return 0


def report(results: list[dict]) -> str:
    """The markdown report of ``run_seed`` results: accuracy at every validation, each seed's gain with its paired
    s.e., the mean gain with its sd over seeds (one seed: its paired s.e.), and each tag's gain over seeds."""
    steps = [st for st, _, _ in results[0]["vals"]]
    lines = ["| seed | " + " | ".join(f"step {st}: strict / reward" for st in steps)
             + " | gain ± paired s.e. (points) | wall (s) |", "|---|" + "---|" * len(steps) + "---|---|"]
    gains = []
    for r in results:
        gain = 100 * (r["vals"][-1][1] - r["vals"][0][1])
        gains.append(gain)
        lines.append(f"| {r['seed']} | " + " | ".join(f"{a:.3f} / {rw:.3f}" for _, a, rw in r["vals"])
                     + f" | {gain:+.1f} ± {100 * r['se']:.1f} | {r['wall_s']:.0f} |")
    if len(gains) > 1:
        sd = statistics.stdev(gains)
        lines.append(f"\nheld-out strict accuracy gain: {statistics.mean(gains):+.1f} ± {sd:.1f} points (mean ± sd over "
                     f"{len(gains)} seeds, {statistics.mean(gains) / sd:.1f} sd)")
    else:
        lines.append(f"\nheld-out strict accuracy gain: {gains[0]:+.1f} ± {100 * results[0]['se']:.1f} points (one seed, "
                     "± its paired s.e.)")
    # How much of the spread between seeds the evaluation alone explains: the root mean square of the paired s.e.
    rms_se = 100 * (sum(r["se"] ** 2 for r in results) / len(results)) ** 0.5
    lines.append(f"evaluation noise of one gain (rms paired s.e.): {rms_se:.1f} points")
    lines.append("\n| tag | base | gain, mean over seeds (points) | sd over seeds | seeds with a gain |")
    lines.append("|---|---|---|---|---|")
    for tag in results[0]["by_tag"]:
        g = [100 * r["by_tag"][tag]["gain"] for r in results]
        sd_t = f"{statistics.stdev(g):.1f}" if len(g) > 1 else "—"
        lines.append(f"| {tag} | {100 * results[0]['by_tag'][tag]['before']:.1f}% | {statistics.mean(g):+.1f} | "
                     f"{sd_t} | {sum(x > 0 for x in g)}/{len(g)} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
