"""The stock diffusers pipeline sampled from given initial noise: the reference an exported model is held to."""

from __future__ import annotations

import torch


def stock_images(pipe, adapter, prompts, noise, *, steps: int, size: int, guidance: float = 1.0,
                 negative_prompt: str = "") -> torch.Tensor:
    """uint8 [B, 3, H, W] from ``pipe(...)`` (output_type pt, rounded as our validation rounds), starting from
    ``noise`` [B, C, h, w] in the adapter's latent layout (packed into tokens for Qwen-Image and FLUX.1)."""
    arch = type(pipe).__name__
    kw = dict(prompt=list(prompts), num_inference_steps=steps, height=size, width=size, output_type="pt")
    cfg = guidance != 1.0
    if arch == "QwenImagePipeline":
        kw.update(latents=adapter.pack(noise), true_cfg_scale=guidance,
                  negative_prompt=[negative_prompt] * len(prompts) if cfg else None)
    elif arch == "FluxPipeline":
        kw.update(latents=adapter.pack(noise), true_cfg_scale=guidance,
                  guidance_scale=adapter.distilled_guidance_scale,
                  negative_prompt=[negative_prompt] * len(prompts) if cfg else None,
                  max_sequence_length=adapter.max_sequence_length)
    elif arch == "Flux2KleinPipeline":
        kw.update(latents=noise, guidance_scale=guidance, max_sequence_length=adapter.max_sequence_length)
    else:
        kw.update(latents=noise, guidance_scale=guidance, max_sequence_length=adapter.max_sequence_length,
                  negative_prompt=[negative_prompt] * len(prompts) if cfg else None)
    with torch.no_grad():
        out = pipe(**kw).images
    return (out.float().clamp(0, 1) * 255).round().to(torch.uint8)


def seeded_noise(shape, seeds) -> torch.Tensor:
    """The validation's initial noise: sample i from ``torch.Generator().manual_seed(seeds[i])``."""
    return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds])
