"""Stable Diffusion 3 / 3.5 adapter: primitives over the ``StableDiffusion3Pipeline`` components.

Composes the pipeline (its own ``encode_prompt`` for CLIP-L/G + T5, its VAE and transformer); the sampling
loop lives in ``verl_diffusion.rollout``, the math in ``verl_diffusion.algos``. SPEC §0.1: t ∈ [0, 1],
t = 1 is noise; the transformer receives ``timestep`` = 1000·t.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import ContextManager, Optional, Union

import torch
from torch import nn

from verl_diffusion.models.base import Conditioning, disable_lora_layers

# Flow-GRPO's SD3.5 LoRA targets: the joint-attention projections of both streams.
SD3_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
]


class SD3Adapter:
    """SD3 / SD3.5 primitives (``FlowModelAdapter``).

    The text encoders and the VAE are frozen (eval, no grad). The transformer is fully trainable until
    :meth:`add_lora` freezes its base weights and adds a LoRA adapter. ``adapter.transformer`` may be
    replaced by a wrapped module (FSDP2, compiled); every method reads the attribute at call time.
    """

    architecture = "StableDiffusion3Pipeline"

    def __init__(self, pipe, *, max_sequence_length: int = 256):
        self.pipe = pipe
        self.transformer: nn.Module = pipe.transformer
        self.vae = pipe.vae
        # T5 token length: SD3's 256, capped by the tokenizer (tiny models use short sequences).
        tok3 = getattr(pipe, "tokenizer_3", None)
        cap = getattr(tok3, "model_max_length", None) if tok3 is not None else None
        self.max_sequence_length = min(max_sequence_length, cap) if isinstance(cap, int) and cap > 0 \
            else max_sequence_length
        self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
        self.patch_size = self.transformer.config.patch_size
        self.latent_channels = self.transformer.config.in_channels
        for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
            module = getattr(pipe, name, None)
            if module is not None:
                module.requires_grad_(False)
                module.eval()
        self.transformer.requires_grad_(True)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pipeline(cls, pipe, **kwargs) -> "SD3Adapter":
        """Wrap an existing ``StableDiffusion3Pipeline`` (shares its modules, no copy)."""
        if type(pipe).__name__ != cls.architecture:
            raise ValueError(f"SD3Adapter wraps a {cls.architecture}, got {type(pipe).__name__}; "
                             "pick the adapter of that architecture (verl_diffusion.models.MODEL_ADAPTERS)")
        return cls(pipe, **kwargs)

    @classmethod
    def from_pretrained(cls, path: Union[str, Path], *, dtype: torch.dtype = torch.float32,
                        device: Union[str, torch.device] = "cpu", **kwargs) -> "SD3Adapter":
        """Load a local diffusers directory (``model_index.json`` of a StableDiffusion3Pipeline)."""
        index = Path(path) / "model_index.json"
        if not index.is_file():
            raise FileNotFoundError(
                f"model path {str(path)!r} has no model_index.json; pass a local diffusers directory of "
                "an SD3/SD3.5 pipeline (e.g. from save_pretrained, or verl_diffusion.models.tiny.save_tiny_sd3)")
        found = json.loads(index.read_text()).get("_class_name")
        if found != cls.architecture:
            raise ValueError(f"model path {str(path)!r} holds a {found!r} pipeline, not a {cls.architecture}; "
                             f"use the adapter of that architecture (verl_diffusion.models.MODEL_ADAPTERS)")
        from diffusers import StableDiffusion3Pipeline

        with warnings.catch_warnings():   # diffusers ≥ 0.42 renames torch_dtype → dtype; older lack dtype
            warnings.simplefilter("ignore", FutureWarning)
            pipe = StableDiffusion3Pipeline.from_pretrained(str(path), torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        return cls(pipe.to(device), **kwargs)

    # ------------------------------------------------------------------ properties

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the transformer inputs."""
        return next(self.transformer.parameters()).dtype

    def latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, height / f, width / f) with f the VAE factor; sizes must be multiples of f·patch."""
        mult = self.vae_scale_factor * self.patch_size
        if height % mult or width % mult:
            raise ValueError(f"image size {height}x{width} is not a multiple of {mult} "
                             f"(VAE factor {self.vae_scale_factor} × patch {self.patch_size}); "
                             f"use e.g. {height // mult * mult or mult}x{width // mult * mult or mult}")
        return (self.latent_channels, height // self.vae_scale_factor, width // self.vae_scale_factor)

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
        if guidance_scale == 1.0:
            return self._forward(x_t, t, cond).to(x_t.dtype)
        if negative_cond is None:
            raise ValueError(f"velocity(guidance_scale={guidance_scale}) needs negative_cond (e.g. "
                             "adapter.encode_prompt(['']*B)); pass guidance_scale=1.0 to disable CFG")
        both = self._forward(torch.cat([x_t, x_t]), torch.cat([t, t]), Conditioning.cat([negative_cond, cond]))
        v_neg, v_cond = both.to(x_t.dtype).chunk(2)
        return v_neg + guidance_scale * (v_cond - v_neg)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, C, h, w] → uint8 images [B, 3, H, W] (VAE scaling and shift factors undone)."""
        cfg = self.vae.config
        z = latents.to(self.vae.dtype) / cfg.scaling_factor + (cfg.shift_factor or 0.0)
        image = self.vae.decode(z, return_dict=False)[0]
        return ((image.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)

    def lora_targets(self) -> list[str]:
        return list(SD3_LORA_TARGETS)

    # ------------------------------------------------------------------ training modes

    def add_lora(self, rank: int, alpha: float, target_modules: Optional[list[str]] = None,
                 init_lora_weights: Union[str, bool] = "gaussian", adapter_name: str = "default") -> None:
        """Freeze the base transformer and add a peft LoRA adapter (only its weights train).

        peft's inits ("gaussian" and True) both zero the B matrices: the velocity is unchanged at init.
        """
        from peft import LoraConfig, inject_adapter_in_model

        if rank <= 0:
            raise ValueError(f"LoRA rank={rank} must be > 0; for full fine-tuning do not call add_lora")
        config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=init_lora_weights,
                            target_modules=list(target_modules or self.lora_targets()))
        self.transformer.requires_grad_(False)
        if hasattr(self.transformer, "add_adapter"):   # diffusers' PeftAdapterMixin: also records peft_config
            self.transformer.add_adapter(config, adapter_name=adapter_name)
        else:                                          # a wrapped / plain module
            inject_adapter_in_model(config, self.transformer, adapter_name=adapter_name)
        for name, p in self.transformer.named_parameters():
            p.requires_grad_("lora_" in name)

    def lora_state_dict(self, adapter_name: str = "default") -> dict[str, torch.Tensor]:
        """The LoRA weights only (peft key names), for checkpoints and weight sync."""
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(self.transformer, adapter_name=adapter_name)

    @property
    def has_lora(self) -> bool:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return any(isinstance(m, BaseTunerLayer) for m in self.transformer.modules())

    def disable_adapter(self) -> ContextManager[None]:
        """Context manager: LoRA disabled, the transformer is the base (reference) model."""
        return disable_lora_layers(self.transformer)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """LoRA weights when a LoRA is attached, else every transformer weight (full fine-tuning)."""
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def frozen_copy(self) -> nn.Module:
        """A frozen deep copy of the current transformer (reference for full fine-tuning)."""
        ref = copy.deepcopy(self.transformer)
        ref.requires_grad_(False)
        return ref.eval()
