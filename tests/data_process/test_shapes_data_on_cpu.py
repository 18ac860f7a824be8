"""data_process/shapes.py: the shapes world's prompts to verl parquet (issue 9)."""

import importlib.util
import json
import sys
from pathlib import Path

import pandas as pd

REPO = Path(__file__).resolve().parents[2]
DP = REPO / "data_process"


def _load(name):
    return importlib.import_module(f"verl_diffusion.data_process.{name}")


def _rlhf_dataset(path, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    cfg = OmegaConf.create({"filter_overlong_prompts": False, "cache_dir": str(tmp_path / "cache")})
    return RLHFDataset(data_files=str(path), tokenizer=None, config=cfg)


def test_shapes_world_prompts_to_parquet(tmp_path):
    """data_process/shapes.py: deterministic from the seed, train rows only from train compositions,
    test rows only held-out and balanced over tags, rows readable by RLHFDataset and by the shapes reward."""
    from verl_diffusion.rewards.geneval import geneval_metadata
    from verl_diffusion.shapes.world import TAGS, split_compositions, split_of

    shapes = _load("shapes")
    args = ["--train-size", "60", "--test-per-tag", "3", "--train-eval", "--seed", "5"]
    assert shapes.main(args + ["--output", str(tmp_path / "a")]) == 0
    assert shapes.main(args + ["--output", str(tmp_path / "b")]) == 0
    for name in ("train", "test", "train_eval"):
        a, b = pd.read_parquet(tmp_path / "a" / f"{name}.parquet"), pd.read_parquet(tmp_path / "b" / f"{name}.parquet")
        assert a.equals(b)
    train, test = pd.read_parquet(tmp_path / "a" / "train.parquet"), pd.read_parquet(tmp_path / "a" / "test.parquet")
    # every held-out composition, each equally often, at least 3 per tag
    per_tag = {t: len(split_compositions(t, "heldout")) * -(-3 // len(split_compositions(t, "heldout"))) for t in TAGS}
    assert (len(train), len(test)) == (60, sum(per_tag.values()))
    metas = {s: [geneval_metadata({"reward_model": r}) for r in df.reward_model] for s, df in (("train", train), ("test", test))}
    assert all(split_of(m) == "train" for m in metas["train"]) and all(split_of(m) == "heldout" for m in metas["test"])
    assert sorted(m["tag"] for m in metas["test"]) == sorted(t for t in TAGS for _ in range(per_tag[t]))
    assert [e["tag"] for e in test.extra_info] == [m["tag"] for m in metas["test"]]
    other = tmp_path / "c"
    assert shapes.main(["--train-size", "60", "--seed", "6", "--output", str(other)]) == 0
    assert not pd.read_parquet(other / "train.parquet").equals(train)
    ds = _rlhf_dataset(tmp_path / "a" / "train.parquet", tmp_path)
    item = ds[2]
    assert item["raw_prompt"][-1]["content"] == json.loads(item["reward_model"]["ground_truth"])["prompt"]
    assert shapes.main(["--train-size", "0", "--output", str(other)]) == 2


def test_shapes_output_naming_a_file_is_one_line(tmp_path, capsys):
    """As for the other data scripts: --output naming a file (or a path under one) is one error line, exit 2."""
    shapes = _load("shapes")
    f = tmp_path / "taken"
    f.write_text("x")
    for out in (f, f / "sub"):
        assert shapes.main(["--train-size", "4", "--output", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: --output") and "is a file" in err[0], err


def test_shapes_tags_keep_only_those_tags(tmp_path, capsys):
    """--tags: every file holds only the listed tags, and a tag's held-out prompts are the same rows as in the
    all-tag file (balanced_prompts draws each tag on its own); an unknown tag is one error line, exit 2."""
    from verl_diffusion.shapes.world import TAGS, split_compositions

    shapes = _load("shapes")
    keep = ["colors", "two_object"]
    n_test = {t: len(split_compositions(t, "heldout")) * -(-4 // len(split_compositions(t, "heldout"))) for t in TAGS}
    n_train_eval = {t: len(split_compositions(t, "train")) * -(-4 // len(split_compositions(t, "train"))) for t in TAGS}
    assert shapes.main(["--train-size", "40", "--test-per-tag", "4", "--train-eval", "--tags", ",".join(keep),
                        "--output", str(tmp_path / "k")]) == 0
    assert shapes.main(["--train-size", "4", "--test-per-tag", "4", "--output", str(tmp_path / "all")]) == 0
    for name, n in (("train", 40), ("test", sum(n_test[t] for t in keep)),
                    ("train_eval", sum(n_train_eval[t] for t in keep))):
        tags = [e["tag"] for e in pd.read_parquet(tmp_path / "k" / f"{name}.parquet").extra_info]
        assert len(tags) == n and set(tags) == set(keep), (name, tags)
    kept = pd.read_parquet(tmp_path / "k" / "test.parquet")
    full = pd.read_parquet(tmp_path / "all" / "test.parquet")
    full_kept = [r["ground_truth"] for r, e in zip(full.reward_model, full.extra_info) if e["tag"] in keep]
    assert [r["ground_truth"] for r in kept.reward_model] == full_kept and len(full) == sum(n_test.values())
    capsys.readouterr()
    assert shapes.main(["--tags", "colors,shape", "--output", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tags" in err[0] and "'shape'" in err[0] and "counting" in err[0], err
