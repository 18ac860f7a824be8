#!/usr/bin/env python
"""Prompt-per-line sets (Flow-GRPO's pickscore, DrawBench, ...) -> verl parquet for preference rewards.

    python -m verl_diffusion.data_process.pickscore --input ~/flow_grpo/dataset/pickscore --output ~/data/pickscore
    python -m verl_diffusion.data_process.pickscore --test ~/flow_grpo/dataset/drawbench/test.txt --data-source drawbench \
        --output ~/data/drawbench

No ground truth: reward_model.ground_truth is "" (PickScore, aesthetic and JPEG rewards read only the
image and the prompt).
"""

from __future__ import annotations

import sys

from verl_diffusion.data_process._common import make_row, read_prompts, run

FILES = {"train": "train.txt", "test": "test.txt"}


def read(path: str, max_samples: int = -1) -> list[str]:
    return [text for _, text in read_prompts(path, max_samples)]


def to_row(text: str, *, split: str, index: int, args) -> dict:
    return make_row(text, split=split, index=index, data_source=args.data_source, ability="preference",
                    negative_prompt=args.negative_prompt)


def main(argv: list[str] | None = None) -> int:
    return run(argv, description=__doc__, file_names=FILES, default_output="~/data/pickscore",
               read=read, to_row=to_row,
               extra_args=lambda p: p.add_argument("--data-source", default="pickscore", help="data_source column (default: %(default)s)"))


if __name__ == "__main__":
    sys.exit(main())
