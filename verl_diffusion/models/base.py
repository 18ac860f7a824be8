"""What every model adapter provides: primitives only (STYLE §7, DESIGN §2).

An adapter wraps one architecture's diffusers components and exposes the few operations the rollout and
the engine combine: encode prompts, evaluate the velocity v_θ(x_t, t, c) (SPEC §0.1), decode latents,
the latent shape, the trainable transformer and its LoRA targets. No sampler loop, no loss, no
``if algorithm == ...`` lives here.

Time convention (SPEC §0.1): ``t`` ∈ [0, 1], t = 1 is noise; adapters pass 1000·t as the transformer's
"timestep". Velocities point from data to noise (v ≈ ε − x0).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields, replace
from typing import ContextManager, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import nn


@dataclass
class Conditioning:
    """Text conditioning of a batch, batch-first. Fields an architecture does not use stay ``None``.

    ``prompt_embeds`` [B, L, D]; ``pooled_prompt_embeds`` [B, D'] (SD3, FLUX); ``prompt_mask`` [B, L]
    (architectures with padded text, e.g. Qwen-Image). The field names are also the DataProto keys
    (docs/data_flow.md), see :meth:`as_dict` / :meth:`from_dict`.
    """

    prompt_embeds: torch.Tensor
    pooled_prompt_embeds: Optional[torch.Tensor] = None
    prompt_mask: Optional[torch.Tensor] = None

    def _map(self, fn) -> "Conditioning":
        return replace(self, **{f.name: (None if getattr(self, f.name) is None else fn(getattr(self, f.name)))
                                for f in fields(self)})

    def __len__(self) -> int:
        return self.prompt_embeds.shape[0]

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "Conditioning":
        """Move every tensor; ``dtype`` applies to floating tensors only (masks keep theirs)."""
        def move(t):
            return t.to(device=device, dtype=dtype if (dtype is not None and t.is_floating_point()) else None)
        return self._map(move)

    def index_select(self, index: torch.Tensor) -> "Conditioning":
        """Rows ``index`` (LongTensor [B']) of every tensor."""
        return self._map(lambda t: t.index_select(0, index.to(t.device)))

    def repeat_interleave(self, repeats: int) -> "Conditioning":
        """Each row ``repeats`` times in a row: [B, ...] → [B·repeats, ...] (a prompt → its group)."""
        return self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def repeat(self, repeats: int) -> "Conditioning":
        """The whole batch ``repeats`` times: [B, ...] → [repeats·B, ...] (as ``torch.Tensor.repeat``)."""
        return self._map(lambda t: t.repeat(repeats, *([1] * (t.dim() - 1))))

    def __getitem__(self, sl: slice) -> "Conditioning":
        return self._map(lambda t: t[sl])

    @staticmethod
    def cat(items: Sequence["Conditioning"]) -> "Conditioning":
        """Concatenate along the batch dimension."""
        first = items[0]
        return replace(first, **{f.name: (None if getattr(first, f.name) is None
                                          else torch.cat([getattr(c, f.name) for c in items], dim=0))
                                 for f in fields(first)})

    def as_dict(self) -> dict[str, torch.Tensor]:
        """The non-``None`` tensors by field name (= DataProto keys)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_dict(cls, batch) -> "Conditioning":
        """Rebuild from a mapping or TensorDict holding (at least) ``prompt_embeds``; extra keys are ignored."""
        keys = set(batch.keys())
        return cls(**{f.name: batch[f.name] for f in fields(cls) if f.name in keys})


@runtime_checkable
class FlowModelAdapter(Protocol):
    """The primitives of one flow-matching architecture (one implementation per file in ``models/``)."""

    # diffusers pipeline class name the adapter wraps, e.g. "StableDiffusion3Pipeline".
    architecture: str
    # The trainable network. Replaceable: the engine may assign a wrapped module (FSDP2, LoRA); every
    # method below must go through this attribute.
    transformer: nn.Module

    @property
    def device(self) -> torch.device:
        """Device of the frozen components (text encoders, VAE) and of the returned tensors."""
        ...

    def encode_prompt(self, prompts: list[str]) -> Conditioning:
        """Text conditioning for ``prompts`` (no grad), on the adapter's device. [B] → Conditioning [B]."""
        ...

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning, *,
                 guidance_scale: float = 1.0, negative_cond: Optional[Conditioning] = None) -> torch.Tensor:
        """v_θ(x_t, t, c) (SPEC §0.1). x_t [B, *], t [B] ∈ [0, 1]; returns [B, *] in x_t's dtype.

        With ``guidance_scale`` ≠ 1: v = v_neg + s·(v_cond − v_neg), ``negative_cond`` required.
        Runs with grad if the caller has grad enabled.
        """
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, *] → images uint8 [B, 3, H, W] (no grad)."""
        ...

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Latent dims ``*`` of one sample for an image of height × width pixels (e.g. (C, h, w))."""
        ...

    def lora_targets(self) -> list[str]:
        """Default LoRA target module names of the transformer (peft ``target_modules``)."""
        ...


def disable_lora_layers(module: nn.Module) -> ContextManager[None]:
    """Context manager: every peft LoRA layer under ``module`` disabled (reference = base model).

    Works through wrappers (FSDP2, DDP, torch.compile) because it walks the module tree. Restores each
    layer's previous state on exit. Raises ValueError if ``module`` holds no LoRA layer.
    """
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in module.modules() if isinstance(m, BaseTunerLayer)]
    if not layers:
        raise ValueError(
            "disable_adapter() needs a LoRA adapter but the transformer has none (full fine-tuning); "
            "use a frozen copy of the base transformer as the reference instead (adapter.frozen_copy())")

    @contextlib.contextmanager
    def ctx():
        previous = [not m.disable_adapters for m in layers]
        for m in layers:
            m.enable_adapters(False)
        try:
            yield
        finally:
            for m, on in zip(layers, previous):
                m.enable_adapters(on)

    return ctx()
