#!/usr/bin/env python
"""Shapes-world prompts (verl_diffusion/shapes) -> verl parquet: RL-train prompts and held-out prompts.

    python -m verl_diffusion.data_process.shapes --output ~/data/shapes
    python -m verl_diffusion.data_process.shapes --output /tmp/shapes --train-size 512 --test-per-tag 8 --seed 1

Generated, not read: train.parquet holds ``--train-size`` prompts drawn from the train split of the
compositions (tags uniformly; verl_diffusion.shapes.world.sample_prompt), test.parquet holds every held-out
composition of every tag, each the same number of times, at least ``--test-per-tag`` prompts per tag
(world.balanced_prompts; a tag with more compositions than that, position, gets one prompt per composition).
Both are deterministic from ``--seed``. ``--train-eval`` also writes train_eval.parquet, the same for the
train split's compositions, to compare accuracy on seen and unseen compositions.

Rows are the common format of data_process/_common.py: reward_model.ground_truth holds the GenEval-style
metadata as JSON text (what the ``shapes`` reward reads), extra_info.tag its tag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from verl_diffusion.data_process._common import check_output_dir, make_row, write_parquet


def rows_for(prompts: list[tuple[str, dict]], *, split: str, data_source: str, negative_prompt: str) -> list[dict]:
    return [make_row(text, split=split, index=i, data_source=data_source, ability="shapes",
                     ground_truth=json.dumps(meta), negative_prompt=negative_prompt, tag=meta["tag"])
            for i, (text, meta) in enumerate(prompts)]


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from verl_diffusion.shapes.world import TAGS, balanced_prompts, sample_prompt

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="~/data/shapes", help="output directory (~ is expanded) (default: %(default)s)")
    parser.add_argument("--train-size", type=int, default=4096, help="train prompts (default: %(default)s)")
    parser.add_argument("--test-per-tag", type=int, default=16, help="at least this many held-out prompts per tag, every held-out composition equally often "
                        "(default: %(default)s)")
    parser.add_argument("--train-eval", action="store_true", help="also write train_eval.parquet (train split, per tag)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt draws (default: %(default)s)")
    parser.add_argument("--data-source", default="shapes", help="data_source column (default: %(default)s)")
    parser.add_argument("--negative-prompt", default="", help="negative prompt stored with every row (default: empty)")
    parser.add_argument("--tags", default=None,
                        help="comma-separated tags to keep in every file (default: all of world.TAGS)")
    args = parser.parse_args(argv)
    for name in ("train_size", "test_per_tag"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    tags = TAGS if args.tags is None else tuple(t.strip() for t in args.tags.split(",") if t.strip())
    unknown = [t for t in tags if t not in TAGS]
    if unknown or not tags:
        print(f"error: --tags {args.tags!r}: {unknown or 'empty'} not accepted; choose from {list(TAGS)}", file=sys.stderr)
        return 2
    try:
        out_dir = check_output_dir(args.output)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rng = np.random.default_rng(args.seed)
    splits = {
        "train": [sample_prompt(rng, "train", tags) for _ in range(args.train_size)],
        "test": balanced_prompts(args.test_per_tag, seed=args.seed, split="heldout", tags=tags),
    }
    if args.train_eval:
        splits["train_eval"] = balanced_prompts(args.test_per_tag, seed=args.seed, split="train", tags=tags)
    for split, prompts in splits.items():
        path = os.path.join(out_dir, f"{split}.parquet")
        write_parquet(rows_for(prompts, split=split, data_source=args.data_source,
                               negative_prompt=args.negative_prompt), path)
        print(f"wrote {len(prompts)} {split} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
