"""Rollout through each model adapter vs the stock diffusers pipeline, side by side (Qwen-Image, FLUX.1, FLUX.2-klein).

Same tiny offline model, prompts, initial noise, steps, grid (the scheduler's) and guidance; both decode images:
``<Pipeline>.__call__`` (``output_type="pt"``) against ``DiffusersRollout.generate_ode`` (the same Euler ODE through
the adapter: packing, ids and CFG per step in ``velocity``) and ``DiffusersRollout.generate`` (Flow-SDE window of 2
with log-probs and the trajectory). Interleaved repeats; median wall and CPU time; ratios to the pipeline.

    python benchmarks/adapter_rollout_overhead.py [--repeats 7] [--threads 1] [--write benchmarks/results/adapter_rollout_overhead.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from verl_diffusion.models import get_adapter_cls
from verl_diffusion.models.tiny import TINY_BUILDERS
from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout, RolloutConfig

PIXELS, BATCH, STEPS = 64, 8, 10
# architecture -> (CFG scale, negative prompt): the guidance each model samples with.
GUIDED = {"qwen_image": (4.0, " "), "flux": (1.0, ""), "flux2_klein": (4.0, "")}


def _timed(fn) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def bench(arch: str, repeats: int) -> list[tuple]:
    pipe = TINY_BUILDERS[arch]()
    adapter = get_adapter_cls(arch).from_pipeline(pipe)
    scale, negative = GUIDED[arch]
    prompts = [f'a sign "w{i // 4}"' for i in range(BATCH)]
    seeds = list(range(BATCH))
    cfg = dict(num_steps=STEPS, grid="scheduler", height=PIXELS, width=PIXELS, micro_batch_size=BATCH,
               guidance_scale=scale, negative_prompt=negative, val_num_steps=STEPS)
    ode = DiffusersRollout(adapter, RolloutConfig(sampler="ode", **cfg))
    sde = DiffusersRollout(adapter, RolloutConfig(window={"mode": "fixed", "size": 2, "lo": 0, "hi": 2}, **cfg))
    x0 = torch.stack([torch.randn(adapter.latent_shape(PIXELS, PIXELS), generator=torch.Generator().manual_seed(s))
                      for s in seeds])

    def run_pipe():
        kw = dict(prompt=prompts, num_inference_steps=STEPS, height=PIXELS, width=PIXELS, output_type="pt")
        if arch == "qwen_image":
            kw.update(latents=adapter.pack(x0), true_cfg_scale=scale, negative_prompt=[negative] * BATCH)
        elif arch == "flux":
            kw.update(latents=adapter.pack(x0), guidance_scale=adapter.distilled_guidance_scale,
                      max_sequence_length=adapter.max_sequence_length)
        else:
            kw.update(latents=x0, guidance_scale=scale, max_sequence_length=adapter.max_sequence_length)
        pipe(**kw)

    runs = {"diffusers pipeline (ODE)": run_pipe,
            "adapter ODE (generate_ode)": lambda: ode.generate_ode(prompts, seeds=seeds),
            "adapter SDE window 2 + log-probs": lambda: sde.generate(prompts, torch.arange(BATCH) // 4, seed=0)}
    times = {k: [] for k in runs}
    with torch.no_grad():
        for fn in runs.values():
            fn()                                  # warm-up
        for _ in range(repeats):
            for k, fn in runs.items():
                times[k].append(_timed(fn))
    base_w = statistics.median(w for w, _ in times["diffusers pipeline (ODE)"])
    base_c = statistics.median(c for _, c in times["diffusers pipeline (ODE)"])
    rows = []
    for k, ts in times.items():
        w, c = statistics.median(x for x, _ in ts), statistics.median(y for _, y in ts)
        rows.append((arch, k, f"{scale:g}", 1e3 * w, w / base_w, c / base_c))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [r for arch in GUIDED for r in bench(arch, args.repeats)]
    lines = [f"Environment: torch {torch.__version__}, {platform.machine()}, {args.threads} thread(s), {args.repeats} "
             f"interleaved repeats, medians; batch {BATCH}, {PIXELS} px, {STEPS} steps; load average at the end "
             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores.", "",
             "| architecture | sampler | CFG | median wall ms / batch | ratio (wall) | ratio (CPU time) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {a} | {k} | {g} | {w:.1f} | {rw:.3f} | {rc:.3f} |" for a, k, g, w, rw, rc in rows]
    text = "\n".join(lines)
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(f"Command: `python benchmarks/adapter_rollout_overhead.py --repeats {args.repeats} "
                    f"--threads {args.threads} --write {args.write}`\n\n{text}\n")


if __name__ == "__main__":
    main()
