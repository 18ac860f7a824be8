#!/usr/bin/env python
"""Shapes-world reward: strict accuracy of the detector on ground-truth renders, clean and with the
degradations a small VAE introduces, and its speed (images per second, one process).

    python benchmarks/shapes_reward.py                      # prints a markdown table
    python benchmarks/shapes_reward.py --out benchmarks/results/shapes_reward.md

Each row renders --n scenes that satisfy random train prompts (all templates), degrades them (Gaussian
blur of sigma pixels at 32 px, scaled with the size; a uniform global shift of up to `shift` levels per
channel; Gaussian pixel noise of std `noise`) and reports the fraction scored strict (should be ~1) and
the mean reward. The last column scores the same images against another random prompt of the same tag
that the scene does not satisfy (should be 0).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from verl_diffusion.shapes.detect import score
from verl_diffusion.shapes.detect import satisfies
from verl_diffusion.shapes.world import BACKGROUND, compositions, make_metadata, render, sample_prompt, scene_for

HEADER = """# Shapes-world reward: detector accuracy and speed

Command: `python benchmarks/shapes_reward.py --n {n} --sizes {sizes} --out benchmarks/results/shapes_reward.md`
(one process, 2-core CPU shared with other jobs, load average {load:.1f} at the start of the last row).

Ground-truth renders of random train prompts (all templates), degraded as a small VAE would: Gaussian blur σ
(pixels at 32 px, scaled with the size), a uniform global colour shift of up to ±shift levels per channel, pixel
noise of std `noise`, colours pulled towards the background (saturation 0.6: 60% of the way out, a washed-out
VAE). "Other prompt": the same image scored against another prompt of the same tag that the
scene does not satisfy (should be 0). images/s times `score` only.

"""
FOOTER = """
Each degradation alone leaves the detector exact; σ = 1 px, ±20 levels and noise 8 together (and washed out
to 60 %) cost 0–2 points; the harsher last row of each size costs ~10 points (small diamonds and squares blur
towards circles). images/s varies ±50 % with the load of the shared machine.
"""
# (blur sigma at 32 px, global shift, pixel noise, saturation: colours pulled towards the background)
DEGRADATIONS = [(0.0, 0, 0, 1.0), (0.7, 0, 0, 1.0), (1.0, 0, 0, 1.0), (0.0, 20, 0, 1.0), (0.0, 0, 8, 1.0),
                (0.0, 0, 0, 0.6), (1.0, 20, 8, 1.0), (1.0, 20, 8, 0.6), (1.4, 30, 12, 1.0)]


def degrade(img: np.ndarray, rng: np.random.Generator, sigma: float, shift: float, noise: float,
            saturation: float = 1.0) -> np.ndarray:
    f = img.astype(np.float64)
    bg = np.asarray(BACKGROUND, dtype=np.float64)
    f = bg + saturation * (f - bg)
    if sigma > 0:
        r = int(np.ceil(3 * sigma))
        x = np.arange(-r, r + 1)
        k = np.exp(-x ** 2 / (2 * sigma ** 2))
        k /= k.sum()
        h, w = f.shape[:2]
        f = np.pad(f, ((r, r), (0, 0), (0, 0)), mode="edge")
        f = sum(k[i] * f[i:i + h] for i in range(2 * r + 1))
        f = np.pad(f, ((0, 0), (r, r), (0, 0)), mode="edge")
        f = sum(k[i] * f[:, i:i + w] for i in range(2 * r + 1))
    f = f + rng.uniform(-shift, shift, 3) + rng.normal(0.0, noise, f.shape)
    return np.clip(np.rint(f), 0, 255).astype(np.uint8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="also write the table with its heading and command to this markdown file")
    args = ap.parse_args()
    lines = ["| size | blur σ (px @32) | shift | noise | saturation | strict (own prompt) | reward (own) | "
             "strict (other prompt) | images/s |", "|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for size in args.sizes:
        for sigma, shift, noise, sat in DEGRADATIONS:
            rng = np.random.default_rng(args.seed)
            strict, reward, wrong, n_wrong, secs = 0, 0.0, 0, 0, 0.0
            for _ in range(args.n):
                _, meta = sample_prompt(rng, "train")
                scene = scene_for(meta, rng, size)
                img = degrade(render(scene, size), rng, sigma * size / 32, shift, noise, sat)
                t = time.perf_counter()
                res = score(img, meta)
                secs += time.perf_counter() - t
                strict += res.strict
                reward += res.reward
                comps = compositions(meta["tag"])
                other = make_metadata(meta["tag"], comps[int(rng.integers(len(comps)))])
                if not satisfies(scene, other):
                    wrong += score(img, other).strict
                    n_wrong += 1
            lines.append(f"| {size} | {sigma} | {shift} | {noise} | {sat} | {strict / args.n:.3f} | {reward / args.n:.3f} | "
                         f"{wrong / max(n_wrong, 1):.3f} (n={n_wrong}) | {args.n / secs:.0f} |")
            print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(HEADER.format(n=args.n, sizes=" ".join(map(str, args.sizes)), load=os.getloadavg()[0])
                    + "\n".join(lines) + "\n" + FOOTER)


if __name__ == "__main__":
    main()
