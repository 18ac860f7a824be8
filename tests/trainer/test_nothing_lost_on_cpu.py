"""Nothing lost, second round: a run-directory lock between real processes, checksummed checkpoints, the failure
budget of short runs, the no-learning-signal warning, and the end-of-run summary of a resumed run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from verl_diffusion.trainer.checkpoints import (
    check_checkpoint, find_resume_checkpoint, step_dir, write_manifest, write_tracker)
from verl_diffusion.trainer.reward_health import NoSignalMonitor, RewardFailureBudget, RewardHealth
from verl_diffusion.trainer.run_dir import LOCK_NAME, RunDirLock, plan_run

HOLD = r'''
import sys, time
from verl_diffusion.trainer.run_dir import RunDirLock
lock = RunDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
time.sleep(600)
'''


def _holder(run_dir):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_into_a_live_run_dir_exits_2_naming_the_other_process(tmp_path):
    """Process A holds the run directory; ``main_flowgrpo`` into the same directory exits 2 before Ray with one line
    naming A's pid. A killed with SIGKILL leaves its lock file behind, and that stale file blocks nobody."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    a = _holder(run_dir)
    try:
        env = dict(os.environ, VERL_PLATFORM="cpu")
        res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name", "tiny_cpu",
                              f"trainer.run_dir={run_dir}"], capture_output=True, text=True, env=env, timeout=300)
        assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-2000:])
        err = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert len(err) == 1 and f"is in use by another run (process {a.pid} on " in err[0], res.stderr
        assert "run dir:" not in res.stdout and "Started a local Ray" not in res.stdout + res.stderr
    finally:
        a.kill()
        a.wait()
    assert (run_dir / LOCK_NAME).exists()                 # stale: its holder died without releasing
    with RunDirLock(str(run_dir)):                           # taken at once, and now this process is named
        assert json.loads((run_dir / LOCK_NAME).read_text())["pid"] == os.getpid()
        other = subprocess.run([sys.executable, "-c", "import sys\nfrom verl_diffusion.trainer.run_dir import "
                                "RunDirLock\nRunDirLock(sys.argv[1]).acquire()", str(run_dir)],
                               capture_output=True, text=True, timeout=120)
        assert other.returncode != 0 and f"RunDirError: {run_dir} is in use by another run (process {os.getpid()} on" \
            in other.stderr


def _ckpt(ckpt_dir, step, payload=b"x" * 8192):
    path = step_dir(str(ckpt_dir), step)
    os.makedirs(os.path.join(path, "actor"), exist_ok=True)
    with open(os.path.join(path, "actor", "model_world_size_1_rank_0.pt"), "wb") as f:
        f.write(payload)
    write_manifest(path)
    write_tracker(str(ckpt_dir), step)
    return path


def test_a_shard_damaged_without_changing_its_size_falls_back_to_the_previous_checkpoint(tmp_path):
    """The first 4 KB of the newest shard zeroed (same size): the manifest's crc32 catches it, and the run plan
    resumes from the previous complete checkpoint, naming why once."""
    ckpt = tmp_path / "ckpt"
    _ckpt(ckpt, 2)
    newest = _ckpt(ckpt, 4, payload=bytes(range(256)) * 32)
    manifest = json.loads(open(os.path.join(newest, "manifest.json")).read())["files"]
    assert manifest["actor/model_world_size_1_rank_0.pt"]["size"] == 8192
    shard = os.path.join(newest, "actor", "model_world_size_1_rank_0.pt")
    with open(shard, "r+b") as f:
        f.write(b"\0" * 4096)
    assert os.path.getsize(shard) == 8192
    assert "crc32 mismatch" in check_checkpoint(newest)
    plan = plan_run(str(tmp_path / "run"), str(ckpt), total_steps=10)
    assert plan.action == "resume" and plan.resume.step == 2
    assert "global_step_4: actor/model_world_size_1_rank_0.pt has other content" in plan.message
    # a manifest written before checksums (sizes only) is still read
    old = step_dir(str(ckpt), 2)
    with open(os.path.join(old, "manifest.json"), "w") as f:
        json.dump({"files": {"actor/model_world_size_1_rank_0.pt": 8192}}, f)
    assert check_checkpoint(old) is None and find_resume_checkpoint(str(ckpt)).step == 2


def test_manifest_checksum_cost_is_small_against_a_save(tmp_path):
    """crc32 of a 64 MB shard: well under a second (the cost per GB is in docs/benchmarks.md)."""
    from verl_diffusion.trainer.checkpoints import file_crc32

    path = tmp_path / "shard.pt"
    path.write_bytes(os.urandom(64 << 20))
    t = time.perf_counter()
    crc = file_crc32(str(path))
    assert len(crc) == 8 and time.perf_counter() - t < 2.0


def test_a_run_shorter_than_the_budget_whose_reward_always_failed_is_not_a_success():
    health = RewardHealth(RewardFailureBudget(max_fraction=0.5, max_consecutive_steps=10))
    for step in (1, 2, 3):
        health.update(step, {"geneval": 32}, 32)
    assert health.exceeded() is None                       # the 10-step window never filled
    why = health.failed_throughout()
    assert "every one of the 3 steps" in why and "max_consecutive_steps=10" in why
    ok = RewardHealth(RewardFailureBudget(max_fraction=0.5, max_consecutive_steps=10))
    ok.update(1, {"geneval": 32}, 32)
    ok.update(2, {"geneval": 0}, 32)
    assert ok.failed_throughout() is None
    assert RewardHealth(RewardFailureBudget(max_consecutive_steps=0)).failed_throughout() is None


def test_no_learning_signal_warns_once_with_the_share_and_once_when_it_recovers():
    mon = NoSignalMonitor(share=0.8, steps=3)
    lines = [mon.update(s, {"reward/zero_std_ratio": r}) for s, r in
             [(1, 0.9), (2, 1.0), (3, 0.85), (4, 1.0), (5, 0.2), (6, 0.9)]]
    assert lines[0] is None and lines[1] is None
    assert lines[2].startswith("85% of the groups had equal rewards") and "steps 1-3" in lines[2]
    assert lines[3] is None                                 # once per episode
    assert lines[4] == "learning signal back at step 5: 20% of the groups had equal rewards"
    assert lines[5] is None


def test_end_of_run_summary_reads_the_whole_run_from_its_files(tmp_path):
    """After a resume the validations of the earlier segment are in metrics.jsonl and validation/*.jsonl, not in
    this process: the gain line is rebuilt from the files with the paired standard error of the per-image rows."""
    from verl_diffusion.trainer.validation import (
        paired_standard_error, val_history_from_run_dir, validation_gain_line, write_validation_scores)

    import torch

    rows = [{"step": 0, "val/reward_mean": 0.5, "val/shapes/strict": 0.5}, {"step": 1, "reward/mean": 0.4},
            {"step": 2, "reward/mean": 0.6, "val/reward_mean": 0.75, "val/shapes/strict": 0.75}]
    for step, strict in ((0, [1.0, 0.0, 1.0, 0.0]), (2, [1.0, 1.0, 1.0, 0.0])):
        scores = torch.tensor([0.5 + 0.25 * s for s in strict])
        write_validation_scores(str(tmp_path / "validation" / f"step_{step:05d}.jsonl"), ["a"] * 4, range(4), scores,
                                {"shapes/strict": torch.tensor(strict)})
    hist = val_history_from_run_dir(str(tmp_path), rows)
    assert [h["step"] for h in hist] == [0, 2]
    line = validation_gain_line(hist)
    se = paired_standard_error([1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 0.0])
    assert f"shapes/strict 0.500 -> 0.750 (+25.0 ± {100 * se:.1f} points)" in line
