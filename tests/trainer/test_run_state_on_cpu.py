"""Nothing lost, nothing silent (issue 12), without Ray: checkpoint manifests and the atomic tracker, the run-dir
plan (new / resume / finished / refused), metrics.jsonl across a resume, reward-failure accounting and budget,
the graceful-stop handler, validation scored with each prompt's ground truth."""

import json
import os
import signal

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto
from verl_diffusion.trainer.checkpoints import (
    TRACKER_NAME, check_checkpoint, find_resume_checkpoint, read_tracker, step_dir, write_manifest, write_tracker)
from verl_diffusion.trainer.console import progress_line
from verl_diffusion.trainer.flowgrpo_trainer import RayFlowGRPOTrainer
from verl_diffusion.trainer.reward_health import RewardFailureBudget, RewardHealth, failure_summary
from verl_diffusion.trainer.run_dir import MetricsLog, RunDirError, clear_outputs, plan_run, write_run_state
from verl_diffusion.trainer.signals import GracefulStop, StopRequested


def _ckpt(ckpt_dir, step, *, complete=True, shard=b"x" * 100):
    path = step_dir(str(ckpt_dir), step)
    os.makedirs(os.path.join(path, "actor"), exist_ok=True)
    with open(os.path.join(path, "actor", "model_world_size_2_rank_0.pt"), "wb") as f:
        f.write(shard)
    with open(os.path.join(path, "data.pt"), "wb") as f:
        f.write(b"d" * 10)
    if complete:
        write_manifest(path)
        write_tracker(str(ckpt_dir), step)
    return path


# -- checkpoints ---------------------------------------------------------------------------------------------

def test_tracker_is_written_atomically_and_read_defensively(tmp_path):
    write_tracker(str(tmp_path), 12)
    assert (tmp_path / TRACKER_NAME).read_text() == "12"
    assert read_tracker(str(tmp_path)) == (12, None)
    assert not [p for p in os.listdir(tmp_path) if ".tmp." in p]
    (tmp_path / TRACKER_NAME).write_text("")          # verl's reader: int('') -> ValueError
    step, why = read_tracker(str(tmp_path))
    assert step is None and "not a step number" in why
    assert read_tracker(str(tmp_path / "none")) == (None, None)


def test_manifest_detects_a_truncated_or_missing_shard(tmp_path):
    path = _ckpt(tmp_path, 3)
    assert check_checkpoint(path) is None
    shard = os.path.join(path, "actor", "model_world_size_2_rank_0.pt")
    with open(shard, "r+b") as f:
        f.truncate(40)
    assert "40 bytes, 100 expected" in check_checkpoint(path)
    os.remove(shard)
    assert "missing" in check_checkpoint(path)
    assert "no manifest.json" in check_checkpoint(_ckpt(tmp_path, 4, complete=False))


def test_resume_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    _ckpt(tmp_path, 2)
    _ckpt(tmp_path, 4)
    bad = _ckpt(tmp_path, 6)
    with open(os.path.join(bad, "actor", "model_world_size_2_rank_0.pt"), "r+b") as f:
        f.truncate(1)
    _ckpt(tmp_path, 8, complete=False)                 # killed mid-save: no manifest
    point = find_resume_checkpoint(str(tmp_path))
    assert point.step == 4 and point.path.endswith("global_step_4")
    assert [os.path.basename(p) for p, _ in point.skipped] == ["global_step_8", "global_step_6"]
    assert "global_step_8: no manifest.json" in point.warning() and "resuming from global_step_4" in point.warning()


def test_tracker_naming_a_missing_step_is_reported_not_trusted(tmp_path):
    _ckpt(tmp_path, 2)
    write_tracker(str(tmp_path), 9)
    point = find_resume_checkpoint(str(tmp_path))
    assert point.step == 2
    assert "names step 9, whose folder is missing" in point.warning()


# -- run-dir plan ------------------------------------------------------------------------------------------

def _plan(run, **kw):
    kw.setdefault("total_steps", 10)
    return plan_run(str(run), str(run / "checkpoints"), **kw)


def test_plan_new_resume_and_finished(tmp_path):
    assert _plan(tmp_path).action == "new"
    _ckpt(tmp_path / "checkpoints", 4)
    plan = _plan(tmp_path)
    assert plan.action == "resume" and plan.resume.step == 4
    assert _plan(tmp_path, total_steps=4).action == "finished"      # nothing left to train
    write_run_state(str(tmp_path), "finished", 10)
    plan = _plan(tmp_path)
    assert plan.action == "finished" and "already finished at step 10" in plan.message
    assert "trainer.overwrite=true" in plan.message
    assert _plan(tmp_path, total_steps=12).action == "resume"        # a longer run continues from step 4


def test_plan_refuses_to_train_over_an_earlier_run(tmp_path):
    MetricsLog(str(tmp_path / "metrics.jsonl")).append({"step": 1, "reward/mean": 0.5})
    with pytest.raises(RunDirError, match=r"1 steps in metrics.jsonl.*trainer.overwrite=true"):
        _plan(tmp_path)                                             # outputs, nothing to resume from
    assert _plan(tmp_path, overwrite=True).action == "new"
    _ckpt(tmp_path / "checkpoints", 4, complete=False)
    with pytest.raises(RunDirError, match=r"none is complete.*trainer.overwrite=true"):
        _plan(tmp_path)
    with pytest.raises(RunDirError, match=r"resume_mode=disable would train from scratch"):
        _plan(tmp_path, resume_mode="disable")
    removed = clear_outputs(str(tmp_path), str(tmp_path / "checkpoints"))
    assert len(removed) == 2 and _plan(tmp_path).action == "new"


def test_metrics_log_appends_and_keeps_rows_up_to_the_resumed_step(tmp_path):
    log = MetricsLog(str(tmp_path / "metrics.jsonl"))
    for s in range(0, 6):
        log.append({"step": s, "reward/mean": s / 10, "note": "x", "skip": [1]})
    with open(log.path, "a") as f:
        f.write('{"step": 6, "rew')                               # a line cut by a kill mid-write
    assert [r["step"] for r in log.rows()] == [0, 1, 2, 3, 4, 5]
    assert "skip" not in log.rows()[0]
    assert log.keep_until(3) == 4
    log.append({"step": 4, "reward/mean": 0.4})
    assert [r["step"] for r in log.rows()] == [0, 1, 2, 3, 4]


# -- reward failures ---------------------------------------------------------------------------------------

def test_reward_health_reports_every_failing_step_and_each_transition():
    h = RewardHealth(RewardFailureBudget(max_fraction=0.5, max_consecutive_steps=3))
    seen = []
    plan = [0, 32, 32, 0, 8, 20, 32, 32]
    for step, n in enumerate(plan, start=1):
        m, events = h.update(step, {"geneval": n, "jpeg": 0}, 32, {"geneval": "URLError: refused"} if n else None)
        assert m["reward/geneval/failures"] == n and m["reward/geneval/failure_fraction"] == n / 32
        assert m["reward/jpeg/failure_fraction"] == 0.0
        seen.append((step, events, h.exceeded()))
    assert seen[0][1] == [] and seen[2][1] == []
    assert seen[1][1] == ["reward 'geneval' started failing at step 2: 32/32 samples got the penalty: "
                          "URLError: refused"]
    assert seen[3][1] == ["reward 'geneval' recovered at step 4 after failing since step 2 (2 steps)"]
    assert "started failing at step 5: 8/32" in seen[4][1][0]
    # fractions 1, 1 | 0 | 0.25, 0.625, 1, 1: three consecutive steps above 0.5 first at step 8
    assert [s for s, _, ex in seen if ex] == [8]
    assert "3 consecutive steps" in seen[7][2] and "max_consecutive_steps=3" in seen[7][2]
    assert RewardHealth(RewardFailureBudget(max_consecutive_steps=None)).exceeded() is None


def test_budget_knobs_are_checked():
    assert RewardFailureBudget.from_dict(None) == RewardFailureBudget(0.5, 10)
    assert RewardFailureBudget.from_dict({"max_consecutive_steps": 0}).max_consecutive_steps is None
    with pytest.raises(ValueError, match="max_fraction=1.5 must be in"):
        RewardFailureBudget.from_dict({"max_fraction": 1.5})
    with pytest.raises(ValueError, match="unknown keys.*steps"):
        RewardFailureBudget.from_dict({"steps": 3})


def test_progress_line_shows_failures_per_reward():
    m = {"reward/mean": 0.1, "reward/std": 0.0, "reward/geneval/failures": 24.0,
         "reward/geneval/failure_fraction": 0.75, "reward/jpeg/failures": 0.0, "reward/jpeg/failure_fraction": 0.0}
    assert failure_summary(m) == "failed geneval 24/32"
    assert "| failed geneval 24/32 |" in progress_line(3, 10, m)
    assert "failed" not in progress_line(3, 10, {"reward/jpeg/failures": 0.0})


# -- signals -----------------------------------------------------------------------------------------------

def test_first_signal_is_deferred_to_the_loop():
    with GracefulStop() as stop:
        assert not stop.requested
        signal.raise_signal(signal.SIGTERM)               # would kill the test process without the handler
        assert stop.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert StopRequested(signal.SIGTERM, 5).exit_code == 143 and StopRequested(signal.SIGINT, 5).exit_code == 130


# -- validation metadata -----------------------------------------------------------------------------------

class _ValServer:
    """A replica's server answering a validation request in process (the real one returns a Ray ObjectRef)."""

    def __init__(self):
        self.requests = []

    def generate(self, request):
        data = request["prompts"]
        self.requests.append(data)
        assert data.meta_info["validate"] is True
        n = len(data)
        return DataProto.from_dict(tensors={"images": torch.zeros(n, 3, 4, 4, dtype=torch.uint8)},
                                   meta_info={"extra_fields": {"global_steps": 0}})


class _ValReplica:
    def __init__(self):
        self.server_handle = _ValServer()


class _GroundTruthReward:
    """Scores 1 when a row's ground truth names its prompt (what GenEval's server checks), reports per tag."""

    def __init__(self):
        self.calls = []

    def __call__(self, images, prompts, metadata):
        from verl_diffusion.rewards.multi import RewardResult

        self.calls.append(metadata)
        ok = torch.tensor([float(m.get("reward_model", {}).get("ground_truth") == p)
                           for p, m in zip(prompts, metadata)])
        tags = {}
        for m, v in zip(metadata, ok.tolist()):
            tags.setdefault(m.get("extra_info", {}).get("tag", "none"), []).append(v)
        metrics = {"reward/geneval/mean": float(ok.mean()), "reward/failures/geneval": 0.0}
        metrics.update({f"reward/geneval/strict_accuracy/{t}": float(np.mean(v)) for t, v in tags.items()})
        return RewardResult(scores=ok, components={"geneval": ok}, failures={"geneval": 0}, metrics=metrics)


def test_validation_scores_with_each_prompts_ground_truth(tmp_path):
    from verl_diffusion.trainer.dataset import collate_prompts

    rows = [{"prompt": f"p{i}", "reward_model": {"ground_truth": f"p{i}"}, "extra_info": {"tag": "ab"[i % 2]}}
            for i in range(3)]
    tr = object.__new__(RayFlowGRPOTrainer)
    tr.config = OmegaConf.create({"trainer": {"val_num_images": 5}})
    tr.val_dataloader = [collate_prompts(rows)]
    tr.rollout_replicas, tr.world_size = [_ValReplica(), _ValReplica()], 2
    tr.reward_fn, tr.run_dir, tr.global_steps = _GroundTruthReward(), str(tmp_path), 0
    tr.val_images, tr.val_history, tr.progress = {}, [], False
    m = tr._validate()
    meta = tr.reward_fn.calls[0]
    assert [x["reward_model"]["ground_truth"] for x in meta] == ["p0", "p1", "p2", "p0", "p1"]
    assert m["val/reward_mean"] == 1.0 and m["val/geneval/mean"] == 1.0
    # 5 images padded to 6 rows, 3 per replica, in order (replica r answers the rows of worker r)
    assert [list(r.server_handle.requests[0].non_tensor_batch["prompt"]) for r in tr.rollout_replicas] == \
        [["p0", "p1", "p2"], ["p0", "p1", "p0"]]
    assert m["val/geneval/strict_accuracy/a"] == 1.0 and m["val/geneval/strict_accuracy/b"] == 1.0
    saved = torch.load(tmp_path / "validation" / "baseline.pt", weights_only=True)
    assert saved["step"] == 0 and saved["images"].shape == (5, 3, 4, 4)


# -- the trainer's resume and the default run directory ----------------------------------------------------

class _CkptWG:
    def __init__(self):
        self.loaded = []

    def load_checkpoint(self, path, del_local_after_load=False):
        self.loaded.append(path)


class _Loader(list):
    def __init__(self):
        super().__init__([0, 1, 2])
        self.state = None

    def load_state_dict(self, state):
        self.state = state


def _resume_trainer(tmp_path):
    from verl_diffusion.trainer.dataset import EpochShuffleSampler

    tr = object.__new__(RayFlowGRPOTrainer)
    ckpt = tmp_path / "checkpoints"
    tr.config = OmegaConf.create({"trainer": {"resume_mode": "auto", "default_local_dir": str(ckpt),
                                              "default_hdfs_dir": None, "del_local_ckpt_after_load": False}})
    tr.actor_rollout_wg, tr.use_critic, tr.global_steps = _CkptWG(), False, 0
    tr.train_dataloader = _Loader()                       # 3 steps per epoch
    tr.train_sampler = EpochShuffleSampler(12)
    tr.metrics_log, tr.resume_point, tr.progress = MetricsLog(str(tmp_path / "metrics.jsonl")), None, False
    return tr, ckpt


def test_trainer_resumes_from_the_newest_complete_checkpoint(tmp_path, capsys):
    tr, ckpt = _resume_trainer(tmp_path)
    _ckpt(ckpt, 2)
    torch.save({"epoch": 0, "yielded": 2}, ckpt / "global_step_2" / "data.pt")    # a real dataloader state
    write_manifest(str(ckpt / "global_step_2"))
    _ckpt(ckpt, 4, complete=False)
    (ckpt / TRACKER_NAME).write_text("")                 # and an empty tracker (verl: int(''))
    for s in range(1, 6):
        tr.metrics_log.append({"step": s})
    tr._load_checkpoint()
    assert tr.global_steps == 2 and tr.actor_rollout_wg.loaded == [str(ckpt / "global_step_2" / "actor")]
    warning = capsys.readouterr().out
    assert "WARNING: skipped damaged checkpoint state (latest_checkpointed_iteration.txt: holds ''" in warning
    assert "global_step_4: no manifest.json (the save did not finish)); resuming from global_step_2" in warning
    assert tr.train_dataloader.state == {"epoch": 0, "yielded": 2}
    assert [r["step"] for r in tr.metrics_log.rows()] == [1, 2]
    assert tr.config.trainer.resume_mode == "auto"


def test_trainer_refuses_to_start_over_damaged_checkpoints(tmp_path):
    tr, ckpt = _resume_trainer(tmp_path)
    _ckpt(ckpt, 3, complete=False)
    (ckpt / TRACKER_NAME).write_text("")
    with pytest.raises(RunDirError, match="none is complete.*trainer.overwrite=true"):
        tr._load_checkpoint()
    assert tr.actor_rollout_wg.loaded == []


def test_outputs_default_to_outputs_experiment_under_the_working_directory(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_module

    from verl_diffusion.main_flowgrpo import add_search_path, prepare_config

    monkeypatch.delenv("VERL_DIFFUSION_RUN_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)
    with initialize_config_module(config_module="verl_diffusion.config", version_base=None):
        argv = ["x"]
        add_search_path(argv)
        cfg = compose(config_name="tiny_cpu", overrides=[a for a in argv if a.startswith("hydra.searchpath")])
    run_dir = prepare_config(cfg)
    assert run_dir == str(tmp_path / "outputs" / "tiny_cpu")
    assert cfg.trainer.default_local_dir == str(tmp_path / "outputs" / "tiny_cpu" / "checkpoints")


def test_multi_reward_reports_the_cause_of_this_calls_failures():
    """The cause the fault-start warning quotes: RewardResult.causes, per call (not only the first of the run)."""
    import socket

    from verl_diffusion.rewards import build_reward

    with socket.socket() as s:                              # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    reward = build_reward({"jpeg_compressibility": 1.0, "geneval": 0.0},
                          options={"geneval": {"url": f"http://127.0.0.1:{port}", "max_retries": 0}})
    meta = [{"reward_model": {"ground_truth": json.dumps({"tag": "colors", "include": [{"class": "cup", "count": 1}]})}}]
    images = torch.zeros(2, 3, 16, 16, dtype=torch.uint8)
    for _ in range(2):
        res = reward(images, ["a cup"] * 2, meta * 2)
        assert res.failures == {"jpeg_compressibility": 0, "geneval": 2}
        assert set(res.causes) == {"geneval"} and f"127.0.0.1:{port}" in res.causes["geneval"]


# Hydra writes nothing outside the run dir: tests/trainer/test_config_validation_on_cpu.py::
# test_cli_prints_one_line_starts_no_ray_and_hydra_writes_nothing (one command-line run checks both).
