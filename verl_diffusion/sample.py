"""Sample and score a model: ``python -m verl_diffusion.sample --model DIR [--lora DIR] --output DIR [...]``.

Draws one image per (prompt, noise seed) with the ODE sampler the run's validation uses (rollout/diffusers_rollout.py:
image i starts from ``randn`` seeded with ``seed_offset + i``, prompts repeated in file order up to
``--num-images``), scores the images with ``--reward`` against each prompt's own ground truth, and writes
``images/<i>.png``, ``scores.jsonl`` (one line per image: prompt, seed, reward and its per-image details),
``summary.json`` (mean reward, strict accuracy where the reward has one) and a captioned ``grid.png``.

``--model`` is a diffusers pipeline folder: a run's exported ``model/`` (full fine-tune), or the base model with
``--lora <run_dir>/model`` for a LoRA run. The sampling settings default to those the run validated with
(``export_info.json`` beside the weights: steps, size, guidance, grid, the validation prompt file and image count),
so ``--model <run>/model --reward shapes`` reproduces the run's final validation. Deterministic for a given device.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional


def export_info(model: str, lora: Optional[str]) -> dict:
    """``export_info.json`` of the LoRA folder, else of the model folder ({} when absent)."""
    for folder in (lora, model):
        if folder and os.path.isfile(os.path.join(folder, "export_info.json")):
            with open(os.path.join(folder, "export_info.json")) as f:
                return json.load(f)
    return {}


def load_adapter(model: str, lora: Optional[str], *, device: str, dtype: str):
    """Our adapter over the stock pipeline loaded from ``model``, with ``lora`` loaded by diffusers'
    ``load_lora_weights`` (the transformer the sampler calls is the pipeline's own)."""
    import torch
    from diffusers.utils import logging as diffusers_logging

    from verl_diffusion.models import adapter_for_path

    diffusers_logging.disable_progress_bar()   # the loading bars: the command prints its own progress
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    adapter = adapter_for_path(model).from_pretrained(model, dtype=dtypes[dtype], device=device)
    if lora:
        adapter.pipe.load_lora_weights(lora)
        adapter.transformer = adapter.pipe.transformer
    adapter.transformer.eval()
    return adapter


def sample(args) -> dict:
    import torch

    from verl_diffusion.run_setup import resolve_path
    from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout, RolloutConfig
    from verl_diffusion.trainer.dataset import METADATA_KEYS, PromptDataset
    from verl_diffusion.trainer.validation import (
        pick_examples, read_validation_scores, save_sheet, write_validation_scores)

    info = export_info(args.model, args.lora)
    s = info.get("sampling") or {}
    prompt_file = args.prompts or (s.get("val_files") or [None])[0]
    if not prompt_file:
        raise ValueError("--prompts is required (the model has no export_info.json naming its validation prompts)")
    dataset = PromptDataset([resolve_path(prompt_file)])
    n = int(args.num_images or s.get("num_images") or len(dataset))
    rows = [dataset[i % len(dataset)] for i in range(n)]
    prompts = [r["prompt"] for r in rows]
    meta = [{k: r[k] for k in METADATA_KEYS if k in r} for r in rows]
    seeds = [args.seed_offset + i for i in range(n)]
    size = int(args.resolution or s.get("resolution", 512))
    steps = int(args.steps or s.get("num_steps", 28))
    cfg = RolloutConfig(num_steps=steps, grid=str(args.grid or s.get("grid", "scheduler")),
                        shift=float(s.get("shift", 3.0)), sampler="ode",
                        guidance_scale=float(args.guidance if args.guidance is not None else s.get("guidance_scale", 1.0)),
                        negative_prompt=str(s.get("negative_prompt", "") if args.negative_prompt is None
                                            else args.negative_prompt),
                        height=size, width=size, micro_batch_size=int(args.batch_size), val_num_steps=steps)
    adapter = load_adapter(args.model, args.lora, device=args.device, dtype=args.dtype or s.get("dtype", "fp32"))
    rollout = DiffusersRollout(adapter, cfg)
    images = []
    for lo in range(0, n, args.batch_size):
        with torch.no_grad():
            images.append(rollout.generate_ode(prompts[lo:lo + args.batch_size], seeds=seeds[lo:lo + args.batch_size]))
        print(f"sampled {min(lo + args.batch_size, n)}/{n}", file=sys.stderr, flush=True)
    images = torch.cat(images)
    out = os.path.abspath(args.output)
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    from PIL import Image

    for i, img in enumerate(images):
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(os.path.join(out, "images", f"{i:05d}.png"))
    summary = {"model": os.path.abspath(args.model), "lora": os.path.abspath(args.lora) if args.lora else None,
               "prompts": prompt_file, "num_images": n, "seed_offset": args.seed_offset,
               "sampling": {"num_steps": steps, "resolution": size, "guidance_scale": cfg.guidance_scale,
                            "negative_prompt": cfg.negative_prompt, "grid": cfg.grid}}
    rows_out: list = []
    if args.reward:
        from verl_diffusion.rewards import build_reward

        from verl_diffusion.trainer.tag_report import composition_key, tag_gains, tag_of

        res = build_reward({args.reward: 1.0})(images, prompts, meta)
        groups = {"tag": [tag_of(m) for m in meta], "composition": [composition_key(m, p) for m, p in zip(meta, prompts)]}
        scores = write_validation_scores(os.path.join(out, "scores.jsonl"), prompts, seeds, res.scores,
                                         res.details or {}, columns=groups)
        rows_out = read_validation_scores(scores)
        summary["reward_mean"] = float(res.scores.float().mean())
        # the overall strict accuracy of a reward (reward/<name>/strict), named as validation names it
        summary.update({k[len("reward/"):] if k.startswith("reward/") else k: float(v)
                        for k, v in (res.metrics or {}).items() if k.endswith("/strict") and isinstance(v, (int, float))})
        # per tag, every composition weighted equally (trainer/tag_report.py), when the prompts carry tags
        for key in [k for k in (res.details or {}) if k.endswith("/strict")]:
            if any(t != "untagged" for t in groups["tag"]):
                table = tag_gains(res.details[key].float().tolist(), None, groups["tag"], groups["composition"])
                summary[key + "/by_tag"] = {r.tag: r.before for r in table}
    else:
        with open(os.path.join(out, "scores.jsonl"), "w") as f:
            for p, sd in zip(prompts, seeds):
                f.write(json.dumps({"prompt": p, "seed": sd}) + "\n")
    save_sheet([images], os.path.join(out, "grid.png"), prompts=prompts, idx=pick_examples(prompts, 48),
               row_sets=[rows_out], thumb=160, cols=6)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_diffusion.sample",
                                description="Sample a diffusers model on a prompt file and score the images.")
    p.add_argument("--model", required=True, help="a diffusers pipeline folder (a run's exported model/, or the base)")
    p.add_argument("--lora", default=None, help="a LoRA folder in diffusers' format (a LoRA run's model/)")
    p.add_argument("--prompts", default=None,
                   help=".parquet / .jsonl / .txt prompt file (default: the run's validation prompts)")
    p.add_argument("--reward", default=None, help="a reward name (shapes, ocr, pickscore, jpeg_compressibility, ...)")
    p.add_argument("--num-images", type=int, default=None,
                   help="images to draw, prompts repeated in order (default: the run's validation count, else one "
                        "per prompt)")
    p.add_argument("--steps", type=int, default=None, help="ODE steps (default: the run's validation steps)")
    p.add_argument("--resolution", type=int, default=None, help="image size in pixels (default: the run's)")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale (default: the run's)")
    p.add_argument("--negative-prompt", default=None)
    p.add_argument("--grid", choices=("scheduler", "formula"), default=None,
                   help="sampling grid (default: the run's; scheduler = the stock pipeline's)")
    p.add_argument("--seed-offset", type=int, default=0, help="image i starts from the noise of seed offset + i")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="the pipeline's dtype (default: the run's model.dtype, else fp32)")
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    try:
        summary = sample(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"sample error: {e}", file=sys.stderr)
        sys.exit(2)
    parts = [f"{summary['num_images']} images"]
    if "reward_mean" in summary:
        parts.append(f"reward {summary['reward_mean']:.4f}")
    parts += [f"{k} {v:.4f}" for k, v in summary.items() if k.endswith("/strict")]
    print(" | ".join(parts))
    for key, by_tag in ((k, v) for k, v in summary.items() if k.endswith("/by_tag")):
        print(f"{key[:-len('/by_tag')]} per tag, every composition weighted equally: "
              + ", ".join(f"{t} {100 * v:.1f}%" for t, v in by_tag.items()))
    print(f"output: {os.path.abspath(args.output)} (images/, scores.jsonl, summary.json, grid.png)")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


if __name__ == "__main__":
    main()
