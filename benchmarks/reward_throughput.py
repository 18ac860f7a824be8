#!/usr/bin/env python
"""Reward throughput on the CPU (images per second): OCR and JPEG, sequential against thread and process
pools, in one run.

    python benchmarks/reward_throughput.py                    # prints a markdown table
    python benchmarks/reward_throughput.py --out benchmarks/results/reward_throughput.md

Images are 512x512 renderings of a text line on a textured background (OCR has something to read; JPEG
sees a realistic mix of flat and busy regions). Each configuration is warmed up once (engine load, pool
start-up: reported separately), then timed over --repeats calls of one --batch-size batch.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from verl_diffusion.rewards import build_reward

WORDS = ["Fresh Bread Daily", "Night Owl Cafe", "Quiz On Friday", "Par Avion", "Go Team Go", "Next Fuel 80 Miles"]


def make_batch(n: int, size: int, seed: int = 0) -> tuple[list[np.ndarray], list[str]]:
    rng = np.random.default_rng(seed)
    font = ImageFont.load_default(size=size // 14)
    images, prompts = [], []
    for i in range(n):
        base = rng.normal(200, 25, (size // 8, size // 8, 3)).clip(0, 255).astype(np.uint8)
        img = Image.fromarray(base).resize((size, size), Image.BICUBIC)
        word = WORDS[i % len(WORDS)]
        ImageDraw.Draw(img).text((size // 16, size // 2), word, fill=(20, 20, 20), font=font)
        images.append(np.asarray(img))
        prompts.append(f'a photo of a sign that says "{word}"')
    return images, prompts


def bench(name: str, executor: str, workers: int, options: dict, images, prompts, repeats: int) -> dict:
    meta = [{}] * len(images)
    t0 = time.perf_counter()
    reward = build_reward({name: 1.0}, options={name: options}, executor=executor, max_workers=workers)
    first = reward(images, prompts, meta)
    warm = time.perf_counter() - t0
    assert first.failures[name] == 0, first.metrics
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        reward(images, prompts, meta)
        times.append(time.perf_counter() - t)
    reward.close()
    best, med = min(times), float(np.median(times))
    return {"reward": name, "executor": executor, "workers": workers if executor != "sync" else 1,
            "options": options, "batch": len(images), "warmup_s": warm,
            "ips_median": len(images) / med, "ips_best": len(images) / best,
            "mean_score": float(first.scores.mean())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--ocr-batch", type=int, default=16)
    p.add_argument("--jpeg-batch", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", help="write the markdown table here as well")
    args = p.parse_args(argv)

    w = args.workers
    rows = []
    images, prompts = make_batch(args.jpeg_batch, args.size)
    for ex in ("sync", "thread", "process"):
        rows.append(bench("jpeg_compressibility", ex, w, {}, images, prompts, args.repeats))
    images, prompts = make_batch(args.ocr_batch, args.size)
    rows.append(bench("ocr", "sync", w, {}, images, prompts, args.repeats))
    rows.append(bench("ocr", "sync", w, {"num_threads": 1}, images, prompts, args.repeats))
    for ex in ("thread", "process"):
        rows.append(bench("ocr", ex, w, {"num_threads": 1}, images, prompts, args.repeats))

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average {load:.2f} at start "
        f"of the last row; python {sys.version.split()[0]}; images {args.size}x{args.size}.",
        "",
        "| reward | executor | workers | options | batch | images/s (median) | images/s (best) | warm-up s | mean score |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        opts = ", ".join(f"{k}={v}" for k, v in r["options"].items()) or "-"
        lines.append(f"| {r['reward']} | {r['executor']} | {r['workers']} | {opts} | {r['batch']} | "
                     f"{r['ips_median']:.1f} | {r['ips_best']:.1f} | {r['warmup_s']:.2f} | {r['mean_score']:.3f} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        cmd = "python benchmarks/reward_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "w") as f:
            f.write("# Reward throughput on the CPU\n\n")
            f.write(f"Command: `{cmd.strip()}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
