"""data_process/ scripts: sample inputs round-trip to parquet that verl's RLHFDataset reads; malformed
files fail with file, line and reason; the published Flow-GRPO prompt files convert whole."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[2]
DP = REPO / "data_process"
SAMPLES = DP / "samples"
SHARED = REPO.parent / "shared" / "datasets" / "flow_grpo"


def _load(name):
    sys.path.insert(0, str(DP))
    spec = importlib.util.spec_from_file_location(f"dp_{name}", DP / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ocr, pickscore, geneval = _load("ocr"), _load("pickscore"), _load("geneval")
from _common import InputError  # noqa: E402  (data_process/ is on sys.path now)


def _rlhf_dataset(path, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    cfg = OmegaConf.create({"filter_overlong_prompts": False, "cache_dir": str(tmp_path / "cache")})
    return RLHFDataset(data_files=str(path), tokenizer=None, config=cfg)


@pytest.mark.parametrize("script,n_train,n_test", [(ocr, 6, 3), (pickscore, 5, 2), (geneval, 6, 2)])
def test_sample_round_trip_through_rlhf_dataset(script, n_train, n_test, tmp_path):
    out = tmp_path / "out"
    assert script.main(["--input", str(SAMPLES / script.__name__[3:]), "--output", str(out)]) == 0
    train, test = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "test.parquet")
    assert (len(train), len(test)) == (n_train, n_test)
    ds = _rlhf_dataset(out / "train.parquet", tmp_path)
    assert len(ds) == n_train
    item = ds[1]
    text = item["raw_prompt"][-1]["content"]
    assert item["extra_info"]["prompt_text"] == text and item["extra_info"]["index"] == 1
    assert item["negative_prompt"][0]["content"] == ""
    gt = item["reward_model"]["ground_truth"]
    if script is ocr:
        assert f'"{gt}"' in text  # the target text is the quoted part of the prompt
    elif script is geneval:
        meta = json.loads(gt)
        assert meta["prompt"] == text and meta["tag"] == item["extra_info"]["tag"]
        from verl_diffusion.rewards.geneval import geneval_metadata

        original = json.loads((SAMPLES / "geneval" / "train_metadata.jsonl").read_text().splitlines()[1])
        assert geneval_metadata({"reward_model": item["reward_model"]}) == original
    else:
        assert gt == ""


def test_split_sizes_holdout_and_max_samples(tmp_path):
    out = tmp_path / "o"
    train_file = str(SAMPLES / "pickscore" / "train.txt")
    assert pickscore.main(["--train", train_file, "--test-size", "2", "--seed", "3", "--output", str(out)]) == 0
    tr, te = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "test.parquet")
    assert (len(tr), len(te)) == (3, 2)
    assert set(tr.extra_info.map(lambda e: e["prompt_text"])).isdisjoint(te.extra_info.map(lambda e: e["prompt_text"]))
    assert pickscore.main(["--input", str(SAMPLES / "pickscore"), "--max-samples", "2", "--train-size", "1",
                           "--output", str(out)]) == 0
    assert len(pd.read_parquet(out / "train.parquet")) == 1 and len(pd.read_parquet(out / "test.parquet")) == 2


def test_output_tilde_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert ocr.main(["--test", str(SAMPLES / "ocr" / "test.txt"), "--output", "~/data/ocr"]) == 0
    assert (tmp_path / "data" / "ocr" / "test.parquet").is_file()


BAD = [
    (ocr, "test.txt", 'a sign "Open"\na sign with no quotes\n', r"test.txt:2: no target text"),
    (ocr, "test.txt", 'ok "A"\nempty "" target\n', r"test.txt:2: empty target text"),
    (pickscore, "test.txt", "fine\n\xff\xfe broken\n", r"test.txt:2: not valid UTF-8"),
    (geneval, "test_metadata.jsonl", '{"tag": "counting", "include": [{"class": "cat", "count": 1}], "prompt": "a cat"}\n{"tag": "x", \n',
     r"test_metadata.jsonl:2: invalid JSON"),
    (geneval, "test_metadata.jsonl", '{"tag": "counting", "include": [{"class": "cat", "count": 0}], "prompt": "no cats"}\n',
     r"test_metadata.jsonl:1: include\[0\].count must be an integer >= 1, got 0"),
    (geneval, "test_metadata.jsonl", '{"tag": "position", "include": [{"class": "cat", "count": 1, "position": ["near", 0]}], "prompt": "p"}\n',
     r"test_metadata.jsonl:1: include\[0\].position"),
    (geneval, "test_metadata.jsonl", '{"include": [{"class": "cat", "count": 1}], "prompt": "p"}\n', r":1: 'tag' must be"),
]


@pytest.mark.parametrize("script,name,content,message", BAD)
def test_malformed_input_names_file_line_and_reason(script, name, content, message, tmp_path, capsys):
    path = tmp_path / name
    path.write_bytes(content.encode("latin-1") if "\xff" in content else content.encode())
    with pytest.raises(InputError, match=message):
        script.read(str(path))
    assert script.main(["--test", str(path), "--output", str(tmp_path / "o")]) == 2
    assert str(path) in capsys.readouterr().err


def test_cli_reports_error_and_exit_code(tmp_path):
    bad = tmp_path / "test.txt"
    bad.write_text("no quotes at all\n")
    proc = subprocess.run([sys.executable, str(DP / "ocr.py"), "--test", str(bad), "--output", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{bad}:1: no target text" in proc.stderr


SHARED_CASES = [
    (ocr, ["--test", "ocr/test.txt"], {"test": 1018}),
    (pickscore, ["--input", "pickscore"], {"train": 25432, "test": 2048}),
    # 1,000 prompts: the README's 999 is `wc -l`, which misses the last line (no trailing newline)
    (pickscore, ["--test", "drawbench/test.txt", "--data-source", "drawbench"], {"test": 1000}),
    (geneval, ["--test", "geneval/sample_metadata.jsonl"], {"test": 40}),
]


@pytest.mark.parametrize("script,args,counts", SHARED_CASES, ids=["ocr", "pickscore", "drawbench", "geneval"])
def test_published_prompt_files_convert_whole(script, args, counts, tmp_path):
    if not SHARED.is_dir():
        pytest.skip(f"published prompt files not found at {SHARED} (../shared/datasets/flow_grpo from the repo root)")
    args = [a if not a.endswith((".txt", ".jsonl")) and a not in ("pickscore",) else str(SHARED / a) for a in args]
    assert script.main(args + ["--output", str(tmp_path)]) == 0
    for split, n in counts.items():
        df = pd.read_parquet(tmp_path / f"{split}.parquet")
        assert len(df) == n
        assert df.extra_info.iloc[-1]["index"] == n - 1
