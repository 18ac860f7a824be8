"""The vllm_omni replica's parts that need no engine: registration, request planning, weight routing, errors.

Run in the main environment (no vllm-omni): the replica module imports vllm-omni only when an engine starts.
"""

import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from vllm_omni_cases import GROUPS, PROMPTS, generate_request, rollout_config

from verl_diffusion.rollout.diffusers_rollout import plan_rollout
from verl_diffusion.rollout.vllm_omni import PIPELINE_CLASSES
from verl_diffusion.rollout.vllm_omni.protocol import (collate_trajectories, parse_extra_args, read_lora_dir,
                                                       write_lora_dir)
from verl_diffusion.rollout.vllm_omni.replica import (VllmOmniReplica, VllmOmniServerAdapter, build_engine_requests,
                                                      engine_kwargs, split_lora_weights, validate_vllm_omni_config)


class SamplingParams:
    """Stands in for vllm-omni's OmniDiffusionSamplingParams (same keyword fields)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_replica_and_adapter_are_registered_in_a_fresh_process():
    code = ("import verl\n"
            "from verl.workers.rollout.replica import RolloutReplicaRegistry\n"
            "from verl.workers.rollout.base import get_rollout_class\n"
            "print(RolloutReplicaRegistry.get('vllm_omni').__name__, get_rollout_class('vllm_omni', 'async').__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-2:] == ["VllmOmniReplica", "VllmOmniServerAdapter"]


def test_engine_requests_carry_the_diffusers_replicas_plan():
    """Row i gets x_{t_0}[i] and z_k[i] of the plan seeded seed·1000 + 0 (one sampling rank)."""
    cfg, request = rollout_config(), generate_request(seed=3)
    rows = build_engine_requests(cfg, request, (16, 16, 16), sampling_params_cls=SamplingParams)
    plan = plan_rollout(cfg, torch.tensor(GROUPS), (16, 16, 16), seed=3000)
    assert [r["prompt"] for r in rows] == PROMPTS and len({r["request_id"] for r in rows}) == len(PROMPTS)
    for i, r in enumerate(rows):
        sp = r["sampling_params"]
        assert torch.equal(sp.latents, plan.initial_noise[i:i + 1])
        assert (sp.height, sp.width, sp.num_inference_steps) == (64, 64, 6)
        back = parse_extra_args(sp.extra_args)
        assert back.cfg == cfg and back.store_velocities
        assert back.stochastic == tuple(plan.stochastic) == (1, 2) and back.trained == (1, 2)
        assert torch.equal(back.step_noise, torch.stack([plan.step_noise[k][i] for k in plan.stochastic]))


def test_same_noise_per_group_and_branched_requests():
    cfg = rollout_config(same_noise_per_group=True)
    rows = build_engine_requests(cfg, generate_request(), (16, 16, 16), sampling_params_cls=SamplingParams)
    x0 = torch.cat([r["sampling_params"].latents for r in rows])
    assert torch.equal(x0[0], x0[2]) and not torch.equal(x0[0], x0[3])
    with pytest.raises(ValueError, match="branched"):
        build_engine_requests(cfg, generate_request(branched={"num_children": 2, "branch_steps": [1]}), (16, 16, 16),
                              sampling_params_cls=SamplingParams)


def test_lora_names_and_directory_round_trip(tmp_path):
    named = [("blocks.0.attn.to_q.lora_A.default.weight", torch.ones(4, 8)),
             ("blocks.0.attn.to_q.lora_B.default.weight", torch.zeros(8, 4)),
             ("blocks.0.attn.to_q.weight", torch.ones(8, 8))]
    lora, full = split_lora_weights(named)
    assert sorted(lora) == ["blocks.0.attn.to_q.lora_A.weight", "blocks.0.attn.to_q.lora_B.weight"]
    assert list(full) == ["blocks.0.attn.to_q.weight"]
    path = write_lora_dir(tmp_path / "l", lora, {"r": 4, "lora_alpha": 8, "target_modules": {"attn.to_q"}})
    state, config = read_lora_dir(path)
    assert config == {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["attn.to_q"]}
    assert all(torch.equal(state[k], lora[k]) for k in lora)
    with pytest.raises(ValueError, match="target_modules"):
        write_lora_dir(tmp_path / "m", lora, {"r": 4})


def test_protocol_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="extra_args"):
        parse_extra_args({})
    with pytest.raises(ValueError, match="keys"):
        collate_trajectories([{"latents": torch.zeros(2)}, {"log_probs": torch.zeros(2)}])
    with pytest.raises(ValueError, match="unknown trajectory keys"):
        collate_trajectories([{"latent": torch.zeros(2)}])


def test_engine_kwargs_name_our_pipeline_and_extension(tiny_sd3_path, tmp_path):
    kw = engine_kwargs(tiny_sd3_path, dtype="float32", extra={"enable_cpu_offload": True})
    assert kw["custom_pipeline_args"] == {"pipeline_class": "verl_diffusion.rollout.vllm_omni.pipelines."
                                                             + PIPELINE_CLASSES["StableDiffusion3Pipeline"]}
    assert kw["worker_extension_cls"].endswith("worker_extension.VerlDiffusionWorkerExtension")
    assert kw["enforce_eager"] and kw["enable_sleep_mode"] and kw["enable_cpu_offload"]
    (tmp_path / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    with pytest.raises(ValueError, match="no pipeline for 'WanPipeline'"):
        engine_kwargs(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        engine_kwargs(str(tmp_path / "missing"))


def _adapter(path):
    from verl_diffusion.config.schema import yaml_section

    config = OmegaConf.merge(yaml_section("actor_rollout_ref.rollout"),
                             {"num_steps": 6, "resolution": 64, "sde": {"type": "flow_sde"}})
    model = OmegaConf.merge(yaml_section("actor_rollout_ref.model"),
                            {"path": path, "lora_rank": 4, "lora_alpha": 8, "target_modules": ["attn.to_q"]})
    return VllmOmniServerAdapter(config=config, model_config=model, replica_rank=7, start_engine=False)


def test_weight_updates_route_lora_and_full_weights(tiny_sd3_path, monkeypatch):
    import asyncio

    adapter = _adapter(tiny_sd3_path)
    got = []
    monkeypatch.setattr(adapter, "load_lora", lambda state: got.append(("lora", sorted(state))))
    monkeypatch.setattr(adapter, "load_full", lambda state: got.append(("full", sorted(state))))
    lora = [("a.to_q.lora_A.default.weight", torch.zeros(1)), ("a.to_q.lora_B.default.weight", torch.zeros(1))]
    asyncio.run(adapter.update_weights(iter(lora), global_steps=3))
    asyncio.run(adapter.update_weights(iter([("a.to_q.weight", torch.zeros(1))]), global_steps=4))
    assert got == [("lora", ["a.to_q.lora_A.weight", "a.to_q.lora_B.weight"]), ("full", ["a.to_q.weight"])]
    assert adapter.global_steps == 4 and adapter.cfg.num_steps == 6 and adapter.target_modules == ["attn.to_q"]
    with pytest.raises(ValueError, match="mixes"):
        asyncio.run(adapter.update_weights(iter(lora + [("a.to_q.weight", torch.zeros(1))])))
    with pytest.raises(ValueError, match="named_tensors"):
        asyncio.run(adapter.update_weights(iter([]), wire_format="delta_flush"))


def test_replica_placement_and_size_errors(tiny_sd3_path):
    import asyncio

    config = OmegaConf.create({"tensor_model_parallel_size": 2})
    with pytest.raises(ValueError, match="one GPU per replica"):
        VllmOmniReplica(0, config, OmegaConf.create({"path": tiny_sd3_path}))
    replica = VllmOmniReplica(0, OmegaConf.create({}), OmegaConf.create({"path": tiny_sd3_path}))
    with pytest.raises(NotImplementedError, match="standalone"):
        asyncio.run(replica.init_hybrid(None))


@pytest.mark.parametrize("rollout, match", [
    ({"data_parallel_size": 2}, "one GPU per replica"),
    ({"placement": "colocated"}, "runs standalone"),
    ({"branched": {"enabled": True}}, "branched"),
])
def test_config_refused_before_ray_with_one_line(tiny_sd3_path, rollout, match):
    with pytest.raises(ValueError, match=match) as err:
        validate_vllm_omni_config(OmegaConf.create(rollout), OmegaConf.create({"path": tiny_sd3_path}))
    assert "\n" not in str(err.value)


def test_config_accepted_or_missing_vllm_omni_named(tiny_sd3_path):
    import importlib.util

    rollout, model = OmegaConf.create({"placement": "standalone"}), OmegaConf.create({"path": tiny_sd3_path})
    if importlib.util.find_spec("vllm_omni") is None:
        with pytest.raises(ValueError, match="pip install 'verl-diffusion\\[vllm-omni\\]'"):
            validate_vllm_omni_config(rollout, model)
    else:
        validate_vllm_omni_config(rollout, model)


def test_every_adapter_architecture_has_a_pipeline_and_its_latent_shape(tmp_path):
    """The replica plans x_{t_0} from the configs alone (latent_shape_of): it must be the adapter's latent_shape,
    for each architecture's tiny checkpoint and two sizes; its LoRA targets are the trainer's (the architecture's)."""
    from verl_diffusion.models import PIPELINE_ARCHITECTURES, get_adapter_cls
    from verl_diffusion.models.tiny import TINY_BUILDERS
    from verl_diffusion.rollout.vllm_omni import latent_shape_of
    from verl_diffusion.config.schema import ModelSection, yaml_section

    assert set(PIPELINE_CLASSES) == set(PIPELINE_ARCHITECTURES)
    for pipeline_name, arch in PIPELINE_ARCHITECTURES.items():
        pipe = TINY_BUILDERS[arch]()
        pipe.save_pretrained(str(tmp_path / arch))
        adapter = get_adapter_cls(arch)(pipe)
        for h, w in ((64, 64), (32, 96)):
            assert latent_shape_of(str(tmp_path / arch), h, w) == tuple(adapter.latent_shape(h, w)), (arch, h, w)
        with pytest.raises(ValueError, match="not a multiple of"):
            latent_shape_of(str(tmp_path / arch), 66, 64)
        kw = engine_kwargs(str(tmp_path / arch), adapter_kwargs={"max_sequence_length": 8})
        assert kw["custom_pipeline_args"] == {"pipeline_class": "verl_diffusion.rollout.vllm_omni.pipelines."
                                              + PIPELINE_CLASSES[pipeline_name],
                                              "adapter_kwargs": {"max_sequence_length": 8}}
        model = OmegaConf.merge(yaml_section("actor_rollout_ref.model"),
                                {"path": str(tmp_path / arch), "target_modules": "all-linear"})
        assert ModelSection.from_node(model).lora.target_modules == adapter.lora_targets()


def test_collate_pads_variable_length_text_with_mask_zero():
    """Qwen-Image rows from different vllm-omni batches carry different text lengths; padded as Conditioning.cat."""
    rows = [{"prompt_embeds": torch.ones(3, 2), "prompt_mask": torch.ones(3, dtype=torch.long)},
            {"prompt_embeds": 2 * torch.ones(5, 2), "prompt_mask": torch.ones(5, dtype=torch.long)}]
    batch = collate_trajectories(rows)
    assert batch["prompt_embeds"].shape == (2, 5, 2) and batch["prompt_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    assert batch["prompt_embeds"][0, 3:].abs().sum() == 0 and torch.equal(batch["prompt_embeds"][1], 2 * torch.ones(5, 2))
    with pytest.raises(ValueError, match="no 'prompt_mask'"):
        collate_trajectories([{"prompt_embeds": torch.ones(3, 2)}, {"prompt_embeds": torch.ones(4, 2)}])


class _RecordingEngine:
    """Stands in for AsyncOmni behind the adapter's engine thread: records the control calls the adapter makes."""

    def __init__(self):
        self.calls = []

    async def _record(self, *call):
        self.calls.append(call)
        return True

    def add_lora(self, request):
        return self._record("add_lora", request.lora_int_id, request.lora_path)

    def remove_lora(self, adapter_id):
        return self._record("remove_lora", adapter_id)

    def collective_rpc(self, method, args=()):
        return self._record("collective_rpc", method, [name for name, _ in args[0]])

    def sleep(self, level):
        return self._record("sleep", level)

    def wake_up(self, tags=None):
        return self._record("wake_up", tags)

    def shutdown(self):
        self.calls.append(("shutdown",))


def test_adapter_drives_the_engines_lora_rpc_and_sleep_api(tiny_sd3_path, monkeypatch):
    """What the adapter asks of AsyncOmni (the engine itself needs a GPU): a LoRA sync is add_lora(new id) with a peft
    directory of the new weights, then remove_lora(old id); full weights go through collective_rpc's
    verl_load_weights; release / resume are sleep(level=1) / wake_up, and nothing when sleep mode is off; shutdown
    stops the engine on its loop, then the loop thread."""
    import asyncio
    import sys
    import threading
    import types

    from verl_diffusion.rollout.vllm_omni.replica import _EngineThread

    class LoRARequest:                       # vllm_omni.lora.request.LoRARequest's positional fields
        def __init__(self, lora_name, lora_int_id, lora_path):
            self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

    for name in ("vllm_omni", "vllm_omni.lora"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm_omni.lora.request", types.SimpleNamespace(LoRARequest=LoRARequest))
    adapter = _adapter(tiny_sd3_path)
    engine = _RecordingEngine()
    thread = _EngineThread.__new__(_EngineThread)      # its loop thread, as in production; our engine instead
    thread.loop = asyncio.new_event_loop()
    thread.thread = threading.Thread(target=thread.loop.run_forever, daemon=True)
    thread.thread.start()
    thread.engine = engine
    adapter._engine = thread
    lora = [("a.to_q.lora_A.default.weight", torch.ones(4, 8)), ("a.to_q.lora_B.default.weight", torch.zeros(8, 4))]
    for step in (1, 2):
        asyncio.run(adapter.update_weights(iter(lora), global_steps=step))
    asyncio.run(adapter.update_weights(iter([("a.to_q.weight", torch.ones(8, 8))]), global_steps=3))
    asyncio.run(adapter.release())
    asyncio.run(adapter.resume(tags=["weights"]))
    names = [c[0] for c in engine.calls]
    assert names == ["add_lora", "add_lora", "remove_lora", "collective_rpc", "sleep", "wake_up"]
    assert [engine.calls[0][1], engine.calls[1][1], engine.calls[2][1]] == [1, 2, 1]
    state, config = read_lora_dir(engine.calls[1][2])
    assert sorted(state) == ["a.to_q.lora_A.weight", "a.to_q.lora_B.weight"] and config["r"] == 4
    assert engine.calls[3][1:] == ("verl_load_weights", ["a.to_q.weight"])
    assert engine.calls[4][1:] == (1,) and engine.calls[5][1:] == (["weights"],)
    adapter.engine_kwargs["enable_sleep_mode"] = False
    asyncio.run(adapter.release())
    assert len(engine.calls) == 6
    adapter.shutdown_engine()
    assert engine.calls[-1] == ("shutdown",) and adapter._engine is None and not thread.thread.is_alive()
