#!/usr/bin/env python
"""Flow-GRPO OCR prompts (a prompt per line, target text in the first pair of double quotes) -> verl parquet.

    python -m verl_diffusion.data_process.ocr --input ~/flow_grpo/dataset/ocr --output ~/data/ocr
    python -m verl_diffusion.data_process.ocr --test data_process/samples/ocr/test.txt --output /tmp/ocr

reward_model.ground_truth holds the target text, which the ocr reward scores against. A line without a
non-empty quoted target fails with its file and line number.
"""

from __future__ import annotations

import sys

from verl_diffusion.data_process._common import InputError, make_row, read_prompts, run

FILES = {"train": "train.txt", "test": "test.txt"}


def read(path: str, max_samples: int = -1) -> list[tuple[str, str]]:
    """(prompt, target) per line."""
    out = []
    for lineno, text in read_prompts(path, max_samples):
        parts = text.split('"')
        if len(parts) < 3:
            raise InputError(path, lineno, 'no target text: the prompt needs the text to render between double quotes, e.g. a sign that says "Open"')
        if not parts[1].strip():
            raise InputError(path, lineno, 'empty target text between the first pair of double quotes')
        out.append((text, parts[1]))
    return out


def to_row(entry: tuple[str, str], *, split: str, index: int, args) -> dict:
    text, target = entry
    return make_row(text, split=split, index=index, data_source=args.data_source, ability="ocr",
                    ground_truth=target, negative_prompt=args.negative_prompt)


def main(argv: list[str] | None = None) -> int:
    return run(argv, description=__doc__, file_names=FILES, default_output="~/data/ocr",
               read=read, to_row=to_row, prompt_of=lambda entry: entry[0],
               extra_args=lambda p: p.add_argument("--data-source", default="ocr", help="data_source column (default: %(default)s)"))


if __name__ == "__main__":
    sys.exit(main())
