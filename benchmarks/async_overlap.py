"""Rollout-train overlap: the async trainer (``diffusion_async``, a standalone replica samples batch k+1 while the
actor trains batch k) side by side with the sync trainer, colocated and standalone, in one invocation.

    python benchmarks/async_overlap.py [--steps 12] [--out benchmarks/results/async_overlap.md]

All three runs use the tiny_cpu settings (4 prompts × 8 images at 64 px per step, 6 sampling steps, flow_grpo) with
one actor worker, so that a standalone run (actor + replica) uses as many processes as the CPU has cores (2).
Each run is ``python -m verl_diffusion.main_flowgrpo`` (its own Ray session). Medians over the steps after the
first 2. Columns:

* step period = ``timing_s/step`` + ``timing_s/update_weights`` (the whole loop body but validation);
* rollout = the replica's sampling time of the step's batch (``perf/rollout_time``);
* wait = time the driver waited for that batch (sync: the whole rollout; async: what the previous step's training
  did not hide);
* overlap ratio = 1 − wait / rollout (``async/overlap_ratio``; 0 in sync mode by construction);
* weights version lag = step − 1 − ``rollout/weights_version`` (0 = on-policy, 1 = one step stale).
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

TINY = ["data.train_batch_size=4", "actor_rollout_ref.rollout.n=8", "trainer.test_freq=-1", "trainer.logger=[]",
        "trainer.n_gpus_per_node=1", "trainer.save_freq=-1"]
MODES = {
    "sync, colocated": ["actor_rollout_ref.rollout.placement=colocated", "trainer.v1.trainer_mode=diffusion_sync"],
    "sync, standalone": ["actor_rollout_ref.rollout.placement=standalone", "trainer.v1.trainer_mode=diffusion_sync"],
    "async, standalone": ["actor_rollout_ref.rollout.placement=standalone", "trainer.v1.trainer_mode=diffusion_async"],
}


def run(steps: int, extra: list) -> dict:
    root = tempfile.mkdtemp(prefix="vd_async_bench_")
    env = dict(os.environ, VERL_DIFFUSION_RUN_ROOT=root)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name=tiny_cpu",
                          f"trainer.total_training_steps={steps}", *TINY, *extra], capture_output=True, text=True,
                         env=env)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise RuntimeError(res.stderr[-3000:])
    rows = [json.loads(line) for line in open(os.path.join(root, "tiny_cpu", "metrics.jsonl"))]
    rows = [r for r in rows if "timing_s/step" in r][2:]
    med = lambda key, default=0.0: statistics.median(float(r.get(key, default)) for r in rows)  # noqa: E731
    period = statistics.median(float(r["timing_s/step"]) + float(r.get("timing_s/update_weights", 0.0)) for r in rows)
    rollout = med("perf/rollout_time")
    wait = med("async/rollout_wait_s", float("nan"))
    if wait != wait:       # sync trainers: the driver waits for the whole generation
        wait = med("timing_s/gen")
    return {"period": period, "rollout": rollout, "wait": wait, "update": med("timing_s/update"),
            "sync": med("timing_s/update_weights"), "overlap": med("async/overlap_ratio"),
            "lag": statistics.median(r["step"] - 1 - r["rollout/weights_version"] for r in rows),
            "reward_last": float(rows[-1]["reward/mean"]), "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = ap.parse_args()
    results = {name: run(args.steps, extra) for name, extra in MODES.items()}
    base = results["sync, standalone"]["period"]
    lines = [f"steps {args.steps} (medians over steps 3..{args.steps}), tiny_cpu 32 images/step, 1 actor worker",
             "",
             "| mode | step period s | rollout s | wait s | update s | weight sync s | overlap ratio | "
             "version lag | period vs sync standalone | run wall s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['period']:.3f} | {r['rollout']:.3f} | {r['wait']:.3f} | {r['update']:.3f} | "
                     f"{r['sync']:.3f} | {r['overlap']:.2f} | {r['lag']:.0f} | {r['period'] / base:.2f}x | "
                     f"{r['wall']:.0f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# Rollout-train overlap: async vs sync replicas (tiny_cpu, 2-core CPU)\n\n"
                    f"`python benchmarks/async_overlap.py --steps {args.steps}` (columns: the script's docstring)\n\n"
                    f"{text}\n")


if __name__ == "__main__":
    main()
