"""Every registered loss through the diffusion engine (FSDP2, gloo, 1 process, no Ray): finite, parameters move,
and the on-policy log-prob recomputed in training equals the rollout's bitwise (|ℓ_train − ℓ_rollout| = 0)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _run(lora: int) -> dict:
    env = dict(os.environ, VERL_PLATFORM="cpu", SMOKE_LORA=str(lora), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(HERE / "loss_smoke.py")], capture_output=True, text=True, env=env,
                         timeout=600)
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert res.returncode == 0, res.stderr[-4000:]
    return {r["mode"]: r for r in rows}


@pytest.fixture(scope="module")
def full_finetune():
    return _run(lora=0)


EXPECTED = ("flow_grpo", "grpo_guard", "flow_dppo", "dance_grpo", "tempflow_grpo", "path_space", "awm",
            "diffusion_nft")


@pytest.mark.parametrize("mode", EXPECTED)
def test_loss_mode_trains(full_finetune, mode):
    row = full_finetune[mode]
    assert row["finite"], row
    assert row["param_change"] > 0, row
    assert row["grad_norm"] > 0 and row["grad_norm"] == row["grad_norm"], row


@pytest.mark.parametrize("mode", ["flow_grpo", "dance_grpo", "tempflow_grpo"])
def test_on_policy_log_prob_is_bitwise_the_rollouts(full_finetune, mode):
    assert full_finetune[mode]["lr0"] == 0.0


def test_lora_flow_grpo_and_reference_kl():
    rows = _run(lora=4)
    for mode in ("flow_grpo", "awm"):
        assert rows[mode]["finite"] and rows[mode]["param_change"] > 0, rows[mode]
    assert rows["flow_grpo"]["lr0"] == 0.0
