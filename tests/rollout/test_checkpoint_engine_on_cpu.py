"""The ``diffusion_gloo`` checkpoint engine between two Ray actors (tests/rollout/weight_sync_smoke.py): after each
sync the receiver's tensors equal the sender's bitwise, twice in a row; a LoRA sync moves exactly the adapter
tensors (their bytes, nothing else) and leaves the receiver's base weights untouched. Pure-Python parts (topology,
registry, errors) are checked in process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def synced() -> dict:
    env = dict(os.environ, VERL_PLATFORM="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(HERE / "weight_sync_smoke.py")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    line = next(line for line in res.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_full_sync_makes_receiver_bitwise_equal_twice(synced):
    assert not synced["before"]["bitwise_equal"]          # different random weights to start
    for sync in (synced["full_0"], synced["full_1"]):
        assert sync["keys_equal"] and sync["bitwise_equal"] and sync["max_abs_diff"] == 0.0, sync
        # every byte of the state dict crossed, once
        assert sync["sent"]["weight_sync/bytes"] == synced["state_bytes"] == sync["received"]
    # the bucket (16 KiB) is smaller than the largest tensor: the oversize path and several buckets were used
    assert synced["largest_tensor_bytes"] > 16 << 10
    assert synced["full_0"]["sent"]["weight_sync/buckets"] > 2


def test_lora_sync_moves_only_adapter_tensors(synced):
    for sync in (synced["lora_0"], synced["lora_1"]):
        assert sync["only_lora_crossed"] and sync["crossed"] == synced["lora_tensors"] > 0, sync
        assert sync["sent"]["weight_sync/bytes"] == synced["lora_bytes"] == sync["received"]
        # the whole receiver equals the sender: the adapter crossed, the base was already the same
        assert sync["bitwise_equal"] and sync["base_untouched"], sync
    assert synced["lora_bytes"] < synced["state_bytes"] / 20


def test_topology_puts_actor_rank0_first_and_others_out():
    from verl_diffusion.rollout.checkpoint_engine import GlooCheckpointEngine

    actor, rollout = GlooCheckpointEngine.build_topology(3, 2, [{"master": ("h", 7)}, {"master": None},
                                                                {"master": None}, {"master": None}, {"master": None}])
    assert actor["rank"] == [0, -1, -1] and rollout["rank"] == [1, 2]
    assert actor["world_size"] == [3] * 3 and rollout["world_size"] == [3] * 2
    assert rollout["master"] == [("h", 7)] * 2
    with pytest.raises(RuntimeError, match="did not open"):
        GlooCheckpointEngine.build_topology(1, 1, [{"master": None}, {"master": None}])


def test_load_weights_into_rejects_unknown_names_and_shapes():
    from verl_diffusion.rollout.checkpoint_engine import load_weights_into

    m = torch.nn.Linear(2, 3)
    stats = load_weights_into(m, [("weight", torch.ones(3, 2)), ("bias", torch.zeros(3))])
    assert stats == {"tensors": 2.0, "bytes": 36.0} and torch.equal(m.weight, torch.ones(3, 2))
    with pytest.raises(KeyError, match="'nope'"):
        load_weights_into(m, [("nope", torch.ones(1))])
    with pytest.raises(ValueError, match=r"shape \(2, 2\)"):
        load_weights_into(m, [("weight", torch.ones(2, 2))])


def test_backend_is_registered_in_verls_registry():
    import verl  # noqa: F401
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from verl_diffusion.rollout.checkpoint_engine import GlooCheckpointEngine

    assert CheckpointEngineRegistry.get("diffusion_gloo") is GlooCheckpointEngine
