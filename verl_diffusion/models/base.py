"""What every model adapter provides: primitives only.

An adapter wraps one architecture's diffusers components and exposes the few operations the rollout and
the engine combine: encode prompts, evaluate the velocity v_θ(x_t, t, c) (docs/algorithms.md §0.1), decode latents,
the latent shape, the trainable transformer and its LoRA targets. No sampler loop, no loss, no
``if algorithm == ...`` lives here.

Time convention (docs/algorithms.md §0.1): ``t`` ∈ [0, 1], t = 1 is noise; adapters pass 1000·t as the transformer's
"timestep". Velocities point from data to noise (v ≈ ε − x0).
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ContextManager, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
from torch import nn


@dataclass
class Conditioning:
    """Text conditioning of a batch, batch-first. Fields an architecture does not use stay ``None``.

    ``prompt_embeds`` [B, L, D]; ``pooled_prompt_embeds`` [B, D'] (SD3, FLUX.1); ``prompt_mask`` [B, L] int64,
    1 = a real token, 0 = padding (Qwen-Image, whose text length varies per prompt). Everything else an
    architecture feeds its transformer (text / image position ids, image shapes) follows from these and the
    latent shape, so it is rebuilt inside ``velocity`` and never stored. The field names are also the
    DataProto keys (docs/data_flow.md), see :meth:`as_dict` / :meth:`from_dict`.
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

    def pad_to(self, length: int) -> "Conditioning":
        """Text padded with zero embeddings (mask 0) to ``length`` tokens; needs ``prompt_mask`` when it pads."""
        cur = self.prompt_embeds.shape[1]
        if cur == length:
            return self
        if cur > length:
            raise ValueError(f"cannot pad {cur} text tokens down to {length}")
        if self.prompt_mask is None:
            raise ValueError("padding the text needs prompt_mask (which tokens are real); this architecture's "
                             "conditioning has a fixed text length and must not be padded")
        pad = length - cur
        emb = torch.nn.functional.pad(self.prompt_embeds, (0, 0, 0, pad))
        return replace(self, prompt_embeds=emb, prompt_mask=torch.nn.functional.pad(self.prompt_mask, (0, pad)))

    def trimmed(self) -> "Conditioning":
        """Drop trailing text positions that are padding in every row (mask 0 everywhere).

        Real tokens keep their positions, so an architecture whose text positions count from the first token
        (Qwen-Image) gives the same velocity; rows padded to different lengths then compute identically.
        """
        if self.prompt_mask is None:
            return self
        real = self.prompt_mask.bool().any(dim=0).nonzero()
        keep = int(real.max()) + 1 if real.numel() else 1
        if keep == self.prompt_embeds.shape[1]:
            return self
        return replace(self, prompt_embeds=self.prompt_embeds[:, :keep], prompt_mask=self.prompt_mask[:, :keep])

    @staticmethod
    def cat(items: Sequence["Conditioning"]) -> "Conditioning":
        """Concatenate along the batch dimension; text of different lengths is padded (``pad_to``) first."""
        length = max(c.prompt_embeds.shape[1] for c in items)
        items = [c.pad_to(length) for c in items]
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
        """v_θ(x_t, t, c) (docs/algorithms.md §0.1). x_t [B, *], t [B] ∈ [0, 1]; returns [B, *] in x_t's dtype.

        With ``guidance_scale`` ≠ 1: v = v_neg + s·(v_cond − v_neg), ``negative_cond`` required.
        Runs with grad if the caller has grad enabled.
        """
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents [B, *] → images uint8 [B, 3, H, W] (no grad)."""
        ...

    def latent_shape(self, height: int, width: int) -> tuple[int, ...]:
        """Latent dims ``*`` of one sample for an image of height × width pixels (e.g. (C, h, w)).

        Every adapter keeps latents channel-first and spatial, [C, h, w]: packing into transformer tokens
        happens inside ``velocity``, so the resolution is read off the latent itself.
        """
        ...

    def sampling_grid(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The model's own sampling grid t_0 = 1 > … > t_N (docs/algorithms.md §0.2, §1.1): float32 [N+1].

        Exactly the sigmas the architecture's diffusers pipeline sets on its scheduler for ``num_steps`` at
        this image size (static shift, or resolution-dependent "dynamic" shift with ``mu``), so the Euler ODE
        on this grid reproduces the stock pipeline.
        """
        ...

    def lora_targets(self) -> Union[list[str], str]:
        """Default LoRA targets of the transformer (peft ``target_modules``: suffix list or full-match regex)."""
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


def lora_target_regex(groups: dict[str, Sequence[str]]) -> str:
    """A peft full-match regex for exactly the listed layers inside numbered blocks.

    ``groups`` maps a block list (e.g. ``"transformer_blocks"``) to layer names relative to one block (e.g.
    ``"attn.to_q"``). Suffix lists cannot say "``proj_out`` inside a single-stream block but not the model's
    final ``proj_out``", nor tell a ``to_out`` Linear from a ``to_out`` ModuleList; a regex can.
    """
    import re

    parts = [rf"{re.escape(block)}\.\d+\.(?:{'|'.join(re.escape(n) for n in names)})"
             for block, names in groups.items()]
    return rf"^(?:.*\.)?(?:{'|'.join(parts)})$"


def scheduler_sigmas(scheduler, num_steps: int, **set_timesteps_kwargs) -> torch.Tensor:
    """``scheduler.sigmas`` (float32 [N+1], CPU) after ``set_timesteps(num_steps, **kwargs)`` on a copy.

    A copy, because diffusers schedulers keep the last grid (and a step index) as state.
    """
    sched = copy.deepcopy(scheduler)
    sched.set_timesteps(num_steps, device="cpu", **set_timesteps_kwargs)
    sigmas = sched.sigmas.detach().to("cpu", torch.float32)
    if sigmas.shape != (num_steps + 1,):
        raise ValueError(f"{type(scheduler).__name__} gave {tuple(sigmas.shape)} sigmas for {num_steps} steps; "
                         "an adapter needs a first-order flow-matching scheduler (FlowMatchEulerDiscreteScheduler)")
    return sigmas


def linspace_grid(scheduler, num_steps: int, *, mu: float, flow_sigmas: bool = True) -> torch.Tensor:
    """The grid of the dynamic-shift pipelines (Qwen-Image, FLUX.1, FLUX.2): ``sigmas = linspace(1, 1/N, N)`` shifted
    by the scheduler with ``mu``. ``flow_sigmas``: let a scheduler configured with ``use_flow_sigmas`` make its own
    sigmas, as the FLUX pipelines do (Qwen-Image's pipeline does not check)."""
    import numpy as np

    own = flow_sigmas and scheduler.config.get("use_flow_sigmas", False)
    sigmas = None if own else np.linspace(1.0, 1 / num_steps, num_steps)
    return scheduler_sigmas(scheduler, num_steps, sigmas=sigmas, mu=mu)


def shift_mu(scheduler_config, image_tokens: int, calculate_shift) -> float:
    """``mu`` of resolution-dependent shifting: ``calculate_shift`` (the pipeline module's own) with the scheduler
    config's base / max sequence lengths and shifts, the pipelines' defaults where the config has none."""
    cfg = scheduler_config
    return calculate_shift(image_tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                           cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))


class DiffusersAdapter:
    """What every ``FlowModelAdapter`` over a diffusers pipeline shares: loading, freezing, LoRA / full
    fine-tuning, the reference model. Subclasses add the architecture's primitives (``encode_prompt``,
    ``velocity``, ``decode``, ``latent_shape``, ``sampling_grid``) and set:

    * ``name``: the architecture's name (``actor_rollout_ref.model.architecture``);
    * ``architecture``: the diffusers pipeline class name (``model_index.json``'s ``_class_name``);
    * ``transformer_class``: the diffusers class of its transformer;
    * ``frozen_components``: pipeline attributes that never train (text encoders, VAE);
    * ``LORA_TARGETS``: the default peft ``target_modules``;

    and implement :meth:`latent_grid` (the latent shape from the configs alone). The module that defines an
    adapter also defines ``build_tiny_pipeline`` (a random tiny pipeline of the architecture, offline) and names
    its adapter ``ADAPTER``: ``verl_diffusion.models`` finds architectures by that name.

    The text encoders and the VAE are frozen (eval, no grad). The transformer is fully trainable until
    :meth:`add_lora` freezes its base weights and adds a LoRA adapter. ``adapter.transformer`` may be
    replaced by a wrapped module (FSDP2, compiled); every method reads the attribute at call time.
    """

    name: str = ""
    architecture: str = ""
    transformer_class: str = ""
    frozen_components: tuple[str, ...] = ("vae", "text_encoder")
    LORA_TARGETS: Union[list[str], str] = []

    @staticmethod
    def latent_grid(transformer_config: dict, vae_config: dict, height: int, width: int) -> tuple[int, tuple]:
        """(m, [C, h, w]): the pixel multiple m that ``height`` and ``width`` must be, and the latent dims of one
        sample, from the transformer's and VAE's ``config.json`` alone (no weights; what :meth:`latent_shape` gives
        once loaded)."""
        raise NotImplementedError

    def __init__(self, pipe):
        self.pipe = pipe
        self.transformer: nn.Module = pipe.transformer
        self.vae = pipe.vae
        for name in self.frozen_components:
            module = getattr(pipe, name, None)
            if module is not None:
                module.requires_grad_(False)
                module.eval()
        self.transformer.requires_grad_(True)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_pipeline(cls, pipe, **kwargs):
        """Wrap an existing pipeline of this architecture (shares its modules, no copy)."""
        if type(pipe).__name__ != cls.architecture:
            raise ValueError(f"{cls.__name__} wraps a {cls.architecture}, got {type(pipe).__name__}; "
                             "pick the adapter of that architecture (verl_diffusion.models.MODEL_ADAPTERS)")
        return cls(pipe, **kwargs)

    @classmethod
    def from_pretrained(cls, path: Union[str, Path], *, dtype: torch.dtype = torch.float32,
                        device: Union[str, torch.device] = "cpu", **kwargs):
        """Load a local diffusers directory (``model_index.json`` naming this architecture's pipeline).

        diffusers reads a transformer saved as one file or sharded (``*.safetensors.index.json``) alike.
        ``kwargs`` go to the adapter's constructor.
        """
        found = pipeline_class_name(path)
        if found != cls.architecture:
            raise ValueError(f"model path {str(path)!r} holds a {found!r} pipeline, not a {cls.architecture}; "
                             f"use the adapter of that architecture (verl_diffusion.models.MODEL_ADAPTERS)")
        import diffusers

        pipe_cls = getattr(diffusers, cls.architecture)
        with warnings.catch_warnings():   # diffusers ≥ 0.42 renames torch_dtype → dtype; older lack dtype
            warnings.simplefilter("ignore", FutureWarning)
            pipe = pipe_cls.from_pretrained(str(path), torch_dtype=dtype)
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

    def lora_targets(self) -> Union[list[str], str]:
        targets = self.LORA_TARGETS
        return targets if isinstance(targets, str) else list(targets)

    def _packed_latent_shape(self, height: int, width: int) -> tuple[int, int, int]:
        """(C, H/f, W/f) for a model that packs 2×2 latent patches into tokens: sizes multiples of 2f."""
        f = self.vae_scale_factor
        self._check_size(height, width, 2 * f, f"VAE factor {f} × 2x2 packing")
        return (self.latent_channels, height // f, width // f)

    def _check_size(self, height: int, width: int, multiple: int, what: str) -> None:
        if height % multiple or width % multiple:
            raise ValueError(f"image size {height}x{width} is not a multiple of {multiple} ({what}); "
                             f"use e.g. {height // multiple * multiple or multiple}x"
                             f"{width // multiple * multiple or multiple}")

    @staticmethod
    def _check_cfg(guidance_scale: float, negative_cond: Optional[Conditioning]) -> bool:
        """True when CFG is on; with CFG on, ``negative_cond`` is required."""
        if guidance_scale == 1.0:
            return False
        if negative_cond is None:
            raise ValueError(f"velocity(guidance_scale={guidance_scale}) needs negative_cond (e.g. "
                             "adapter.encode_prompt(['']*B)); pass guidance_scale=1.0 to disable CFG")
        return True

    # ------------------------------------------------------------------ training modes

    def add_lora(self, rank: int, alpha: float, target_modules: Optional[Union[list[str], str]] = None,
                 init_lora_weights: Union[str, bool] = "gaussian", adapter_name: str = "default") -> None:
        """Freeze the base transformer and add a peft LoRA adapter (only its weights train).

        peft's inits ("gaussian" and True) both zero the B matrices: the velocity is unchanged at init.
        """
        from peft import LoraConfig, inject_adapter_in_model

        if rank <= 0:
            raise ValueError(f"LoRA rank={rank} must be > 0; for full fine-tuning do not call add_lora")
        targets = target_modules or self.lora_targets()
        config = LoraConfig(r=rank, lora_alpha=alpha, init_lora_weights=init_lora_weights,
                            target_modules=targets if isinstance(targets, str) else list(targets))
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


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    """VAE output in [-1, 1], [B, 3, H, W] → uint8 (rounded as diffusers' image processor does)."""
    return ((image.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)


def pipeline_class_name(path: Union[str, Path]) -> str:
    """``_class_name`` of a local diffusers directory's ``model_index.json`` (the pipeline class)."""
    index = Path(path) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(
            f"model path {str(path)!r} has no model_index.json; pass a local diffusers pipeline directory "
            "(save_pretrained output, or one of verl_diffusion.models.tiny's save_tiny_* builders)")
    return str(json.loads(index.read_text()).get("_class_name"))


def transformer_class(path: Union[str, Path], subfolder: str = "transformer"):
    """The diffusers model class named in ``<path>/<subfolder>/config.json`` (``_class_name``)."""
    import diffusers

    cfg_file = Path(path) / subfolder / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"actor_rollout_ref.model.path={str(path)!r} has no {subfolder}/config.json; "
                                "give a diffusers pipeline folder (save_pretrained output)")
    name = json.loads(cfg_file.read_text()).get("_class_name", "SD3Transformer2DModel")
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ValueError(f"{cfg_file} names _class_name={name!r}, which diffusers does not export")
    return cls


def transformer_weight_files(path: Union[str, Path], subfolder: str = "transformer") -> list[str]:
    """The safetensors files of a pipeline folder's transformer (one file, or the shards its index lists)."""
    folder = Path(path) / subfolder
    index = sorted(folder.glob("*.safetensors.index.json"))
    if index:
        shards = sorted(set(json.loads(index[0].read_text())["weight_map"].values()))
        return [str(folder / s) for s in shards]
    files = sorted(str(f) for f in folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no .safetensors weights")
    return files


def pad_text_rows(out: dict, length: int) -> None:
    """Masked text (Qwen-Image: each rank pads to its own longest prompt) padded to ``length`` tokens in place, so
    that the ranks' batches concatenate on the driver. The velocity trims padding again, so values do not change."""
    for prefix in ("", "negative_"):
        if f"{prefix}prompt_mask" not in out:
            continue
        cond = Conditioning.from_dict({k[len(prefix):]: out[k] for k in out if k.startswith(prefix + "prompt")
                                       or k.startswith(prefix + "pooled_prompt")})
        out.update({prefix + k: v for k, v in cond.pad_to(max(length, cond.prompt_embeds.shape[1])).as_dict().items()})
