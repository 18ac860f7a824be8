"""Helpers of the CPU tests that drive our pipelines through the real vllm-omni classes (import vllm-omni).

Imported only by test modules that have already skipped when vllm-omni is absent.
"""

import types

import pytest
import torch
from vllm.config.load import LoadConfig
from vllm_omni.diffusion.data import OmniDiffusionConfig
from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader
from vllm_omni.diffusion.request import OmniDiffusionRequest
from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch
from vllm_omni.inputs.data import OmniDiffusionSamplingParams

from verl_diffusion.algos.sde import StepCoefficients, gaussian_log_prob, step_mean
from verl_diffusion.models.base import Conditioning
from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout
from verl_diffusion.rollout.vllm_omni import latent_shape_of
from verl_diffusion.rollout.vllm_omni.protocol import collate_trajectories
from verl_diffusion.rollout.vllm_omni.replica import build_engine_requests, engine_kwargs, pipeline_class_for


def od_config(path, **kw) -> OmniDiffusionConfig:
    """The engine config the replica would start with (float32: CPU comparisons)."""
    return OmniDiffusionConfig.from_kwargs(**engine_kwargs(path, dtype=torch.float32, **kw))


def load_pipeline(path, **kw):
    """Our pipeline loaded the way vllm-omni's model runner loads a custom pipeline (load_format='custom_pipeline')."""
    loader = DiffusersPipelineLoader(LoadConfig(), od_config=od_config(path, **kw))
    return loader.load_model(load_device="cpu", load_format="custom_pipeline",
                             custom_pipeline_name=pipeline_class_for(path), device=torch.device("cpu"))


def extension_cls():
    """``VerlDiffusionWorkerExtension``; skips where vllm-omni's worker module does not import: from 0.30 on it loads
    every model's pipeline config, down to transformers' Qwen2-VL image processor, which needs torchvision (no CPU
    wheel on this host)."""
    try:
        from verl_diffusion.rollout.vllm_omni.worker_extension import VerlDiffusionWorkerExtension
    except ImportError as err:
        pytest.skip(f"vllm-omni's worker module does not import on this host ({err}); the GPU tests cover it")
    return VerlDiffusionWorkerExtension


def worker_over(pipeline):
    """Our worker extension over the real pipeline, as vllm-omni mixes it into its worker (``model_runner.pipeline``)."""
    worker = extension_cls()()
    worker.model_runner = types.SimpleNamespace(pipeline=pipeline)
    return worker


def engine_requests(cfg, request, path):
    """The replica's vllm-omni requests for a generate request (one per row)."""
    rows = build_engine_requests(cfg, request, latent_shape_of(path, cfg.height, cfg.width),
                                 sampling_params_cls=OmniDiffusionSamplingParams)
    return [OmniDiffusionRequest(prompt=r["prompt"], sampling_params=r["sampling_params"], request_id=r["request_id"])
            for r in rows]


def run(pipeline, requests, batch_sizes=None):
    """Forward in vllm-omni request batches (sizes ``batch_sizes``); returns the DiffusionOutputs in order."""
    batch_sizes = batch_sizes or [len(requests)]
    outs, lo = [], 0
    for size in batch_sizes:
        outs += pipeline.forward(DiffusionRequestBatch(requests[lo:lo + size]))
        lo += size
    return outs


def collate(outs):
    return collate_trajectories([dict(o.output["payload"]["trajectory"], image=o.output["payload"]["image"][0])
                                 for o in outs])


def diffusers_batch(adapter, cfg, request):
    """The diffusers replica's batch for the same request (one sampling rank: seed·1000 + 0)."""
    return DiffusersRollout(adapter, cfg).generate(request["prompts"], torch.tensor(request["group_ids"]),
                                                   seed=request["seed"] * 1000, store_velocities=True)


def assert_bitwise(got, ref):
    assert set(ref) <= set(got), sorted(set(ref) - set(got))
    for key in ref:
        assert got[key].dtype == ref[key].dtype and torch.equal(got[key], ref[key]), key


def max_abs_diff(got, ref, keys=("all_latents", "rollout_log_probs")) -> float:
    return max((got[k].double() - ref[k].double()).abs().max().item() for k in keys)


def train_rollout_gap(adapter, got, guidance_scale: float = 1.0) -> tuple[float, int]:
    """The consistency metric: the trainer's recomputation (its own forward at the stored states, with the stored
    conditioning and coefficients) minus the replica's log-probs; (mean |Δ| over trained steps, steps)."""
    cond = Conditioning.from_dict(got)
    negative = None
    if guidance_scale != 1.0:
        negative = Conditioning.from_dict({k[len("negative_"):]: v for k, v in got.items()
                                           if k.startswith("negative_")})
    gaps = []
    for k in torch.nonzero(got["train_mask"].any(0)).flatten().tolist():
        with torch.no_grad():
            v = adapter.velocity(got["all_latents"][:, k], got["sigmas"][:, k], cond, guidance_scale=guidance_scale,
                                 negative_cond=negative)
        coef = StepCoefficients(got["sde_cx"][:, k], got["sde_cv"][:, k], got["sde_std"][:, k])
        lp = gaussian_log_prob(got["all_latents"][:, k + 1], step_mean(got["all_latents"][:, k], v, coef), coef.std)
        gaps.append((lp - got["rollout_log_probs"][:, k]).abs())
    return torch.cat(gaps).mean().item(), len(gaps)
