"""Stable Diffusion 3 / 3.5 adapter: primitives over the ``StableDiffusion3Pipeline`` components.

Composes the pipeline (its own ``encode_prompt`` for CLIP-L/G + T5, its VAE and transformer); the sampling
loop lives in ``verl_diffusion.rollout``, the math in ``verl_diffusion.algos``. docs/algorithms.md §0.1: t ∈ [0, 1],
t = 1 is noise; the transformer receives ``timestep`` = 1000·t.

Latents: [B, 16, H/8, W/8], the VAE's scaled latents (the transformer patchifies internally).
Grid: the pipeline's scheduler (``FlowMatchEulerDiscreteScheduler(shift=3)`` for SD3.5: at N = 10 the last
non-zero time is 0.0089, docs/algorithms.md §1.1), with ``mu`` when the scheduler is configured for dynamic shifting.
CFG: one batched forward of [negative; conditional], v = v_neg + s·(v_cond − v_neg), as the pipeline.
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_diffusion.models.base import Conditioning, DiffusersAdapter, scheduler_sigmas, to_uint8

# Flow-GRPO's SD3.5 LoRA targets: the joint-attention projections of both streams.
SD3_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
]


class SD3Adapter(DiffusersAdapter):
    """SD3 / SD3.5 primitives (``FlowModelAdapter``)."""

    architecture = "StableDiffusion3Pipeline"
    frozen_components = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    LORA_TARGETS = SD3_LORA_TARGETS

    def __init__(self, pipe, *, max_sequence_length: int = 256):
        super().__init__(pipe)
        # T5 token length: SD3's 256, capped by the tokenizer (tiny models use short sequences).
        tok3 = getattr(pipe, "tokenizer_3", None)
        cap = getattr(tok3, "model_max_length", None) if tok3 is not None else None
        self.max_sequence_length = min(max_sequence_length, cap) if isinstance(cap, int) and cap > 0 \
            else max_sequence_length
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.patch_size = self.transformer.config.patch_size
        self.latent_channels = self.transformer.config.in_channels

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, height / f, width / f) with f the VAE factor; sizes must be multiples of f·patch."""
        self._check_size(height, width, self.vae_scale_factor * self.patch_size,
                         f"VAE factor {self.vae_scale_factor} × patch {self.patch_size}")
        return (self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

    def sampling_grid(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The pipeline's grid: ``set_timesteps(N)`` (``mu`` from the token count if dynamic shifting)."""
        cfg = self.pipe.scheduler.config
        kwargs = {}
        if cfg.get("use_dynamic_shifting", None):
            from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

            _, h, w = self.latent_shape(height, width)
            seq = (h // self.patch_size) * (w // self.patch_size)
            kwargs["mu"] = calculate_shift(seq, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                                           cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.16))
        return scheduler_sigmas(self.pipe.scheduler, num_steps, **kwargs)

    # ------------------------------------------------------------------ primitives

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> Conditioning:
        """CLIP-L/G + T5 conditioning exactly as the pipeline builds it (no CFG negatives).

        Returns: Conditioning(prompt_embeds [B, L_clip + L_t5, D_t5], pooled_prompt_embeds [B, D_l + D_g]).
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts), prompt_2=None, prompt_3=None, device=self.device,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return Conditioning(prompt_embeds=embeds, pooled_prompt_embeds=pooled)

    def _forward(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        dtype = self.dtype
        out = self.transformer(
            hidden_states=x.to(dtype),
            encoder_hidden_states=cond.prompt_embeds.to(dtype),
            pooled_projections=cond.pooled_prompt_embeds.to(dtype),
            timestep=(t * 1000).to(dtype),
            return_dict=False,
        )[0]
        return out

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning, *,
                 guidance_scale: float = 1.0, negative_cond: Optional[Conditioning] = None) -> torch.Tensor:
        """v_θ(x_t, t, c), x_t [B, C, h, w], t [B] ∈ [0, 1] → [B, C, h, w] in x_t's dtype.

        CFG (guidance_scale ≠ 1): one batched forward of [negative; conditional],
        v = v_neg + s·(v_cond − v_neg).
        """
        if t.dim() == 0:
            t = t.expand(x_t.shape[0])
        if not self._check_cfg(guidance_scale, negative_cond):
            return self._forward(x_t, t, cond).to(x_t.dtype)
        both = self._forward(torch.cat([x_t, x_t]), torch.cat([t, t]), Conditioning.cat([negative_cond, cond]))
        v_neg, v_cond = both.to(x_t.dtype).chunk(2)
        return v_neg + guidance_scale * (v_cond - v_neg)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] → uint8 images [B, 3, H, W] (VAE scaling and shift factors undone)."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        image = self.vae.decode(z, return_dict=False)[0]
        return to_uint8(image)
