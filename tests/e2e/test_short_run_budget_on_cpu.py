"""A run shorter than the reward-failure budget's window, whose reward fails on every step, does not exit 0: a real
run (tiny model, 2 steps, a GenEval server that answers the start-up check and fails every training request; its
weight is 0, so only the failure accounting sees it) exits 3 with one line, saves its last step and says why in
run_state.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from geneval_helpers import geneval_prompts, geneval_server


def test_a_short_run_whose_reward_always_failed_exits_3(tmp_path):
    prompts = geneval_prompts(tmp_path / "prompts.jsonl")
    srv, url = geneval_server(fail_train_requests=True)
    try:
        env = dict(os.environ, VERL_PLATFORM="cpu", VERL_DIFFUSION_RUN_ROOT=str(tmp_path / "runs"))
        res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name", "tiny_cpu",
                              "trainer.total_training_steps=2", "trainer.test_freq=-1",
                              "trainer.val_before_train=false", f"data.train_files=[{prompts}]",
                              f"data.val_files=[{prompts}]", "+reward.components.geneval=0.0",
                              f"+reward.options.geneval.url={url}", "+reward.options.geneval.max_retries=0",
                              "trainer.export.enable=false"],
                             capture_output=True, text=True, env=env, timeout=900)
    finally:
        srv.shutdown()
        srv.server_close()
    assert res.returncode == 3, (res.stdout[-3000:], res.stderr[-3000:])
    err = [ln for ln in res.stderr.splitlines() if ln.startswith("reward failure:")]
    assert len(err) == 1 and "on every one of the 2 steps of this run" in err[0], res.stderr[-3000:]
    assert res.stdout.count("failed geneval 32/32") == 2
    run_dir = tmp_path / "runs" / "tiny_cpu"
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "stopped" and state["step"] == 2 and "every one of the 2 steps" in state["reason"]
    assert (run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
