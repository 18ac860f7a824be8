"""The per-tag profile of a shapes model: held-out strict accuracy per tag (every composition weighted equally), the
legibility of its shapes (the detector's shape fit on its images), and within-prompt diversity.

    python benchmarks/shapes_base_profile.py [--model verl_diffusion/assets/shapes_sd3 ...] [--noises 2]

For each model: ``python -m verl_diffusion.sample`` on the held-out validation set (``--prompts``, default
verl_diffusion/data/shapes/test.parquet, every held-out composition of every tag, each equally often) with
``--noises`` noise seeds per prompt and the default run's validation settings (10 ODE steps on the scheduler grid,
32 px); then

- strict accuracy per tag and their mean, composition-weighted (trainer/tag_report.py), with the paired-free
  binomial standard error of each tag;
- shape fit: the soft IoU of the best shape template of every detected object (detect.classify_shape; the
  detector calls an object shapeless below SHAPE_MIN_FIT = 0.5): percentiles and the share of objects above
  0.5 / 0.7 / 0.85 (clean renders fit at 0.85-1.0);
- within-prompt diversity (per-pixel std across a composition's images).

Prints a markdown table per model; ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def profile(model: str, prompts: str, noises: int, steps: int, out_dir: str, seed_offset: int = 0) -> dict:
    from PIL import Image

    from verl_diffusion.sample import sample
    from verl_diffusion.shapes.detect import SHAPE_MIN_FIT, detect
    from verl_diffusion.trainer.dataset import PromptDataset
    from verl_diffusion.trainer.tag_report import tag_gains, within_prompt_diversity

    n_prompts = len(PromptDataset([prompts]))
    args = argparse.Namespace(model=model, lora=None, prompts=prompts, reward="shapes", num_images=n_prompts * noises,
                              steps=steps, resolution=32, guidance=1.0, negative_prompt=None, grid="scheduler",
                              seed_offset=seed_offset, batch_size=64, device="cpu", dtype="fp32", output=out_dir)
    sample(args)
    rows = [json.loads(line) for line in open(os.path.join(out_dir, "scores.jsonl"))]
    images = np.stack([np.asarray(Image.open(os.path.join(out_dir, "images", f"{i:05d}.png"))) for i in range(len(rows))])
    fits = [d.fit for im in images for d in detect(im)]
    table = tag_gains([r["shapes/strict"] for r in rows], None, [r["tag"] for r in rows],
                      [r["composition"] for r in rows])
    fits_a = np.asarray(fits)
    return {
        "model": model, "images": len(rows), "noises": noises,
        "by_tag": {r.tag: {"strict": r.before, "compositions": r.compositions, "images": r.images,
                           "se": math.sqrt(max(r.before * (1 - r.before), 1e-12) / max(r.images, 1))} for r in table},
        "reward_mean": float(np.mean([r["reward"] for r in rows])),
        "shape_fit": {"objects": len(fits), "p10": float(np.percentile(fits_a, 10)), "p50": float(np.median(fits_a)),
                      "p90": float(np.percentile(fits_a, 90)),
                      **{f"above_{t}": float((fits_a >= t).mean()) for t in (SHAPE_MIN_FIT, 0.7, 0.85)}},
        "diversity": within_prompt_diversity(images.transpose(0, 3, 1, 2), [r["composition"] for r in rows]),
    }


def markdown(results: list[dict]) -> str:
    tags = list(results[0]["by_tag"])
    head = "| model | " + " | ".join(tags) + " | reward | fit p10 / p50 | fit ≥ 0.5 / 0.7 | diversity |"
    lines = [head, "|" + "---|" * (len(tags) + 5)]
    for r in results:
        cells = [f"{100 * r['by_tag'][t]['strict']:.1f}" for t in tags]
        f = r["shape_fit"]
        lines.append(f"| {Path(r['model']).name} | " + " | ".join(cells) +
                     f" | {r['reward_mean']:.3f} | {f['p10']:.2f} / {f['p50']:.2f} | "
                     f"{100 * f['above_0.5']:.0f}% / {100 * f['above_0.7']:.0f}% | {r['diversity']:.3f} |")
    comps = " / ".join(f"{t} {results[0]['by_tag'][t]['compositions']}" for t in tags)
    return "\n".join(lines) + f"\n\nHeld-out strict accuracy (%), every composition weighted equally; compositions: {comps}."


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", nargs="+", default=[str(REPO / "verl_diffusion" / "assets" / "shapes_sd3")])
    p.add_argument("--prompts", default=str(REPO / "verl_diffusion" / "data" / "shapes" / "test.parquet"))
    p.add_argument("--noises", type=int, default=2, help="noise seeds per prompt")
    p.add_argument("--steps", type=int, default=10, help="ODE steps")
    p.add_argument("--seed-offset", type=int, default=0, help="first noise seed")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    results = []
    for model in a.model:
        with tempfile.TemporaryDirectory() as tmp:
            results.append(profile(model, a.prompts, a.noises, a.steps, tmp, a.seed_offset))
        print(json.dumps(results[-1]), flush=True)
    print(markdown(results))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
