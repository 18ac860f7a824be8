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
    return importlib.import_module(f"verl_diffusion.data_process.{name}")


ocr, pickscore, geneval = _load("ocr"), _load("pickscore"), _load("geneval")
from verl_diffusion.data_process._common import InputError  # noqa: E402


def _rlhf_dataset(path, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    cfg = OmegaConf.create({"filter_overlong_prompts": False, "cache_dir": str(tmp_path / "cache")})
    return RLHFDataset(data_files=str(path), tokenizer=None, config=cfg)


@pytest.mark.parametrize("script,n_train,n_test", [(ocr, 6, 3), (pickscore, 5, 2), (geneval, 6, 2)])
def test_sample_round_trip_through_rlhf_dataset(script, n_train, n_test, tmp_path):
    out = tmp_path / "out"
    assert script.main(["--input", str(SAMPLES / script.__name__.rsplit(".", 1)[-1]), "--output", str(out)]) == 0
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


# -- issue 12 item 12: inputs that used to write a 0-row parquet, a file as --output, a stale split, --help, GenEval
@pytest.mark.parametrize("content", ["", "\n  \n\t\n"], ids=["empty", "blank-only"])
@pytest.mark.parametrize("script,name", [(ocr, "test.txt"), (pickscore, "test.txt"), (geneval, "test_metadata.jsonl")])
def test_empty_or_blank_input_is_an_error(script, name, content, tmp_path, capsys):
    path = tmp_path / name
    path.write_text(content)
    assert script.main(["--test", str(path), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {path}: holds no entries (empty, or blank lines only)"
    assert not (tmp_path / "o" / "test.parquet").exists()


@pytest.mark.parametrize("flag", ["--train-size", "--test-size", "--max-samples"])
def test_zero_sizes_are_an_error(flag, tmp_path, capsys):
    args = ["--input", str(SAMPLES / "pickscore"), flag, "0", "--output", str(tmp_path / "o")]
    assert pickscore.main(args) == 2
    assert capsys.readouterr().err.strip() == f"error: {flag} 0: give -1 (all) or N >= 1 (0 would write an empty split)"
    assert not (tmp_path / "o").exists()


def test_output_naming_a_file_is_one_line(tmp_path):
    f = tmp_path / "out.parquet"
    f.write_text("x")
    for out in (f, f / "sub"):
        proc = subprocess.run([sys.executable, str(DP / "pickscore.py"), "--test", str(SAMPLES / "pickscore" / "test.txt"),
                               "--output", str(out)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and "is a file" in proc.stderr and "Traceback" not in proc.stderr


def test_stale_split_in_old_output_dir_is_reported(tmp_path, capsys):
    out = tmp_path / "o"
    assert pickscore.main(["--input", str(SAMPLES / "pickscore"), "--output", str(out)]) == 0
    capsys.readouterr()
    assert pickscore.main(["--train", str(SAMPLES / "pickscore" / "train.txt"), "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"warning: {out / 'test.parquet'} was not written by this run" in err and "--test" in err


@pytest.mark.parametrize("script", ["ocr.py", "pickscore.py", "geneval.py"])
def test_help_has_a_description(script):
    proc = subprocess.run([sys.executable, str(DP / script), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    usage_end = proc.stdout.index("\n\n")
    description = proc.stdout[usage_end:].strip().splitlines()[0]
    assert "-> verl parquet" in description


def test_geneval_holdout_splits_by_unique_prompt(tmp_path, capsys):
    base = [json.loads(line) for line in (SAMPLES / "geneval" / "train_metadata.jsonl").read_text().splitlines()]
    rows = [m for m in base for _ in range(4)]  # the published metadata repeats each prompt 4x
    src = tmp_path / "train_metadata.jsonl"
    src.write_text("".join(json.dumps(m) + "\n" for m in rows))
    out = tmp_path / "o"
    assert geneval.main(["--train", str(src), "--test-size", "2", "--seed", "1", "--output", str(out)]) == 0
    err = capsys.readouterr().err
    tr, te = pd.read_parquet(out / "train.parquet"), pd.read_parquet(out / "test.parquet")
    train_prompts = set(tr.extra_info.map(lambda e: e["prompt_text"]))
    test_prompts = set(te.extra_info.map(lambda e: e["prompt_text"]))
    n_unique = len({m["prompt"] for m in base})
    assert len(test_prompts) == 2 and train_prompts.isdisjoint(test_prompts)
    assert (len(tr), len(te)) == (4 * (n_unique - 2), 8)
    assert f"note: train: {len(tr)} rows hold {n_unique - 2} unique prompts" in err


def test_prompts_shared_by_train_and_test_files_are_reported(tmp_path, capsys):
    train, test = tmp_path / "train.txt", tmp_path / "test.txt"
    train.write_text("a cat\na dog\na cat\n")
    test.write_text("a dog\na bird\n")
    assert pickscore.main(["--input", str(tmp_path), "--output", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "note: train: 3 rows hold 2 unique prompts (1 rows repeat a prompt)" in err
    assert "warning: 1 test prompt(s) also appear in train, e.g. 'a dog'" in err


def test_reward_server_help_has_a_description():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "reward_server.py"), "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "Launch a GenEval-protocol reward server" in proc.stdout
    assert "reward.options.geneval.url=http://HOST:PORT" in proc.stdout
