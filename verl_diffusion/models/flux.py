"""FLUX.1 adapter (FLUX.1-dev, FLUX.1-schnell): primitives over diffusers' ``FluxPipeline``.

What this file reproduces from the pipeline (diffusers 0.42):

* **Prompt encoding**: the pipeline's ``encode_prompt``: CLIP-L's pooled output (77 tokens) and T5-XXL's
  last hidden state padded to ``max_sequence_length`` (512), attended without a mask as the pipeline
  does. The text position ids are zeros [L, 3]; they are rebuilt in ``velocity``, never stored.
* **Latents**: [B, 16, H/8, W/8], the VAE's scaled and shifted latents. ``velocity`` packs 2×2 patches into
  [B, (H/16)(W/16), 64] with image ids (0, row, col) and unpacks the prediction; any multiple of 16 pixels.
* **Timestep**: σ ∈ [0, 1] (the pipeline passes ``1000·σ / 1000``; so do we, bitwise); the model scales it.
* **Grid**: ``linspace(1, 1/N, N)`` shifted with ``mu = calculate_shift(image tokens, …)`` from the
  scheduler config (dynamic shifting): :meth:`sampling_grid`.
* **Guidance**: FLUX.1-dev is guidance-distilled: ``distilled_guidance_scale`` (the pipeline's
  ``guidance_scale``, 3.5) is a transformer input, the same in every call of this adapter, so rollout and
  training see the same model. True CFG (``velocity(guidance_scale=s, negative_cond=...)``, the pipeline's
  ``true_cfg_scale``) runs two forwards as the pipeline, v = v_neg + s·(v_cond − v_neg).
* **LoRA targets**: every projection of the 19 double-stream blocks (attention of both streams, both
  feed-forwards) and of the 38 single-stream blocks (q/k/v, ``proj_mlp``, ``proj_out``, which fuses the
  attention output and the MLP). Public Flow-GRPO-style lists stop at the double-stream attention.
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_diffusion.models.base import (Conditioning, DiffusersAdapter, linspace_grid, lora_target_regex, shift_mu,
                                        to_uint8)
from verl_diffusion.models.tiny_parts import (FLUX_SCHEDULER, FLUX_VAE_SCALING_FACTOR, FLUX_VAE_SHIFT_FACTOR, clip_tokenizer,
                                              rope_axes, t5_tokenizer)

FLUX_LORA_BLOCKS = {
    "transformer_blocks": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                           "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                           "ff_context.net.0.proj", "ff_context.net.2"],
    "single_transformer_blocks": ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out"],
}
FLUX_LORA_TARGETS = lora_target_regex(FLUX_LORA_BLOCKS)


class FluxAdapter(DiffusersAdapter):
    """FLUX.1 primitives (``FlowModelAdapter``).

    Args: pipe: a ``FluxPipeline``.  max_sequence_length: T5 tokens (the pipeline's 512, capped by the
      tokenizer).  distilled_guidance_scale: the guidance embedding's input for guidance-distilled models
      (FLUX.1-dev: 3.5, the pipeline default); ignored by models without a guidance embedding (schnell).
    """

    name = "flux"
    architecture = "FluxPipeline"
    transformer_class = "FluxTransformer2DModel"
    frozen_components = ("vae", "text_encoder", "text_encoder_2")
    LORA_TARGETS = FLUX_LORA_TARGETS

    @staticmethod
    def latent_grid(transformer_config, vae_config, height, width):
        """2×2 latent patches packed into the transformer's input channels (in_channels = 4·C)."""
        f = 2 ** (len(vae_config["block_out_channels"]) - 1)
        return 2 * f, (int(transformer_config["in_channels"]) // 4, height // f, width // f)

    def __init__(self, pipe, *, max_sequence_length: int = 512, distilled_guidance_scale: float = 3.5):
        super().__init__(pipe)
        cap = getattr(getattr(pipe, "tokenizer_2", None), "model_max_length", None)
        self.max_sequence_length = min(int(max_sequence_length), cap) if isinstance(cap, int) and cap > 0 \
            else int(max_sequence_length)
        self.distilled_guidance_scale = float(distilled_guidance_scale)
        self.vae_scale_factor = int(pipe.vae_scale_factor)
        self.latent_channels = self.transformer.config.in_channels // 4

    @property
    def guidance_distilled(self) -> bool:
        return bool(self.transformer.config.guidance_embeds)

    # ------------------------------------------------------------------ shapes and grid

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(16, H/8, W/8); height and width must be multiples of 16 (VAE factor × 2×2 packing)."""
        return self._packed_latent_shape(height, width)

    def sampling_grid(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The pipeline's grid: linspace(1, 1/N, N) shifted with ``mu`` from the image token count."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        _, h, w = self.latent_shape(height, width)
        mu = shift_mu(self.pipe.scheduler.config, (h // 2) * (w // 2), calculate_shift)
        return linspace_grid(self.pipe.scheduler, num_steps, mu=mu)

    # ------------------------------------------------------------------ primitives

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> Conditioning:
        """Returns prompt_embeds [B, L_t5, 4096] and pooled_prompt_embeds [B, 768] (CLIP-L pooled)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=list(prompts), prompt_2=None, device=self.device,
                                                    max_sequence_length=self.max_sequence_length)
        return Conditioning(prompt_embeds=embeds, pooled_prompt_embeds=pooled)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] → [B, (h/2)(w/2), 4C] (the pipeline's 2×2 packing)."""
        b, c, h, w = x.shape
        return self.pipe._pack_latents(x, b, c, h, w)

    def unpack(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        f = self.vae_scale_factor
        return self.pipe._unpack_latents(tokens, h * f, w * f, f)

    def _forward(self, tokens: torch.Tensor, t: torch.Tensor, cond: Conditioning, h: int, w: int) -> torch.Tensor:
        dtype, b = self.dtype, tokens.shape[0]
        guidance = None
        if self.guidance_distilled:
            guidance = torch.full([1], self.distilled_guidance_scale, device=tokens.device,
                                  dtype=torch.float32).expand(b)
        img_ids = self.pipe._prepare_latent_image_ids(b, h // 2, w // 2, tokens.device, dtype)
        txt_ids = torch.zeros(cond.prompt_embeds.shape[1], 3, device=tokens.device, dtype=dtype)
        return self.transformer(
            hidden_states=tokens.to(dtype),
            timestep=((t.float() * 1000) / 1000).to(dtype),
            guidance=guidance,
            pooled_projections=cond.pooled_prompt_embeds.to(dtype),
            encoder_hidden_states=cond.prompt_embeds.to(dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning, *,
                 guidance_scale: float = 1.0, negative_cond: Optional[Conditioning] = None) -> torch.Tensor:
        """v_θ(x_t, t, c): x_t [B, 16, h, w], t [B] ∈ [0, 1] → [B, 16, h, w] in x_t's dtype.

        The distilled guidance embedding (``distilled_guidance_scale``) is always applied (dev); true CFG
        (guidance_scale ≠ 1) adds a negative forward: v = v_neg + s·(v_cond − v_neg), in fp32.
        """
        if t.dim() == 0:
            t = t.expand(x_t.shape[0])
        _, _, h, w = x_t.shape
        tokens = self.pack(x_t)
        v = self._forward(tokens, t, cond, h, w).float()
        if self._check_cfg(guidance_scale, negative_cond):
            v_neg = self._forward(tokens, t, negative_cond, h, w).float()
            v = v_neg + guidance_scale * (v - v_neg)
        return self.unpack(v, h, w).to(x_t.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, 16, h, w] → uint8 images [B, 3, 8h, 8w] (VAE scaling and shift undone)."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype) / cfg.scaling_factor + cfg.shift_factor
        return to_uint8(self.vae.decode(z, return_dict=False)[0])


ADAPTER = FluxAdapter


def build_tiny_pipeline(*, seed: int = 0, num_layers: int = 1, num_single_layers: int = 1,
                        attention_head_dim: int = 16, num_attention_heads: int = 2, text_width: int = 16,
                        text_seq_len: int = 16, latent_channels: int = 16, vae_channels: int = 8,
                        guidance_embeds: bool = True, dtype: torch.dtype = torch.float32):
    """A random tiny ``FluxPipeline`` (FLUX.1-dev layout: guidance embedding on): CLIP-L (pooled) and T5
    text encoders with ``text_seq_len`` tokens, ``num_layers`` double- and ``num_single_layers``
    single-stream blocks, a 16-channel VAE of factor 8 with FLUX's scaling/shift, FLUX.1-dev's scheduler
    config. 64×64 pixels → latents [16, 8, 8], 16 image tokens."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = clip_tokenizer(text_seq_len)
    tokenizer_2 = t5_tokenizer(text_seq_len)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=text_seq_len, projection_dim=text_width,
        hidden_act="gelu", bos_token_id=0, eos_token_id=1, pad_token_id=1))
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=2 * text_width, d_kv=8, d_ff=4 * text_width, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
        joint_attention_dim=2 * text_width, pooled_projection_dim=text_width, guidance_embeds=guidance_embeds,
        axes_dims_rope=rope_axes(attention_head_dim, 3))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(vae_channels,) * 4, layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=min(4, vae_channels), sample_size=64,
        scaling_factor=FLUX_VAE_SCALING_FACTOR, shift_factor=FLUX_VAE_SHIFT_FACTOR,
        use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae, text_encoder, text_encoder_2):
        module.eval()
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)
