"""Our SD3 pipeline loaded and run through the real vllm-omni classes on CPU (docs/vllm_omni.md).

Each check compares with the diffusers rollout on the same plan (same x_{t_0}, window and window noise): every
output key is compared with ``torch.equal`` — bitwise, not to a tolerance — because both backends run the same
modules with the same weights through the same ``DiffusersRollout.run_trajectory`` and ``algos.sde`` kernels, in
the same micro-batch composition, on the same device. Where vllm-omni batches rows differently the transformer's
batched matmuls round differently; that case is checked to 1e-5 and stated.

Runs where vllm-omni is installed (``make test-vllm-omni``: .venv-vllm-omni, scripts/setup_vllm_omni_cpu.sh).
"""

import dataclasses
import types

import pytest
import torch

vllm_omni = pytest.importorskip(
    "vllm_omni", reason="vllm-omni is not installed here; `make test-vllm-omni` runs these tests in .venv-vllm-omni")

from omni_pipeline_helpers import (assert_bitwise, collate, diffusers_batch, extension_cls,  # noqa: E402
                                   load_pipeline, max_abs_diff, od_config, run, train_rollout_gap, worker_over)
from vllm_omni.diffusion.request import OmniDiffusionRequest  # noqa: E402
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch  # noqa: E402
from vllm_omni.inputs.data import OmniDiffusionSamplingParams  # noqa: E402
from vllm_omni.lora.request import LoRARequest  # noqa: E402
from vllm_omni_cases import GROUPS, PROMPTS, generate_request, rollout_config  # noqa: E402

from verl_diffusion.models.sd3 import SD3Adapter  # noqa: E402
from verl_diffusion.rollout.vllm_omni.pipelines import PIPELINES, SD3RolloutPipeline  # noqa: E402
from verl_diffusion.rollout.vllm_omni.protocol import collate_trajectories, write_lora_dir  # noqa: E402
from verl_diffusion.rollout.vllm_omni.replica import build_engine_requests, split_lora_weights, trajectory_of  # noqa: E402

LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]


@pytest.fixture(scope="module")
def pipeline(tiny_sd3_path):
    """Loaded the way vllm-omni's model runner loads a custom pipeline (load_format='custom_pipeline')."""
    return load_pipeline(tiny_sd3_path)


@pytest.fixture(scope="module")
def worker(pipeline):
    """Our worker extension over the real pipeline, as vllm-omni mixes it into its worker (model_runner.pipeline)."""
    return worker_over(pipeline)


@pytest.fixture(scope="module")
def reference(tiny_sd3_path):
    """The trainer's side: the SD3 adapter loaded by diffusers."""
    return SD3Adapter.from_pretrained(tiny_sd3_path)


def engine_requests(cfg, request):
    rows = build_engine_requests(cfg, request, (16, 16, 16), sampling_params_cls=OmniDiffusionSamplingParams)
    return [OmniDiffusionRequest(prompt=r["prompt"], sampling_params=r["sampling_params"], request_id=r["request_id"])
            for r in rows]


def test_loader_fills_every_transformer_weight_from_the_checkpoint(pipeline, reference):
    assert type(pipeline) is SD3RolloutPipeline and PIPELINES["StableDiffusion3Pipeline"] is SD3RolloutPipeline
    assert [s.prefix for s in pipeline.weights_sources] == ["transformer."]
    ours, theirs = pipeline.transformer.state_dict(), reference.transformer.state_dict()
    assert set(ours) == set(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_forward_is_bitwise_the_diffusers_rollout(pipeline, reference):
    cfg = rollout_config()
    request = generate_request(seed=3)
    outs = run(pipeline, engine_requests(cfg, request))
    assert len(outs) == len(PROMPTS)
    got, ref = collate(outs), diffusers_batch(reference, cfg, request)
    assert_bitwise(got, ref)
    assert got["all_latents"].shape == (6, 7, 16, 16, 16) and got["images"].shape == (6, 3, 64, 64)
    assert got["train_mask"][0].tolist() == [0, 1, 1, 0, 0, 0]
    for i, o in enumerate(outs):     # the vllm-omni contract fields carry the same tensors
        assert torch.equal(o.trajectory_latents, ref["all_latents"][i])
        assert torch.equal(o.trajectory_timesteps, ref["sigmas"][i])
        assert torch.equal(o.trajectory_log_probs, ref["rollout_log_probs"][i])


def test_rows_split_across_vllm_omni_batches_match_to_round_off(pipeline, reference):
    """vllm-omni co-batches requests as its scheduler decides. Split over batches, the text encoders and the
    transformer see other batch sizes, whose batched matmuls round differently: equal to 1e-5, not bitwise. (The
    train/rollout gap does not depend on it: the trainer recomputes from the returned conditioning.)"""
    request = generate_request(seed=5)
    ref = diffusers_batch(reference, rollout_config(micro_batch_size=3), request)
    for sizes in ([2, 4], [1] * 6):
        got = collate(run(pipeline, engine_requests(rollout_config(micro_batch_size=3), request), sizes))
        print(f"\nsd3: rows in vllm-omni batches {sizes}: max |Δ| latents/log-probs = {max_abs_diff(got, ref):.2e}")
        for key in ("all_latents", "rollout_log_probs", "prompt_embeds", "old_velocities"):
            torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=1e-4, msg=f"{sizes} {key}")
        assert torch.equal(got["train_mask"], ref["train_mask"]) and torch.equal(got["sde_std"], ref["sde_std"])


def test_train_rollout_log_prob_gap_is_zero_on_cpu(pipeline, reference):
    """The consistency metric: the trainer's recomputation (its own forward at the stored states, with the stored
    conditioning and coefficients) minus the replica's log-probs, mean |Δ| over trained steps: exactly 0 here."""
    got = collate(run(pipeline, engine_requests(rollout_config(), generate_request(seed=7))))
    gap, steps = train_rollout_gap(reference, got)
    assert steps == 2 and gap == 0.0


def test_engine_postprocess_delivers_the_trajectory_to_the_client(pipeline, tiny_sd3_path):
    """vllm-omni's own DiffusionEngine.postprocess_output turns our DiffusionOutput into the OmniRequestOutput the
    replica reads; the replica's parser gets back every tensor."""
    from vllm_omni.diffusion.diffusion_engine import DiffusionEngine
    from vllm_omni.diffusion.registry import get_diffusion_post_process_func

    od = od_config(tiny_sd3_path)
    engine = types.SimpleNamespace(od_config=od, post_process_func=get_diffusion_post_process_func(od),
                                   _post_process_accepts_sampling_params=False)
    requests = engine_requests(rollout_config(), generate_request(seed=11))
    outs = run(pipeline, requests)
    client = [DiffusionEngine.postprocess_output(engine, r, o)[0] for r, o in zip(requests, outs)]
    assert_bitwise(collate_trajectories([trajectory_of(c) for c in client]), collate(outs))
    assert torch.equal(client[0].trajectory_log_probs, outs[0].trajectory_log_probs)
    assert client[0].final_output_type == "image"


def _trainer_lora(reference_path, seed):
    """A trainer-side adapter with the engine's LoRA injection and non-zero B (a trained adapter)."""
    from peft import LoraConfig, inject_adapter_in_model

    adapter = SD3Adapter.from_pretrained(reference_path)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, bias="none"),
                            adapter.transformer, adapter_name="default")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    # The actor's weight stream: LoRA parameters with their names in the module (docs/rollout_replicas.md §4).
    named = [(n, p.detach().clone()) for n, p in adapter.transformer.named_parameters() if "lora_" in n]
    return adapter, named


def test_lora_through_add_and_remove_lora_is_bitwise_the_trainers(pipeline, worker, reference, tiny_sd3_path,
                                                                  tmp_path):
    cfg, request = rollout_config(), generate_request(seed=13)
    config = {"r": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS}
    trained1, named1 = _trainer_lora(tiny_sd3_path, seed=1)
    trained2, named2 = _trainer_lora(tiny_sd3_path, seed=2)
    lora1, full1 = split_lora_weights(named1)
    assert not full1 and all(".default." not in k for k in lora1)
    assert worker.add_lora(LoRARequest("v1", 1, str(write_lora_dir(tmp_path / "1", lora1, config))))
    assert_bitwise(collate(run(pipeline, engine_requests(cfg, request))), diffusers_batch(trained1, cfg, request))
    # A sync: add the new version, then remove the old one; the new one stays active.
    assert worker.add_lora(LoRARequest("v2", 2, str(write_lora_dir(tmp_path / "2", split_lora_weights(named2)[0],
                                                                    config))))
    assert worker.remove_lora(1) and worker.list_loras() == [2] and not worker.remove_lora(1)
    assert_bitwise(collate(run(pipeline, engine_requests(cfg, request))), diffusers_batch(trained2, cfg, request))
    # Removing the active adapter samples with the base weights again.
    assert worker.remove_lora(2) and worker.list_loras() == []
    assert_bitwise(collate(run(pipeline, engine_requests(cfg, request))), diffusers_batch(reference, cfg, request))


def test_full_weight_sync_through_the_extension_is_bitwise(pipeline, worker, reference, tiny_sd3_path):
    """The collective_rpc method: the actor's full transformer state (names without the pipeline prefix)."""
    trained = SD3Adapter.from_pretrained(tiny_sd3_path)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in trained.transformer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    state = trained.transformer.state_dict()
    assert worker.verl_load_weights(list(state.items())) == len(state)
    cfg, request = rollout_config(), generate_request(seed=17)
    assert_bitwise(collate(run(pipeline, engine_requests(cfg, request))), diffusers_batch(trained, cfg, request))
    with pytest.raises(KeyError, match="matches no parameter"):
        worker.verl_load_weights([("transformer_blocks.99.attn.to_q.weight", torch.zeros(1))])
    # Back to the checkpoint's weights (the module-scoped pipeline serves the other tests).
    worker.verl_load_weights(list(reference.transformer.state_dict().items()))
    assert_bitwise(collate(run(pipeline, engine_requests(cfg, request))), diffusers_batch(reference, cfg, request))


def test_extension_methods_win_over_the_workers_own(tiny_sd3_path):
    """vllm-omni builds type(name, (extension, DiffusionWorker), {}): our LoRA entry points must come first, and
    the engine config carries our pipeline and extension."""
    from vllm_omni.diffusion.diffusion_engine import _resolve_custom_pipeline_cls, supports_request_batch

    VerlDiffusionWorkerExtension = extension_cls()
    from vllm_omni.diffusion.worker.diffusion_worker import DiffusionWorker

    mixed = type("Mixed", (VerlDiffusionWorkerExtension, DiffusionWorker), {})
    for name in ("add_lora", "remove_lora", "list_loras", "init_lora_manager", "verl_load_weights"):
        assert getattr(mixed, name) is getattr(VerlDiffusionWorkerExtension, name), name
    od = od_config(tiny_sd3_path)
    assert od.worker_extension_cls.endswith("VerlDiffusionWorkerExtension")
    assert _resolve_custom_pipeline_cls(od.custom_pipeline_args) is SD3RolloutPipeline
    assert supports_request_batch(od) and od.enforce_eager


def test_registered_architecture_resolves_in_vllm_omni_registry():
    from vllm_omni.diffusion.registry import DiffusionModelRegistry

    from verl_diffusion.rollout.vllm_omni.pipelines import register_pipelines

    names = register_pipelines()
    assert sorted(names) == sorted(PIPELINES) == ["Flux2KleinPipeline", "FluxPipeline", "QwenImagePipeline",
                                                  "StableDiffusion3Pipeline"]
    for arch, cls in PIPELINES.items():
        assert DiffusionModelRegistry._try_load_model_cls(names[arch]) is cls, arch


def test_request_without_our_plan_is_refused(pipeline):
    bad = OmniDiffusionRequest(prompt="a cat", request_id="x", sampling_params=OmniDiffusionSamplingParams())
    with pytest.raises(ValueError, match="extra_args"):
        pipeline.forward(DiffusionRequestBatch([bad]))


def test_mixed_windows_in_one_vllm_omni_batch_run_as_separate_groups(pipeline, reference):
    """Requests of two generate calls (different windows) may share a vllm-omni batch; each keeps its own plan."""
    cfg_a = rollout_config(micro_batch_size=3)
    cfg_b = dataclasses.replace(cfg_a, window=dataclasses.replace(cfg_a.window, lo=3))
    ra = generate_request(seed=19, prompts=PROMPTS[:3], group_ids=GROUPS[:3])
    rb = generate_request(seed=23, prompts=PROMPTS[3:], group_ids=GROUPS[3:])
    outs = run(pipeline, engine_requests(cfg_a, ra) + engine_requests(cfg_b, rb))
    assert_bitwise(collate(outs[:3]), diffusers_batch(reference, cfg_a, ra))
    assert_bitwise(collate(outs[3:]), diffusers_batch(reference, cfg_b, rb))
