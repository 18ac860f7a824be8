#!/usr/bin/env python
"""GenEval metadata (*_metadata.jsonl: tag, include / exclude requirements, prompt) -> verl parquet.

    python -m verl_diffusion.data_process.geneval --input ~/flow_grpo/dataset/geneval --output ~/data/geneval
    python -m verl_diffusion.data_process.geneval --test data_process/samples/geneval/test_metadata.jsonl --output /tmp/geneval

reward_model.ground_truth holds the line's metadata as JSON text (exactly what the GenEval reward server
receives); extra_info.tag its tag, for per-tag validation accuracy. Each line is checked: ``tag`` and
``prompt`` non-empty strings; ``include`` a non-empty list and ``exclude`` (optional) a list of
requirements ``{class: str, count: int >= 1, color?: str, position?: [relation, index of an earlier
include]}``.
"""

from __future__ import annotations

import json
import sys

from verl_diffusion.data_process._common import InputError, make_row, read_jsonl, run

FILES = {"train": "train_metadata.jsonl", "test": "test_metadata.jsonl"}
RELATIONS = ("left of", "right of", "above", "below")


def check(meta: dict, path: str, lineno: int) -> None:
    def bad(reason: str) -> InputError:
        return InputError(path, lineno, reason)

    for key in ("tag", "prompt"):
        if not isinstance(meta.get(key), str) or not meta[key].strip():
            raise bad(f"{key!r} must be a non-empty string, got {meta.get(key)!r}")
    if not isinstance(meta.get("include"), list) or not meta["include"]:
        raise bad(f"'include' must be a non-empty list of requirements, got {meta.get('include')!r}")
    if not isinstance(meta.get("exclude", []), list):
        raise bad(f"'exclude' must be a list, got {meta['exclude']!r}")
    for part in ("include", "exclude"):
        for j, req in enumerate(meta.get(part, [])):
            where = f"{part}[{j}]"
            if not isinstance(req, dict):
                raise bad(f"{where} must be an object, got {req!r}")
            if not isinstance(req.get("class"), str) or not req["class"].strip():
                raise bad(f"{where}.class must be a non-empty string, got {req.get('class')!r}")
            count = req.get("count")
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise bad(f"{where}.count must be an integer >= 1, got {count!r}")
            if "color" in req and not isinstance(req["color"], str):
                raise bad(f"{where}.color must be a string, got {req['color']!r}")
            if "position" in req:
                pos = req["position"]
                ok = (isinstance(pos, list) and len(pos) == 2 and pos[0] in RELATIONS and isinstance(pos[1], int)
                      and 0 <= pos[1] < len(meta["include"]) and not (part == "include" and pos[1] == j))
                if not ok:
                    raise bad(f"{where}.position must be [one of {list(RELATIONS)}, index of another include "
                              f"requirement], got {pos!r}")


def read(path: str, max_samples: int = -1) -> list[dict]:
    out = []
    for lineno, meta in read_jsonl(path, max_samples):
        check(meta, path, lineno)
        out.append(meta)
    return out


def to_row(meta: dict, *, split: str, index: int, args) -> dict:
    return make_row(meta["prompt"], split=split, index=index, data_source=args.data_source, ability="geneval",
                    ground_truth=json.dumps(meta, ensure_ascii=False), negative_prompt=args.negative_prompt,
                    tag=meta["tag"])


def main(argv: list[str] | None = None) -> int:
    return run(argv, description=__doc__, file_names=FILES, default_output="~/data/geneval",
               read=read, to_row=to_row, prompt_of=lambda meta: meta["prompt"],
               extra_args=lambda p: p.add_argument("--data-source", default="geneval", help="data_source column (default: %(default)s)"))


if __name__ == "__main__":
    sys.exit(main())
