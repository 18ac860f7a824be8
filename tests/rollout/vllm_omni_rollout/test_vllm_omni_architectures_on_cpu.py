"""Qwen-Image, FLUX.1 and FLUX.2 [klein] pipelines through the real vllm-omni classes on CPU (docs/vllm_omni.md).

For each architecture's tiny checkpoint: vllm-omni's ``DiffusersPipelineLoader`` builds our pipeline
(``load_format="custom_pipeline"``) and fills its transformer; a forward over vllm-omni's ``DiffusionRequestBatch``
is compared with the diffusers rollout (``DiffusersRollout.generate``) for the same plan — same x_{t_0}, window and
window noise: every key ``torch.equal`` (max abs diff 0) when the rows share one batch, to round-off when vllm-omni
splits them; the train/rollout log-prob gap is exactly 0. Weight sync: LoRA (the architecture's own targets)
through add/remove LoRA, full weights through the worker extension's ``verl_load_weights``, both bitwise the
trainer's. Each architecture runs its own settings: the model's scheduler grid, true CFG where the model uses it
(Qwen-Image with its norm rescale, FLUX.2 klein-base), FLUX.1's distilled guidance through ``adapter_kwargs``.
The SD3 pipeline's tests (and the engine-level checks shared by every architecture) are in
``test_vllm_omni_pipelines_on_cpu.py``.
"""

import types

import pytest
import torch

pytest.importorskip("vllm_omni", reason="vllm-omni is not installed here; `make test-vllm-omni` runs these tests in "
                                        ".venv-vllm-omni")

from omni_pipeline_helpers import (assert_bitwise, collate, diffusers_batch, engine_requests,  # noqa: E402
                                   load_pipeline, max_abs_diff, run, train_rollout_gap, worker_over)
from vllm_omni.lora.request import LoRARequest  # noqa: E402
from vllm_omni_cases import generate_request, rollout_config  # noqa: E402

from verl_diffusion.models import get_adapter_cls  # noqa: E402
from verl_diffusion.models.tiny import save_tiny  # noqa: E402
from verl_diffusion.rollout.vllm_omni import latent_shape_of  # noqa: E402
from verl_diffusion.rollout.vllm_omni.pipelines import PIPELINES  # noqa: E402
from verl_diffusion.rollout.vllm_omni.protocol import write_lora_dir  # noqa: E402
from verl_diffusion.rollout.vllm_omni.replica import split_lora_weights  # noqa: E402

# architecture -> (diffusers pipeline class, rollout settings, adapter_kwargs, save_tiny options)
CASES = {
    # True CFG with the norm rescale and a negative prompt; the transformer saved in shards, as the real one is.
    "qwen_image": ("QwenImagePipeline", dict(guidance_scale=4.0, negative_prompt=" "), {},
                   dict(max_shard_size="100KB")),
    # FLUX.1-dev: the distilled guidance embedding, set through adapter_kwargs; no CFG.
    "flux": ("FluxPipeline", {}, {"distilled_guidance_scale": 2.0}, {}),
    # klein-base: true CFG, the empirical-mu grid of FLUX.2.
    "flux2_klein": ("Flux2KleinPipeline", dict(guidance_scale=3.0), {}, {}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    """One architecture: its tiny checkpoint, our pipeline loaded by vllm-omni, the trainer's adapter."""
    arch = request.param
    pipeline_name, rollout_kw, adapter_kw, save_kw = CASES[arch]
    path = str(save_tiny(arch, tmp_path_factory.mktemp("vllm_omni") / arch, **save_kw))
    pipeline = load_pipeline(path, adapter_kwargs=adapter_kw)
    adapter_cls = get_adapter_cls(arch)
    return types.SimpleNamespace(
        arch=arch, pipeline_name=pipeline_name, path=path, pipeline=pipeline,
        adapter_cls=adapter_cls, adapter_kw=adapter_kw, reference=adapter_cls.from_pretrained(path, **adapter_kw),
        cfg=rollout_config(grid="scheduler", **rollout_kw), guidance_scale=rollout_kw.get("guidance_scale", 1.0))


def test_loader_builds_our_pipeline_and_fills_every_transformer_weight(case):
    assert type(case.pipeline) is PIPELINES[case.pipeline_name]
    assert [s.prefix for s in case.pipeline.weights_sources] == ["transformer."]
    ours, theirs = case.pipeline.transformer.state_dict(), case.reference.transformer.state_dict()
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)
    # The replica plans latents from the configs alone: the adapter's shape.
    assert latent_shape_of(case.path, 64, 64) == tuple(case.reference.latent_shape(64, 64))
    for k, v in case.adapter_kw.items():
        assert getattr(case.pipeline.adapter, k) == v


def test_forward_is_the_diffusers_rollout_in_one_batch_bitwise_and_split_to_round_off(case):
    """One vllm-omni batch: bitwise, and the train/rollout log-prob gap is exactly 0. Rows split over batches (vllm-omni
    co-batches as its scheduler decides): other batch sizes round differently in batched matmuls, so to round-off;
    for Qwen-Image the batches also differ in text length (the prompts tokenize differently), which the replica pads
    back to one length with mask 0, as the diffusers rollout pads one batch."""
    request = generate_request(seed=3)
    requests = engine_requests(case.cfg, request, case.path)
    outs = run(case.pipeline, requests)
    got, ref = collate(outs), diffusers_batch(case.reference, case.cfg, request)
    split = collate(run(case.pipeline, requests, [2, 4]))
    print(f"\n{case.arch}: vllm-omni pipeline vs diffusers rollout, max |Δ| latents/log-probs: one batch "
          f"{max_abs_diff(got, ref)}, batches [2, 4] {max_abs_diff(split, ref):.2e}")
    assert_bitwise(got, ref)
    assert ("negative_prompt_embeds" in got) == (case.guidance_scale != 1.0)
    assert got["train_mask"][0].tolist() == [0, 1, 1, 0, 0, 0] and bool((got["rollout_log_probs"][:, 1:3] != 0).all())
    for i, o in enumerate(outs):           # the vllm-omni contract fields carry the same tensors
        assert torch.equal(o.trajectory_latents, ref["all_latents"][i])
        assert torch.equal(o.trajectory_timesteps, ref["sigmas"][i])
        assert torch.equal(o.trajectory_log_probs, ref["rollout_log_probs"][i])
    # The scheduler grid is the model's own (not the formula grid of the SD3 tests).
    assert torch.equal(got["sigmas"][0], case.reference.sampling_grid(6, 64, 64).float())
    gap, steps = train_rollout_gap(case.reference, got, case.guidance_scale)
    assert steps == 2 and gap == 0.0
    assert set(split) == set(ref) and split["prompt_embeds"].shape == ref["prompt_embeds"].shape
    for key in ("all_latents", "rollout_log_probs", "prompt_embeds", "old_velocities"):
        torch.testing.assert_close(split[key], ref[key], rtol=1e-5, atol=1e-4, msg=key)
    for key in ("train_mask", "sde_std", "sigmas") + (("prompt_mask",) if "prompt_mask" in ref else ()):
        assert torch.equal(split[key], ref[key]), key


def _trainer_with_lora(case, seed):
    """A trainer-side adapter with the engine's LoRA injection (the architecture's targets) and non-zero B."""
    from peft import LoraConfig, inject_adapter_in_model

    adapter = case.adapter_cls.from_pretrained(case.path, **case.adapter_kw)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=adapter.lora_targets(), bias="none"),
                            adapter.transformer, adapter_name="default")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in adapter.transformer.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    named = [(n, p.detach().clone()) for n, p in adapter.transformer.named_parameters() if "lora_" in n]
    return adapter, named


def test_lora_then_full_weights_are_bitwise_the_trainers(case, tmp_path):
    # One row per prompt keeps it cheap; the SD3 tests check the full batch and the return to the base model.
    worker, pipeline, cfg = worker_over(case.pipeline), case.pipeline, case.cfg
    request = generate_request(seed=13, prompts=["a cat", "the word ok"], group_ids=[0, 1])
    config = {"r": 4, "lora_alpha": 8, "target_modules": case.reference.lora_targets()}
    trained1, named1 = _trainer_with_lora(case, seed=1)
    trained2, named2 = _trainer_with_lora(case, seed=2)
    assert worker.add_lora(LoRARequest("v1", 1, str(write_lora_dir(tmp_path / "1", split_lora_weights(named1)[0],
                                                                    config))))
    assert_bitwise(collate(run(pipeline, engine_requests(cfg, request, case.path))),
                   diffusers_batch(trained1, cfg, request))
    # A sync: add the new version, remove the old one.
    assert worker.add_lora(LoRARequest("v2", 2, str(write_lora_dir(tmp_path / "2", split_lora_weights(named2)[0],
                                                                    config))))
    assert worker.remove_lora(1) and worker.list_loras() == [2]
    assert_bitwise(collate(run(pipeline, engine_requests(cfg, request, case.path))),
                   diffusers_batch(trained2, cfg, request))
    assert worker.remove_lora(2) and worker.list_loras() == []
    # Full weights (the actor's transformer state, names without the pipeline prefix) through collective_rpc's
    # method; with the LoRA layers still injected they land in peft's base_layer weights.
    full = case.adapter_cls.from_pretrained(case.path, **case.adapter_kw)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in full.transformer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    state = full.transformer.state_dict()
    assert worker.verl_load_weights(list(state.items())) == len(state)
    assert_bitwise(collate(run(pipeline, engine_requests(cfg, request, case.path))),
                   diffusers_batch(full, cfg, request))
    worker.verl_load_weights(list(case.reference.transformer.state_dict().items()))   # the checkpoint again
