"""The pieces of ``diffusion_async`` and of the standalone placement that run without Ray: the one-batch-ahead
dataloader (what it checkpoints), the overlap ratio, the old-log-prob choice of SPEC §0.4 / §3.1 (the rollout's,
also off-policy) against the sync trainer's (recompute), and the placement checks made before Ray starts."""

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from verl import DataProto


def test_lookahead_loader_sees_the_next_batch_across_epochs_and_checkpoints_the_current_one():
    from verl_diffusion.trainer.async_trainer import LookaheadLoader
    from verl_diffusion.trainer.dataset import EpochShuffleSampler

    def loader():
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(list(range(6)), batch_size=2, drop_last=True, num_workers=0,
                                  sampler=EpochShuffleSampler(6, seed=3))

    plain = loader()
    expected = [b.tolist() for _ in range(2) for b in plain]     # two epochs, each in its own order
    ahead = LookaheadLoader(loader())
    assert len(ahead) == 3
    seen, nexts, states = [], [], []
    for _ in range(2):
        for batch in ahead:
            seen.append(batch.tolist())
            nexts.append(None if ahead.next_batch is None else ahead.next_batch.tolist())
            states.append(ahead.state_dict())
    assert seen == expected
    assert nexts[:-1] == expected[1:]                   # the epoch's end looks into the next epoch
    # the state saved at batch k (within an epoch) resumes at batch k+1, as a plain (sync) loader's would
    for k in (0, 1, 3, 4):
        fresh = loader()
        fresh.load_state_dict(states[k])
        assert next(iter(fresh)).tolist() == seen[k + 1]


def test_overlap_ratio():
    from verl_diffusion.trainer.async_trainer import overlap_ratio

    assert overlap_ratio(0.0, 2.0) == 1.0          # the rollout finished while the actor trained
    assert overlap_ratio(0.5, 2.0) == 0.75
    assert overlap_ratio(3.0, 2.0) == 0.0          # waited longer than it sampled (dispatch): nothing hidden
    assert overlap_ratio(0.1, 0.0) == 0.0


def _stub(ppo_epochs: int):
    calls = []
    wg = SimpleNamespace(compute_old_log_prob=lambda b: calls.append(len(b)) or DataProto.from_dict(
        tensors={"old_log_probs": torch.full((4, 3), -7.0)}))
    cfg = OmegaConf.create({"actor_rollout_ref": {"actor": {"ppo_epochs": ppo_epochs, "ppo_mini_batch_size": 1},
                                                  "rollout": {"n": 2}}, "data": {"train_batch_size": 2}})
    stub = SimpleNamespace(config=cfg, actor_rollout_wg=wg, calls=calls)
    batch = DataProto.from_dict(tensors={"rollout_log_probs": torch.randn(4, 3), "train_mask": torch.ones(4, 3)})
    return stub, batch


def test_async_old_log_probs_are_the_rollouts_even_off_policy():
    """SPEC §0.4: θ_old = the weights that produced the rollout. Async, those are the sampler's (one update behind
    the actor), so the rollout's ℓ are θ_old's; the sync trainer's off-policy recompute would use the actor's."""
    from verl_diffusion.trainer.async_trainer import RayFlowGRPOAsyncTrainer
    from verl_diffusion.trainer.flowgrpo_trainer import RayFlowGRPOTrainer

    stub, batch = _stub(ppo_epochs=2)           # two epochs: off-policy
    assert RayFlowGRPOAsyncTrainer._compute_old_log_prob(stub, batch) == {}
    assert torch.equal(batch.batch["old_log_probs"], batch.batch["rollout_log_probs"]) and stub.calls == []

    stub, batch = _stub(ppo_epochs=2)
    stub._on_policy = lambda: RayFlowGRPOTrainer._on_policy(stub)
    stub._mini_batch_size = lambda: 2
    stub._batch_samples = lambda: 4
    RayFlowGRPOTrainer._compute_old_log_prob(stub, batch)
    assert stub.calls == [4] and float(batch.batch["old_log_probs"][0, 0]) == -7.0


def _arr(**rollout):
    return OmegaConf.create({"rollout": {"name": "diffusers", **rollout},
                             "actor": {"old_policy": {"schedule": "none", "use_for_rollout": True}}})


def test_placement_checks_name_field_value_and_choices():
    from verl_diffusion.rollout.diffusers_standalone import check_placement, resolve_standalone_config

    assert check_placement(_arr()) == "colocated"
    with pytest.raises(ValueError, match=r"rollout.placement='remote' is unknown; choose one of \['colocated', "):
        check_placement(_arr(placement="remote"))
    with pytest.raises(ValueError, match="diffusion_async .*rollout.placement=standalone \\(got 'colocated'\\)"):
        check_placement(_arr(), asynchronous=True)
    with pytest.raises(ValueError, match="num_replicas=0 must be an int >= 1"):
        check_placement(_arr(placement="standalone", standalone={"num_replicas": 0}))
    arr = _arr(placement="standalone")
    arr.actor.old_policy.schedule = "nft"
    with pytest.raises(ValueError, match="old_policy.use_for_rollout=true"):
        check_placement(arr)
    arr = _arr(placement="standalone")
    arr.actor.ema = {"enable": True}
    with pytest.raises(ValueError, match="ema.enable=true validates with the EMA weights"):
        check_placement(arr)
    # naive only works in process: a standalone placement gets the gloo backend unless one is set
    arr = _arr(placement="standalone", checkpoint_engine={"backend": "naive"})
    assert resolve_standalone_config(arr) == "diffusion_gloo" == arr.rollout.checkpoint_engine.backend
    arr = _arr(placement="standalone", checkpoint_engine={"backend": "nccl"})
    assert resolve_standalone_config(arr) == "nccl"
    assert resolve_standalone_config(_arr()) is None
