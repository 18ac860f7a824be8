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

from typing import Optional, Sequence

import torch

from verl_diffusion.models.base import Conditioning, DiffusersAdapter, scheduler_sigmas, to_uint8
from verl_diffusion.models.tiny_parts import SD3_VAE_SCALING_FACTOR, SD3_VAE_SHIFT_FACTOR, clip_tokenizer, t5_tokenizer

# Flow-GRPO's SD3.5 LoRA targets: the joint-attention projections of both streams.
SD3_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
]


class SD3Adapter(DiffusersAdapter):
    """SD3 / SD3.5 primitives (``FlowModelAdapter``)."""

    name = "sd3"
    architecture = "StableDiffusion3Pipeline"
    transformer_class = "SD3Transformer2DModel"
    frozen_components = ("vae", "text_encoder", "text_encoder_2", "text_encoder_3")
    LORA_TARGETS = SD3_LORA_TARGETS

    @staticmethod
    def latent_grid(transformer_config, vae_config, height, width):
        """SD3 keeps the VAE's latents (the transformer patchifies them)."""
        f = 2 ** (len(vae_config["block_out_channels"]) - 1)
        return f * int(transformer_config.get("patch_size", 2)), (int(transformer_config["in_channels"]),
                                                                   height // f, width // f)

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


ADAPTER = SD3Adapter


def build_tiny_pipeline(
    *,
    seed: int = 0,
    sample_size: int = 16,
    num_layers: int = 2,
    attention_head_dim: int = 8,
    num_attention_heads: int = 4,
    text_width: int = 16,
    text_seq_len: int = 16,
    latent_channels: int = 16,
    vae_channels: int = 8,
    vae_blocks: int = 3,
    vocab: Optional[Sequence[str]] = None,
    shift: float = 3.0,
    dtype: torch.dtype = torch.float32,
):
    """Build a random tiny ``StableDiffusion3Pipeline`` offline.

    Args:
      seed: torch seed for all random weights (same seed → bitwise same weights).
      sample_size: latent height = width; pixels = f·sample_size with the VAE factor f = 2^(vae_blocks − 1).
      num_layers, attention_head_dim, num_attention_heads: the joint transformer (width = heads·head_dim).
      text_width: hidden width of each CLIP encoder; T5 and the joint attention use 2·text_width, so the
        padded CLIP-L/G concat fits exactly as in SD3.
      text_seq_len: CLIP and T5 token length (L = 2·text_seq_len tokens of conditioning).
      latent_channels: 16 as in SD3.
      vae_channels: width of the VAE blocks.
      vae_blocks: number of VAE encoder/decoder blocks (3: factor 4, 2: factor 2).
      vocab: whole words of the tokenizers (lower-case; e.g. a prompt vocabulary), on top of the characters.
      shift: FlowMatchEulerDiscreteScheduler shift (SD3: 3).
    Returns: StableDiffusion3Pipeline on CPU in ``dtype``.
    """
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    words = [w.lower() for w in vocab or ()]
    tokenizer = clip_tokenizer(text_seq_len, words)
    tokenizer_2 = clip_tokenizer(text_seq_len, words)
    tokenizer_3 = t5_tokenizer(text_seq_len, words)
    joint_dim = 2 * text_width

    torch.manual_seed(seed)
    clip_cfg = dict(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=text_seq_len,
        projection_dim=text_width, hidden_act="gelu", bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_3 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_3), d_model=joint_dim, d_kv=8, d_ff=2 * joint_dim, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    ))
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=latent_channels, out_channels=latent_channels,
        num_layers=num_layers, attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads, joint_attention_dim=joint_dim,
        caption_projection_dim=attention_head_dim * num_attention_heads,
        pooled_projection_dim=2 * text_width, pos_embed_max_size=max(sample_size, 16),
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * vae_blocks, up_block_types=("UpDecoderBlock2D",) * vae_blocks,
        block_out_channels=(vae_channels,) * vae_blocks, layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=min(4, vae_channels), sample_size=2 ** (vae_blocks - 1) * sample_size,
        scaling_factor=SD3_VAE_SCALING_FACTOR, shift_factor=SD3_VAE_SHIFT_FACTOR,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae, text_encoder, text_encoder_2, text_encoder_3):
        module.eval()
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)
