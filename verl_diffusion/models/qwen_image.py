"""Qwen-Image adapter: primitives over diffusers' ``QwenImagePipeline`` (Qwen2.5-VL text encoder, MMDiT).

How the architecture works, and what this file reproduces from the pipeline (diffusers 0.42):

* **Prompt encoding**: the pipeline's own ``encode_prompt``: the prompt inside its chat template
  (system "Describe the image by detailing …", user, assistant), the last hidden state of Qwen2.5-VL, the
  template's first 34 tokens dropped, each prompt's real tokens padded to the batch's longest with a mask
  (``prompt_mask``, 1 = real). Current diffusers takes the mask (``encoder_hidden_states_mask``), not
  ``txt_seq_lens``; the text RoPE positions count from the first token, so trailing padding (which this
  adapter trims per forward, :meth:`Conditioning.trimmed`) changes nothing.
* **Latents**: [B, 16, H/8, W/8] (the VAE's single frame, normalised with ``latents_mean / latents_std``).
  ``velocity`` packs them into 2×2 patches, [B, (H/16)(W/16), 64], with ``img_shapes`` = (1, H/16, W/16)
  for the image RoPE, and unpacks the prediction; any size that is a multiple of 16 pixels.
* **Timestep**: the transformer takes σ ∈ [0, 1] (the pipeline passes ``1000·σ / 1000``; so do we, bitwise).
* **Grid**: ``sigmas = linspace(1, 1/N, N)`` with the resolution-dependent shift ``mu =
  calculate_shift(image tokens, …)`` from the scheduler's config (dynamic shifting, and the scheduler's
  ``shift_terminal`` when set): :meth:`sampling_grid`.
* **Guidance**: true CFG, two forwards (conditional, negative) as the pipeline, combined
  v = v_neg + s·(v_cond − v_neg) and rescaled per image token to the conditional prediction's norm
  (Qwen-Image's norm-preserving CFG), over the 64 packed channels of each token. No distilled guidance.
* **LoRA targets**: every attention projection of both streams and both streams' feed-forward layers
  (verl PR #5951's list; the adaptive-norm modulations ``img_mod`` / ``txt_mod`` are not projections).
"""

from __future__ import annotations

from typing import Optional

import torch

from verl_diffusion.models.base import Conditioning, DiffusersAdapter, linspace_grid, shift_mu, to_uint8
from verl_diffusion.models.tiny_parts import QWEN_IMAGE_SCHEDULER, QWEN_SPECIALS, qwen_tokenizer, rope_axes

# Attention of both streams + the image and text MLPs of every block (peft suffixes; a test checks that they
# cover every such Linear of the real module tree and nothing else).
QWEN_IMAGE_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj", "txt_mlp.net.2",
]


class QwenImageAdapter(DiffusersAdapter):
    """Qwen-Image primitives (``FlowModelAdapter``).

    Args: pipe: a ``QwenImagePipeline``.  max_sequence_length: text tokens kept after the template (the
      pipeline's default 512; at most 1024).  cfg_renorm: rescale the guided velocity to the conditional
      one's per-token norm, as the pipeline does (default True).
    """

    name = "qwen_image"
    architecture = "QwenImagePipeline"
    transformer_class = "QwenImageTransformer2DModel"
    frozen_components = ("vae", "text_encoder")
    LORA_TARGETS = QWEN_IMAGE_LORA_TARGETS

    @staticmethod
    def latent_grid(transformer_config, vae_config, height, width):
        """The causal 3D VAE (factor 2 per temporal-downsample entry); 2×2 latent patches packed into the
        transformer's input channels (in_channels = 4·C)."""
        f = 2 ** len(vae_config["temperal_downsample"])
        return 2 * f, (int(transformer_config["in_channels"]) // 4, height // f, width // f)

    def __init__(self, pipe, *, max_sequence_length: int = 512, cfg_renorm: bool = True):
        super().__init__(pipe)
        if not 1 <= int(max_sequence_length) <= 1024:
            raise ValueError(f"max_sequence_length={max_sequence_length} must be in [1, 1024] (QwenImagePipeline)")
        self.max_sequence_length = int(max_sequence_length)
        self.cfg_renorm = bool(cfg_renorm)
        self.vae_scale_factor = int(pipe.vae_scale_factor)
        self.latent_channels = self.transformer.config.in_channels // 4

    # ------------------------------------------------------------------ shapes and grid

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, H/8, W/8); height and width must be multiples of 16 (VAE factor × 2×2 packing)."""
        return self._packed_latent_shape(height, width)

    def sampling_grid(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The pipeline's grid: linspace(1, 1/N, N) shifted with ``mu`` from the image token count."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

        _, h, w = self.latent_shape(height, width)
        mu = shift_mu(self.pipe.scheduler.config, (h // 2) * (w // 2), calculate_shift)
        return linspace_grid(self.pipe.scheduler, num_steps, mu=mu, flow_sigmas=False)

    # ------------------------------------------------------------------ primitives

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> Conditioning:
        """The pipeline's template encoding. Returns prompt_embeds [B, L, 3584] (L = longest prompt of the
        call, after the 34 dropped template tokens) and prompt_mask [B, L] int64."""
        if isinstance(prompts, str):
            prompts = [prompts]
        embeds, mask = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                               max_sequence_length=self.max_sequence_length)
        if mask is None:   # the pipeline drops an all-ones mask; we keep it (rows are padded later)
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return Conditioning(prompt_embeds=embeds, prompt_mask=mask.to(torch.long))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] → [B, (h/2)(w/2), 4C] (the pipeline's 2×2 packing)."""
        b, c, h, w = x.shape
        return self.pipe._pack_latents(x, b, c, h, w)

    def unpack(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """[B, (h/2)(w/2), 4C] → [B, C, h, w] (the pipeline's unpacking, without its frame axis)."""
        f = self.vae_scale_factor
        return self.pipe._unpack_latents(tokens, h * f, w * f, f)[:, :, 0]

    def _forward(self, tokens: torch.Tensor, t: torch.Tensor, cond: Conditioning, h: int, w: int) -> torch.Tensor:
        dtype = self.dtype
        cond = cond.trimmed()
        mask = cond.prompt_mask
        if mask is not None and bool(mask.bool().all()):
            mask = None   # as the pipeline: no mask when nothing is padded (the attention then has none either)
        return self.transformer(
            hidden_states=tokens.to(dtype),
            timestep=((t.float() * 1000) / 1000).to(dtype),
            encoder_hidden_states=cond.prompt_embeds.to(dtype),
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, h // 2, w // 2)]] * tokens.shape[0],
            guidance=None,
            return_dict=False,
        )[0]

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning, *,
                 guidance_scale: float = 1.0, negative_cond: Optional[Conditioning] = None) -> torch.Tensor:
        """v_θ(x_t, t, c): x_t [B, C, h, w], t [B] ∈ [0, 1] → [B, C, h, w] in x_t's dtype.

        CFG (guidance_scale ≠ 1): v = v_neg + s·(v_cond − v_neg), then (``cfg_renorm``) per packed token
        v ← v·‖v_cond‖/‖v‖, the pipeline's norm-preserving rescale; computed in fp32.
        """
        if t.dim() == 0:
            t = t.expand(x_t.shape[0])
        _, _, h, w = x_t.shape
        tokens = self.pack(x_t)
        v = self._forward(tokens, t, cond, h, w).float()
        if self._check_cfg(guidance_scale, negative_cond):
            v_neg = self._forward(tokens, t, negative_cond, h, w).float()
            comb = v_neg + guidance_scale * (v - v_neg)
            if self.cfg_renorm:
                comb = comb * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
            v = comb
        return self.unpack(v, h, w).to(x_t.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] → uint8 images [B, 3, 8h, 8w] (the VAE's mean/std normalisation undone)."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype).unsqueeze(2)                                 # [B, C, 1, h, w]
        mean = torch.tensor(cfg.latents_mean, device=z.device, dtype=z.dtype).view(1, cfg.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std, device=z.device, dtype=z.dtype).view(1, cfg.z_dim, 1, 1, 1)
        image = self.vae.decode(z / inv_std + mean, return_dict=False)[0][:, :, 0]   # the pipeline's arithmetic
        return to_uint8(image)


ADAPTER = QwenImageAdapter


def build_tiny_pipeline(*, seed: int = 0, num_layers: int = 2, attention_head_dim: int = 16,
                        num_attention_heads: int = 2, text_width: int = 16, latent_channels: int = 16,
                        vae_base_dim: int = 8, max_length: int = 128, dtype: torch.dtype = torch.float32):
    """A random tiny ``QwenImagePipeline``: Qwen2.5-VL text encoder (2 layers, width ``text_width``), the
    MMDiT with ``num_layers`` blocks, the causal 3D VAE (factor 8, ``latent_channels`` channels), and the
    real scheduler config (:data:`QWEN_IMAGE_SCHEDULER`). 64×64 pixels → latents [16, 8, 8], 16 image tokens.
    """
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = qwen_tokenizer(max_length)
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    torch.manual_seed(seed)
    head = text_width // 2
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": text_width, "intermediate_size": 2 * text_width, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tokenizer),
                     "bos_token_id": tokenizer.pad_token_id, "eos_token_id": special["<|im_end|>"],
                     "max_position_embeddings": 2048, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [head // 8, head // 8, head // 4], "rope_type": "default",
                                      "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": text_width},
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"],
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * latent_channels, out_channels=latent_channels, num_layers=num_layers,
        attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
        joint_attention_dim=text_width, guidance_embeds=False, axes_dims_rope=rope_axes(attention_head_dim, 3))
    gen = torch.Generator().manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(
        base_dim=vae_base_dim, z_dim=latent_channels, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[round(float(v), 4) for v in 0.5 * torch.randn(latent_channels, generator=gen)],
        latents_std=[round(float(v), 4) for v in 1.0 + torch.rand(latent_channels, generator=gen)])
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)
