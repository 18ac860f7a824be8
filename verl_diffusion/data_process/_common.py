"""Shared helpers of the data_process scripts: strict readers that name file and line, the verl row
format, split handling and the command-line options every script takes.

Row format (one parquet row per prompt; the same columns for every dataset, so files can be mixed):

    prompt           [{"role": "user", "content": <prompt text>}]        chat messages, as verl's RLHFDataset reads
    negative_prompt  [{"role": "user", "content": <negative text>}]      "" unless --negative-prompt
    data_source      "ocr" | "pickscore" | "geneval" | --data-source
    ability          "ocr" | "preference" | "geneval"
    reward_model     {"style": "rule", "ground_truth": str}             OCR target text / GenEval metadata JSON / ""
    extra_info       {"split": str, "index": int, "prompt_text": str, "tag": str}
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

SPLITS = ("train", "test")


class InputError(ValueError):
    """A malformed input file; the message is ``<file>:<line>: <reason>``."""

    def __init__(self, path: str, line: int | None, reason: str):
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {reason}")


def iter_lines(path: str, max_samples: int = -1) -> Iterator[tuple[int, str]]:
    """(line number, stripped text) of each non-blank line; invalid UTF-8 or NUL bytes raise InputError."""
    count = 0
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InputError(path, lineno, f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
            if "\x00" in text:
                raise InputError(path, lineno, "contains a NUL byte; is this a binary file?")
            text = text.strip()
            if not text:
                continue
            yield lineno, text
            count += 1
            if 0 < max_samples <= count:
                return


def read_prompts(path: str, max_samples: int = -1) -> list[tuple[int, str]]:
    """A prompt per line (Flow-GRPO's train.txt / test.txt)."""
    return list(iter_lines(path, max_samples))


def read_jsonl(path: str, max_samples: int = -1) -> list[tuple[int, dict]]:
    """A JSON object per line."""
    out = []
    for lineno, text in iter_lines(path, max_samples):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(path, lineno, f"invalid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise InputError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
        out.append((lineno, obj))
    return out


def make_row(text: str, *, split: str, index: int, data_source: str, ability: str, ground_truth: str = "",
             negative_prompt: str = "", tag: str = "") -> dict:
    return {
        "prompt": [{"role": "user", "content": text}],
        "negative_prompt": [{"role": "user", "content": negative_prompt}],
        "data_source": data_source,
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "prompt_text": text, "tag": tag},
    }


def add_common_args(parser: argparse.ArgumentParser, *, file_names: dict[str, str], default_output: str) -> None:
    names = " and ".join(file_names.values())
    parser.add_argument("--input", help=f"directory holding {names} (either may be absent)")
    parser.add_argument("--train", help=f"train file (overrides --input/{file_names['train']})")
    parser.add_argument("--test", help=f"test file (overrides --input/{file_names['test']})")
    parser.add_argument("--output", default=default_output, help="output directory (~ is expanded); "
                        "writes train.parquet / test.parquet (default: %(default)s)")
    parser.add_argument("--train-size", type=int, default=-1, help="keep at most N train rows (-1: all)")
    parser.add_argument("--test-size", type=int, default=-1,
                        help="keep at most N test rows; without a test file, hold out N train prompts (every row "
                             "of each: GenEval repeats a prompt 4x) as the test split (seeded random choice) "
                             "(-1: all / no hold-out)")
    parser.add_argument("--max-samples", type=int, default=-1, help="read at most N entries per input file (-1: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the hold-out choice (default: %(default)s)")
    parser.add_argument("--negative-prompt", default="", help="negative prompt stored with every row (default: empty)")


def resolve_inputs(args: argparse.Namespace, file_names: dict[str, str]) -> dict[str, str]:
    """split -> existing input file, from --train/--test and --input; raises ValueError if none."""
    found = {}
    for split in SPLITS:
        explicit = getattr(args, split)
        if explicit:
            path = os.path.expanduser(explicit)
            if not os.path.isfile(path):
                raise ValueError(f"--{split} {explicit!r} is not a file")
            found[split] = path
        elif args.input:
            path = os.path.join(os.path.expanduser(args.input), file_names[split])
            if os.path.isfile(path):
                found[split] = path
    if args.input and not os.path.isdir(os.path.expanduser(args.input)):
        raise ValueError(f"--input {args.input!r} is not a directory")
    if not found:
        raise ValueError(f"no input: give --train/--test files or an --input directory with "
                         f"{' or '.join(file_names.values())}")
    return found


def check_sizes(args: argparse.Namespace) -> None:
    """--train-size / --test-size / --max-samples: -1 (all) or N >= 1; 0 would write an empty split."""
    for opt in ("train_size", "test_size", "max_samples"):
        n = getattr(args, opt)
        if n == 0 or n < -1:
            raise ValueError(f"--{opt.replace('_', '-')} {n}: give -1 (all) or N >= 1 (0 would write an empty split)")


def _unique_prompts(items: list, prompt_of: Callable[[Any], str]) -> list[str]:
    seen: dict[str, None] = {}
    for e in items:
        seen.setdefault(prompt_of(e), None)
    return list(seen)


def report_duplicates(entries: dict[str, list], prompt_of: Callable[[Any], str]) -> list[str]:
    """Lines describing repeated prompts inside a split and prompts shared by train and test."""
    lines = []
    for split, items in entries.items():
        unique = len(_unique_prompts(items, prompt_of))
        if unique < len(items):
            lines.append(f"note: {split}: {len(items)} rows hold {unique} unique prompts "
                         f"({len(items) - unique} rows repeat a prompt)")
    if "train" in entries and "test" in entries:
        shared = set(map(prompt_of, entries["train"])) & set(map(prompt_of, entries["test"]))
        if shared:
            lines.append(f"warning: {len(shared)} test prompt(s) also appear in train, e.g. {sorted(shared)[0]!r}")
    return lines


def split_entries(entries: dict[str, list], args: argparse.Namespace,
                  prompt_of: Callable[[Any], str] = str) -> dict[str, list]:
    """Apply --test-size (cap, or hold-out when there is no test file) and --train-size.

    The hold-out draws whole prompts: every row of a held-out prompt goes to test (GenEval's metadata
    repeats each prompt 4x; a row-wise draw would leak held-out prompts into train)."""
    out = dict(entries)
    if "test" not in out and args.test_size > 0 and "train" in out:
        train = list(out["train"])
        prompts = _unique_prompts(train, prompt_of)
        if args.test_size >= len(prompts):
            raise ValueError(f"--test-size {args.test_size} leaves no train prompts ({len(prompts)} unique prompts "
                             f"in the train file)")
        held = {prompts[i] for i in random.Random(args.seed).sample(range(len(prompts)), args.test_size)}
        out["test"] = [e for e in train if prompt_of(e) in held]
        out["train"] = [e for e in train if prompt_of(e) not in held]
    elif "test" in out and args.test_size > 0:
        out["test"] = out["test"][: args.test_size]
    if "train" in out and args.train_size > 0:
        out["train"] = out["train"][: args.train_size]
    return out


def write_parquet(rows: list[dict], path: str) -> None:
    import pandas as pd

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    pd.DataFrame(rows).to_parquet(path, index=False)


def check_output_dir(path: str) -> str:
    """--output must be a directory (existing or new), never a file."""
    out_dir = os.path.expanduser(path)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"--output {path!r} is a file; give a directory (train.parquet / test.parquet go inside)")
    parent = os.path.dirname(os.path.abspath(out_dir))
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if os.path.isfile(parent):
        raise ValueError(f"--output {path!r}: {parent!r} is a file, not a directory")
    return out_dir


def run(argv: list[str] | None, *, description: str, file_names: dict[str, str], default_output: str,
        read: Callable[[str, int], list], to_row: Callable[..., dict],
        extra_args: Callable[[argparse.ArgumentParser], None] | None = None,
        prompt_of: Callable[[Any], str] = str) -> int:
    """Common main(): parse, read every input strictly, split, write parquet, print a summary.
    ``read(path, max_samples)`` -> entries; ``to_row(entry, split=, index=, args=)`` -> row dict;
    ``prompt_of(entry)`` -> the prompt text (the unit of the hold-out split and of duplicate reports)."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser, file_names=file_names, default_output=default_output)
    if extra_args:
        extra_args(parser)
    args = parser.parse_args(argv)
    try:
        check_sizes(args)
        out_dir = check_output_dir(args.output)
        inputs = resolve_inputs(args, file_names)
        entries = {}
        for split, path in inputs.items():
            entries[split] = read(path, args.max_samples)
            if not entries[split]:
                raise InputError(path, None, "holds no entries (empty, or blank lines only)")
        entries = split_entries(entries, args, prompt_of)
        for line in report_duplicates(entries, prompt_of):
            print(line, file=sys.stderr)
        for split, items in entries.items():
            rows = [to_row(e, split=split, index=i, args=args) for i, e in enumerate(items)]
            path = os.path.join(out_dir, f"{split}.parquet")
            write_parquet(rows, path)
            print(f"wrote {len(rows)} {split} rows to {path}")
        for split in SPLITS:
            stale = os.path.join(out_dir, f"{split}.parquet")
            if split not in entries and os.path.isfile(stale):
                print(f"warning: {stale} was not written by this run (no {split} input) and is left from an earlier "
                      f"one; delete it, or pass --{split} to rewrite it", file=sys.stderr)
    except ValueError as e:  # InputError included: file, line and reason
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
