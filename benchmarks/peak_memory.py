"""Peak memory of a training worker per setting: process RSS (CPU) and the accelerator's max allocated memory.

    python benchmarks/peak_memory.py [--steps 3] [--out benchmarks/results/peak_memory.md] [--setting NAME ...]

Each setting is a short ``main_flowgrpo`` run on the tiny SD3 (tiny_cpu defaults + overrides); the numbers are
the maxima over steps of ``perf/worker_max_rss_gb`` (ru_maxrss of the worker process: model, optimizer,
rollout trajectories, activations) and ``perf/max_memory_allocated_gb`` (0 on CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SETTINGS = {
    "64px full fine-tune (tiny_cpu)": [],
    "64px LoRA r8": ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"],
    "128px full fine-tune": ["actor_rollout_ref.model.tiny.sample_size=32", "actor_rollout_ref.rollout.resolution=128"],
    "64px, 16 images/step": ["actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                             "actor_rollout_ref.rollout.micro_batch_size=4"],
}


def run(name: str, overrides: list, steps: int) -> dict:
    root = tempfile.mkdtemp(prefix="vd_mem_")
    env = dict(os.environ, VERL_DIFFUSION_RUN_ROOT=root)
    res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name=tiny_cpu",
                          f"trainer.total_training_steps={steps}",
                          "trainer.test_freq=-1", "trainer.logger=[]", *overrides], capture_output=True, text=True,
                         env=env)
    if res.returncode:
        raise RuntimeError(f"{name}: {res.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(root, "tiny_cpu", "metrics.jsonl"))]
    return {"rss": max(r.get("perf/worker_max_rss_gb", 0.0) for r in rows),
            "gpu": max(r.get("perf/max_memory_allocated_gb", 0.0) for r in rows),
            "step": sorted(r["timing_s/step"] for r in rows)[len(rows) // 2]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/peak_memory.md")
    ap.add_argument("--setting", action="append", help="names of SETTINGS to run (default: all)")
    args = ap.parse_args()
    names = args.setting or list(SETTINGS)
    lines = ["# Peak memory per training worker (tiny SD3, 2 workers, FSDP2)", "",
             f"`python benchmarks/peak_memory.py --steps {args.steps}`", "",
             "| setting | worker peak RSS GiB | accelerator max allocated GiB | median step s |", "|---|---|---|---|"]
    for name in names:
        r = run(name, SETTINGS[name], args.steps)
        lines.append(f"| {name} | {r['rss']:.2f} | {r['gpu']:.2f} | {r['step']:.2f} |")
        print(lines[-1], flush=True)
    lines += ["", "RSS includes the Python runtime, torch, Ray, diffusers and the text encoders / VAE of the rollout "
              "(≈ the first row's baseline); the model-dependent part is the difference between rows."]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
