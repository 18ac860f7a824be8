"""The colocated ``diffusers`` replica's pieces without Ray (rollout/diffusers_replica.py): its places in verl's two
rollout registries, the adapter's answer (weights version in ``extra_fields``), the naive weight sync (the actor's
own tensors: nothing foreign, nothing copied), and the hybrid-only placement. The e2e runs (tests/e2e) drive the
same pieces through Ray in every worker process."""

import asyncio

import numpy as np
import pytest
import torch

from verl import DataProto
from verl_diffusion.rollout.diffusers_replica import (ADAPTER_PATH, LOCAL_ADAPTERS, DiffusersReplica,
                                                      DiffusersRolloutAdapter, DiffusersServer)


def test_registered_in_verls_replica_registry_and_rollout_dict():
    import verl_diffusion.plugin  # noqa: F401  (what the verl.plugins entry point imports in every process)
    from verl.workers.rollout.base import _ROLLOUT_REGISTRY, get_rollout_class
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    assert RolloutReplicaRegistry.get("diffusers") is DiffusersReplica
    assert _ROLLOUT_REGISTRY[("diffusers", "async")] == ADAPTER_PATH
    assert get_rollout_class("diffusers", "async") is DiffusersRolloutAdapter
    assert {"vllm", "sglang", "trtllm", "vllm_omni", "diffusers"} <= set(RolloutReplicaRegistry._registry)


def _adapter(rank=7):
    module = torch.nn.Linear(3, 2)
    calls = []

    def generate(prompts):
        calls.append(len(prompts))
        return DataProto.from_dict(tensors={"images": torch.zeros(len(prompts), 3, 2, 2)},
                                   meta_info={"metrics": {"perf/rollout_time": 1.0}})

    return DiffusersRolloutAdapter(config={}, model_config={}, replica_rank=rank, generate_fn=generate,
                                   module=module), module, calls


def test_adapter_answers_with_the_weights_version_it_last_received():
    adapter, module, calls = _adapter()
    assert LOCAL_ADAPTERS[7] is adapter                       # the server finds it by replica rank
    prompts = DataProto.from_dict(non_tensors={"prompt": np.array(["a", "b", "c"], dtype=object)})
    out = adapter.serve({"prompts": prompts, "global_steps": 1})
    assert calls == [3] and out.batch["images"].shape == (3, 3, 2, 2)
    assert out.meta_info["extra_fields"] == {"global_steps": -1}          # before the first sync
    asyncio.run(adapter.update_weights(module.named_parameters(), global_steps=4))
    assert adapter.serve({"prompts": prompts, "global_steps": 5}).meta_info["extra_fields"]["global_steps"] == 4


def test_naive_sync_hands_over_the_samplers_own_tensors():
    adapter, module, _ = _adapter(rank=8)
    before = [p.detach().clone() for p in module.parameters()]
    asyncio.run(adapter.update_weights(module.named_parameters(), global_steps=1))
    assert adapter.foreign_tensors == 0 and adapter.global_steps == 1
    for p, b in zip(module.parameters(), before):
        assert torch.equal(p, b)                               # nothing copied or changed
    copies = ((n, p.detach().clone()) for n, p in module.named_parameters())
    asyncio.run(adapter.update_weights(copies, global_steps=2))
    assert adapter.foreign_tensors == 2                        # weight and bias of another module would be foreign


def test_replica_is_hybrid_only_and_replica_r_is_worker_r():
    class _Group:
        workers = ["w0", "w1"]

    replicas = [DiffusersReplica(replica_rank=r, config={"name": "diffusers"}, model_config={}) for r in range(2)]
    for rep in replicas:
        asyncio.run(rep.init_hybrid(_Group()))
    assert [rep.workers for rep in replicas] == [["w0"], ["w1"]]
    assert [rep.server_handle.worker for rep in replicas] == ["w0", "w1"]
    assert isinstance(replicas[1].server_handle, DiffusersServer)
    assert replicas[1].server_address == "diffusers://hybrid/1"
    with pytest.raises(NotImplementedError, match="hybrid"):
        asyncio.run(replicas[0].init_standalone())


def test_every_diffusion_server_answers_verls_control_calls_with_nothing():
    """The colocated and standalone diffusers servers and the vllm-omni server share one no-op control half."""
    import asyncio
    import inspect

    from verl_diffusion.rollout.diffusers_replica import DiffusersReplica
    from verl_diffusion.rollout.diffusers_standalone import _ServerMethods
    from verl_diffusion.rollout.server_controls import BatchServerControls
    from verl_diffusion.rollout.vllm_omni.replica import VllmOmniServer

    controls = [n for n, f in inspect.getmembers(BatchServerControls, inspect.iscoroutinefunction)]
    assert len(controls) == 7
    for cls in (DiffusersReplica, _ServerMethods, VllmOmniServer):
        assert issubclass(cls, BatchServerControls), cls
        obj = object.__new__(cls)
        assert [asyncio.run(getattr(obj, n)()) for n in controls] == [None] * 7
