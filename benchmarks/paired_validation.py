"""Paired held-out gain between two validations of the same images, per tag and over the tags.

    python benchmarks/paired_validation.py RUN_A/validation/step_00040.jsonl RUN_B/validation/step_00048.jsonl

The two files are validation score files a run writes (``<run dir>/validation/step_<k>.jsonl``): the same prompts and
noise seeds in the same order, from one run (step 0 against the last step) or from two runs of one validation set
(two settings' final models). Prints, per per-image strict accuracy, each tag's composition-weighted accuracy in A and
in B and the difference B − A with its paired standard error (trainer/tag_report.py), the table the trainer prints at
the end of a run. A paired difference between two runs' final validations is how shapes_run.md tells two settings
apart on one seed.
"""

from __future__ import annotations

import argparse
import sys

from verl_diffusion.trainer.validation import paired_tag_tables, read_validation_scores


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a", help="validation scores A (the 'before' column)")
    ap.add_argument("b", help="validation scores B (the 'after' column), the same images as A")
    args = ap.parse_args(argv)
    first, last = read_validation_scores(args.a), read_validation_scores(args.b)
    if not first or [(r["prompt"], r["seed"]) for r in first] != [(r["prompt"], r["seed"]) for r in last]:
        print(f"paired_validation: {args.a} and {args.b} are not validations of the same images "
              "(the same prompts and seeds in the same order)", file=sys.stderr)
        return 2
    if "composition" not in first[0]:
        print(f"paired_validation: {args.a} has no composition column (not a tagged validation set)", file=sys.stderr)
        return 2
    lines, _ = paired_tag_tables(first, last, before="A", after="B")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
