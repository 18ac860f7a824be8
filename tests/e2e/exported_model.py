"""Checks that a run's exported model, loaded by stock diffusers, samples what the run's validation sampled."""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "export"))
from export_stock import seeded_noise, stock_images  # noqa: E402


def assert_export_samples_validation(model: str, run_dir: str, *, kind: str, levels: int = 1) -> dict:
    """``model`` (``<run_dir>/model``) is of ``kind``; the stock pipeline (the base model plus ``load_lora_weights``
    for a LoRA) samples the run's first validation images (``validation/baseline.pt``: a run validated once) from
    the validation's prompts and seeds, within ``levels`` grey levels. Returns ``export_info.json``."""
    from diffusers import DiffusionPipeline

    from verl_diffusion.models import get_adapter_cls
    from verl_diffusion.trainer.dataset import read_rows

    assert model == os.path.join(run_dir, "model"), model
    info = json.loads(open(os.path.join(model, "export_info.json")).read())
    assert info["kind"] == kind, info
    s = info["sampling"]
    baseline = torch.load(os.path.join(run_dir, "validation", "baseline.pt"), weights_only=True)
    images = baseline["images"]
    assert int(baseline["step"]) == int(info["step"]), (baseline["step"], info["step"])
    prompts = [r["prompt"] for r in read_rows(s["val_files"][0], prompt_key="prompt")]
    n = len(images)
    prompts = (prompts * n)[:n]
    # The run's validation sampled with the pipeline in model.dtype (text encoders, VAE; bf16 recipes): the same here.
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[s.get("dtype", "fp32")]
    if kind == "lora":
        pipe = DiffusionPipeline.from_pretrained(info["base_model"], torch_dtype=dtype)
        pipe.load_lora_weights(model)
    else:
        pipe = DiffusionPipeline.from_pretrained(model, torch_dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    arch = info["architecture"]
    from verl_diffusion.models import PIPELINE_ARCHITECTURES

    adapter = get_adapter_cls(PIPELINE_ARCHITECTURES[arch]).from_pipeline(pipe)
    size = int(s["resolution"])
    noise = seeded_noise(adapter.latent_shape(size, size), range(n))
    stock = stock_images(pipe, adapter, prompts, noise, steps=int(s["num_steps"]), size=size,
                         guidance=float(s["guidance_scale"]), negative_prompt=s["negative_prompt"])
    diff = (stock.int() - images.int()).abs()
    assert stock.shape == images.shape, (stock.shape, images.shape)
    if dtype == torch.float32:
        assert int(diff.max()) <= levels, int(diff.max())
    else:
        # A bf16 stock pipeline also keeps the latents in bf16 between steps, where our sampler keeps them in fp32
        # and casts only the transformer's input: the images agree to a few grey levels, not exactly (measured on
        # the tiny recipes: max 5-12 levels). The fp32 tests (tests/export) check the formats exactly.
        assert float(diff.float().mean()) <= 2.0 and int(diff.max()) <= 32, (float(diff.float().mean()), int(diff.max()))
    return info
