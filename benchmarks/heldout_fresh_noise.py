"""Held-out accuracy of exported models on fresh noise: what the fixed validation draw leaves out.

    python benchmarks/heldout_fresh_noise.py --tags color_attr --models verl_diffusion/assets/shapes_sd3 \\
        outputs/run_a/model outputs/run_b/model [--seeds-per-prompt 4] [--seed-offset 10000] [--max-prompts N]

A run's validation samples every held-out prompt with the same noise seeds at every step and in every run, so the
spread of gains over training seeds leaves out how lucky that one draw is for the base. This script re-draws the
held-out prompts of the given tags (the shapes world's test prompts, ``--prompts``) with stock diffusers from each
model folder at the default run's validation settings (10 steps, no CFG, the shapes model's 12 text tokens), with
``--seeds-per-prompt`` noise seeds per prompt that the validation does not use (``seed_offset + k·i + j``; the
same images for every model), scores them with the shapes detector and prints, per tag, each model's strict accuracy,
reward and share of images with two or more objects, and each model's gain over the first with its paired standard
error. The first model is the reference (the base).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def score_models(models, tags, prompts, seeds_per_prompt=4, seed_offset=10_000, steps=10, size=32,
                 max_sequence_length=12, max_prompts=None, log=print) -> dict:
    """{(model, tag): (strict, reward, two_or_more)} per image, the same prompts and noise seeds for every model."""
    import torch
    from diffusers import DiffusionPipeline

    from verl_diffusion.prompt_files import prompt_text, read_rows
    from verl_diffusion.shapes.detect import detect, evaluate

    rows = read_rows(prompts)
    k = seeds_per_prompt
    table = {}
    for path in models:
        pipe = DiffusionPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        for tag in tags:
            chosen = [r for r in rows if r["extra_info"]["tag"] == tag][:max_prompts]
            strict, reward, two = [], [], []
            for i, r in enumerate(chosen):
                meta = json.loads(r["reward_model"]["ground_truth"])
                for j in range(k):
                    gen = torch.Generator().manual_seed(seed_offset + k * i + j)
                    image = pipe(prompt_text(r["prompt"]), height=size, width=size, num_inference_steps=steps,
                                 guidance_scale=1.0, max_sequence_length=max_sequence_length,
                                 generator=gen).images[0]
                    res = evaluate(detect(np.asarray(image)), meta)
                    strict.append(float(res.strict))
                    reward.append(res.reward)
                    two.append(float(len(res.details["detections"]) >= 2))
            table[(path, tag)] = (np.array(strict), np.array(reward), np.array(two))
            log(f"{path} {tag}: {len(strict)} images, strict {np.mean(strict):.3f}")
    return table


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", required=True, help="diffusers folders; the first is the reference")
    p.add_argument("--tags", nargs="+", default=["single_object", "colors", "counting", "two_object", "color_attr",
                                                 "position"])
    p.add_argument("--prompts", default=str(REPO / "verl_diffusion" / "data" / "shapes" / "test.parquet"))
    p.add_argument("--max-prompts", type=int, help="the first N held-out prompts of each tag (default: all)")
    p.add_argument("--seeds-per-prompt", type=int, default=4)
    p.add_argument("--seed-offset", type=int, default=10_000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--max-sequence-length", type=int, default=12)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    k = a.seeds_per_prompt
    table = score_models(a.models, a.tags, a.prompts, k, a.seed_offset, a.steps, a.size, a.max_sequence_length,
                         a.max_prompts, log=lambda line: print(line, flush=True))
    ref = a.models[0]
    print(f"\n{k} noise seeds per held-out prompt from {a.seed_offset}; reference {ref}\n")
    print("| tag | model | images | strict | reward | two or more objects | strict gain over the reference (points) |")
    print("|---|---|---|---|---|---|---|")
    for tag in a.tags:
        base = table[(ref, tag)][0]
        for path in a.models:
            s, r, t = table[(path, tag)]
            d = (s - base) * 100
            gain = "—" if path == ref else f"{d.mean():+.1f} ± {d.std(ddof=1) / math.sqrt(len(d)):.1f}"
            print(f"| {tag} | {path} | {len(s)} | {s.mean():.3f} | {r.mean():.3f} | {t.mean():.2f} | {gain} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
