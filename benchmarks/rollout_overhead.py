"""Rollout overhead: our SDE rollout (log-probs + trajectory capture) vs diffusers' own sampling loop.

Both sides run the same tiny offline SD3 model, the same number of steps, batch, image size and prompt
encoding (CLIP-L/G + T5), and both decode the images: ``StableDiffusion3Pipeline.__call__`` (Euler ODE,
no CFG, ``output_type="pt"``) against ``DiffusersRollout.generate`` (Flow-SDE, window ``none`` = every step
stochastic with a log-prob, or a fixed window of 2, optionally storing velocities). Runs are interleaved,
each configuration repeated, and the median wall time and the median CPU time of the process
(robust to other jobs on shared cores when run with one thread) reported. Target: ratio ≤ 1.10.

    python benchmarks/rollout_overhead.py                     # both tiny configs, 1 thread, 9 repeats
    python benchmarks/rollout_overhead.py --repeats 15 --threads 2 --write benchmarks/results/rollout_overhead.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

from verl_diffusion.algos.windows import SdeWindowConfig
from verl_diffusion.models.sd3 import SD3Adapter
from verl_diffusion.models.tiny import build_tiny_sd3_pipeline
from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout, RolloutConfig

# name → (tiny builder kwargs, pixels, batch, steps)
CONFIGS = {
    "tiny (64 px, 2 layers, width 32)": (dict(), 64, 8, 10),
    "larger tiny (128 px, 4 layers, width 128)": (
        dict(sample_size=32, num_layers=4, attention_head_dim=32, num_attention_heads=4, text_width=32), 128, 8, 10),
}

VARIANTS = {
    "sde all steps + log-probs": dict(window=SdeWindowConfig(mode="none")),
    "sde all steps + log-probs + velocities": dict(window=SdeWindowConfig(mode="none"), store_velocities=True),
    "sde window 2 (fixed) + log-probs": dict(window=SdeWindowConfig(mode="fixed", size=2)),
}


def _timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process); CPU time is robust to other jobs on shared cores."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench(name: str, builder_kw: dict, pixels: int, batch: int, steps: int, repeats: int) -> list[tuple]:
    pipe = build_tiny_sd3_pipeline(seed=0, **builder_kw)
    adapter = SD3Adapter.from_pipeline(pipe)
    prompts = [f"prompt number {i // 4}" for i in range(batch)]
    groups = torch.arange(batch) // 4

    def run_pipe():
        with torch.no_grad():
            pipe(prompts, height=pixels, width=pixels, num_inference_steps=steps, guidance_scale=1.0,
                 output_type="pt", max_sequence_length=adapter.max_sequence_length)

    rollouts = {v: DiffusersRollout(adapter, RolloutConfig(num_steps=steps, height=pixels, width=pixels,
                                                           micro_batch_size=batch, **kw))
                for v, kw in VARIANTS.items()}
    calls = {"diffusers pipeline (ODE)": run_pipe}
    for v, ro in rollouts.items():
        calls[v] = (lambda ro=ro: ro.generate(prompts, groups, seed=0))
    for fn in calls.values():        # warm-up
        fn()
    times = {k: [] for k in calls}
    cpu = {k: [] for k in calls}
    for _ in range(repeats):         # interleaved so that load on the shared cores hits every variant
        for k, fn in calls.items():
            w, c = _timed(fn)
            times[k].append(w)
            cpu[k].append(c)
    ref = "diffusers pipeline (ODE)"
    base, base_cpu = statistics.median(times[ref]), statistics.median(cpu[ref])
    rows = []
    for k, ts in times.items():
        med = statistics.median(ts)
        rows.append((name, k, batch, steps, med * 1e3, med / batch * 1e3, med / base,
                     statistics.median(cpu[k]) / base_cpu))
    return rows


def table(rows: list[tuple]) -> str:
    lines = ["| model | sampler | batch | steps | median wall ms / batch | ms / image | ratio (median wall) "
             "| ratio (median CPU time) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]:.2f} | {r[6]:.3f} | {r[7]:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only-small", action="store_true", help="skip the larger tiny config")
    ap.add_argument("--write", default=None, help="also write a markdown report to this path")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    for name, (kw, px, b, n) in CONFIGS.items():
        if args.only_small and name.startswith("larger"):
            continue
        rows += bench(name, kw, px, b, n, args.repeats)
    text = table(rows)
    print(text)
    if args.write:
        cmd = "python benchmarks/rollout_overhead.py " + " ".join(argv if argv is not None else sys.argv[1:])
        env = (f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
               f"{args.threads} thread(s), {args.repeats} interleaved repeats, medians; "
               f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        with open(args.write, "w") as f:
            f.write("# Rollout overhead vs the plain diffusers pipeline\n\n"
                    f"Command: `{cmd.strip()}`\n\nEnvironment: {env}.\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
