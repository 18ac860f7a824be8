"""FLUX.2 [klein] adapter (FLUX.2-klein-base 4B / 9B): primitives over diffusers' ``Flux2KleinPipeline``.

What this file reproduces from the pipeline (diffusers 0.42):

* **Prompt encoding**: the pipeline's ``encode_prompt``: the prompt as a Qwen3 chat turn
  (``apply_chat_template``, thinking off), padded to ``max_sequence_length`` (512) and run through Qwen3;
  the hidden states of layers ``text_encoder_out_layers`` (9, 18, 27) are concatenated per token
  ([B, L, 3·D]). The transformer attends to all L tokens (no mask), as the pipeline does; the text
  position ids (0, 0, 0, l) are rebuilt in ``velocity``.
* **Latents**: the space the flow runs in, [B, 4·32, H/16, W/16]: the VAE's 32-channel latents
  patchified 2×2 and batch-normalised with the VAE's running statistics (``vae.bn``). The initial noise is
  N(0, I) in this space, as the pipeline draws it. ``velocity`` flattens it to [B, (H/16)(W/16), 128] tokens
  with position ids (0, row, col, 0); ``decode`` undoes the normalisation and the patchify.
* **Timestep**: σ ∈ [0, 1] (the pipeline passes ``1000·σ / 1000``; so do we); the model scales it.
* **Grid**: ``linspace(1, 1/N, N)`` shifted with ``mu = compute_empirical_mu(image tokens, N)``, FLUX.2's
  fit that depends on the token count and on N: :meth:`sampling_grid`.
* **Guidance**: klein-base is not distilled: true CFG with the empty negative prompt, two forwards as the
  pipeline, v = v_neg + s·(v_cond − v_neg) (the pipeline's ``guidance_scale``, default 4). A step-distilled
  klein (``is_distilled`` in the pipeline config) ignores CFG, as the pipeline does.
* **LoRA targets**: every projection of the double-stream blocks (attention of both streams, both SwiGLU
  feed-forwards ``linear_in`` / ``linear_out``) and of the single-stream blocks (the fused
  ``to_qkv_mlp_proj`` and ``to_out``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from verl_diffusion.models.base import Conditioning, DiffusersAdapter, linspace_grid, lora_target_regex, to_uint8
from verl_diffusion.models.tiny_parts import FLUX_SCHEDULER, qwen_tokenizer, rope_axes

FLUX2_LORA_BLOCKS = {
    "transformer_blocks": ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                           "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out",
                           "ff_context.linear_in", "ff_context.linear_out"],
    "single_transformer_blocks": ["attn.to_qkv_mlp_proj", "attn.to_out"],
}
FLUX2_LORA_TARGETS = lora_target_regex(FLUX2_LORA_BLOCKS)


class Flux2KleinAdapter(DiffusersAdapter):
    """FLUX.2 [klein] primitives (``FlowModelAdapter``).

    Args: pipe: a ``Flux2KleinPipeline``.  max_sequence_length: text tokens (the pipeline's 512, capped by the
      tokenizer's ``model_max_length``).
      text_encoder_out_layers: Qwen3 hidden-state layers concatenated per token (the pipeline's (9, 18, 27)).
    """

    name = "flux2_klein"
    architecture = "Flux2KleinPipeline"
    transformer_class = "Flux2Transformer2DModel"
    frozen_components = ("vae", "text_encoder")
    LORA_TARGETS = FLUX2_LORA_TARGETS

    @staticmethod
    def latent_grid(transformer_config, vae_config, height, width):
        """The flow runs in the patchified space (in_channels = 4·C, h = H / 2f)."""
        f = 2 ** (len(vae_config["block_out_channels"]) - 1)
        return 2 * f, (int(transformer_config["in_channels"]), height // (2 * f), width // (2 * f))

    def __init__(self, pipe, *, max_sequence_length: int = 512,
                 text_encoder_out_layers: Sequence[int] = (9, 18, 27)):
        super().__init__(pipe)
        # Capped by the tokenizer (tiny models use short sequences); every token is attended, so the length matters.
        cap = getattr(getattr(pipe, "tokenizer", None), "model_max_length", None)
        self.max_sequence_length = min(int(max_sequence_length), cap) if isinstance(cap, int) and cap > 0 \
            else int(max_sequence_length)
        self.text_encoder_out_layers = tuple(int(i) for i in text_encoder_out_layers)
        n_hidden = int(pipe.text_encoder.config.num_hidden_layers) + 1
        bad = [i for i in self.text_encoder_out_layers if not -n_hidden <= i < n_hidden]
        if bad:
            raise ValueError(f"text_encoder_out_layers={list(self.text_encoder_out_layers)}: the text encoder has "
                             f"{n_hidden} hidden states (embeddings + {n_hidden - 1} layers); {bad} do not exist")
        self.vae_scale_factor = int(pipe.vae_scale_factor)
        self.latent_channels = int(self.transformer.config.in_channels)
        self.is_distilled = bool(pipe.config.get("is_distilled", False))

    # ------------------------------------------------------------------ shapes and grid

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(128, H/16, W/16) for the real model (4 × VAE channels); multiples of 16 pixels."""
        f = self.vae_scale_factor
        self._check_size(height, width, 2 * f, f"VAE factor {f} × 2x2 patchify")
        return (self.latent_channels, height // (2 * f), width // (2 * f))

    def sampling_grid(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The pipeline's grid: linspace(1, 1/N, N) shifted with ``mu = compute_empirical_mu(tokens, N)``."""
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        _, h, w = self.latent_shape(height, width)
        return linspace_grid(self.pipe.scheduler, num_steps, mu=compute_empirical_mu(image_seq_len=h * w,
                                                                                    num_steps=num_steps))

    # ------------------------------------------------------------------ primitives

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> Conditioning:
        """Returns prompt_embeds [B, max_sequence_length, 3·D_qwen3] (no mask: all tokens are attended)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        embeds, _ = self.pipe.encode_prompt(prompt=list(prompts), device=self.device,
                                            max_sequence_length=self.max_sequence_length,
                                            text_encoder_out_layers=self.text_encoder_out_layers)
        return Conditioning(prompt_embeds=embeds)

    def _forward(self, x: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        dtype, b, c, h, w = self.dtype, *x.shape
        tokens = self.pipe._pack_latents(x)                               # [B, h·w, C]
        img_ids = self.pipe._prepare_latent_ids(x).to(x.device)           # [B, h·w, 4]
        txt_ids = self.pipe._prepare_text_ids(cond.prompt_embeds).to(x.device)
        out = self.transformer(
            hidden_states=tokens.to(dtype),
            timestep=((t.float() * 1000) / 1000).to(dtype),
            guidance=None,
            encoder_hidden_states=cond.prompt_embeds.to(dtype),
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]
        return out[:, : h * w].float().permute(0, 2, 1).reshape(b, c, h, w)   # inverse of _pack_latents

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning, *,
                 guidance_scale: float = 1.0, negative_cond: Optional[Conditioning] = None) -> torch.Tensor:
        """v_θ(x_t, t, c): x_t [B, 128, h, w], t [B] ∈ [0, 1] → [B, 128, h, w] in x_t's dtype.

        CFG (guidance_scale ≠ 1, not for a distilled klein): v = v_neg + s·(v_cond − v_neg), in fp32.
        """
        if t.dim() == 0:
            t = t.expand(x_t.shape[0])
        v = self._forward(x_t, t, cond)
        if not self.is_distilled and self._check_cfg(guidance_scale, negative_cond):
            v_neg = self._forward(x_t, t, negative_cond)
            v = v_neg + guidance_scale * (v - v_neg)
        return v.to(x_t.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, 128, h, w] → uint8 images [B, 3, 16h, 16w]: batch-norm undone, unpatchified, decoded."""
        bn = self.vae.bn
        z = latents.to(self.vae.dtype)
        mean = bn.running_mean.view(1, -1, 1, 1).to(z.device, z.dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(z.device, z.dtype)
        z = self.pipe._unpatchify_latents(z * std + mean)
        return to_uint8(self.vae.decode(z, return_dict=False)[0])


ADAPTER = Flux2KleinAdapter


def build_tiny_pipeline(*, seed: int = 0, num_layers: int = 1, num_single_layers: int = 1,
                        attention_head_dim: int = 16, num_attention_heads: int = 2, text_width: int = 16,
                        text_layers: int = 28, text_seq_len: int = 32, vae_latent_channels: int = 8,
                        vae_channels: int = 8, dtype: torch.dtype = torch.float32):
    """A random tiny ``Flux2KleinPipeline`` (klein-base: not distilled, no guidance embedding): a Qwen3 text
    encoder of ``text_layers`` layers (28, so the pipeline's hidden-state layers 9, 18, 27 exist) and width
    ``text_width``, ``text_seq_len`` text tokens, the FLUX.2 VAE (factor 8, ``vae_latent_channels`` channels,
    batch-norm statistics randomised so decode exercises them), FLUX's scheduler config.
    64×64 pixels → latents [4·vae_latent_channels, 4, 4], 16 image tokens."""
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen_tokenizer(text_seq_len)
    torch.manual_seed(seed)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width,
        num_hidden_layers=text_layers, num_attention_heads=2, num_key_value_heads=2, head_dim=text_width // 2,
        max_position_embeddings=512, bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.pad_token_id,
        pad_token_id=tokenizer.pad_token_id))
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * vae_latent_channels, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
        joint_attention_dim=3 * text_width, timestep_guidance_channels=32,
        axes_dims_rope=rope_axes(attention_head_dim, 4), guidance_embeds=False)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(vae_channels,) * 4, layers_per_block=1,
        latent_channels=vae_latent_channels, norm_num_groups=min(4, vae_channels), sample_size=64,
        use_quant_conv=False, use_post_quant_conv=False)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=gen))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=gen))
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)
