"""vllm-omni custom pipelines that sample with our step kernels (docs/vllm_omni.md).

One generic pipeline, :class:`AdapterRolloutPipeline`, runs any model adapter (``models/base.py``) through the
same loop as the diffusers rollout (``DiffusersRollout.run_trajectory`` over ``algos.sde``), so its log-probs are
the ones the trainer recomputes. Each architecture module (verl_diffusion/models) gets a subclass naming three classes
from its adapter: ``SD3RolloutPipeline``, ``QwenImageRolloutPipeline``, ``FluxRolloutPipeline`` (FLUX.1-dev /
schnell) and ``Flux2KleinRolloutPipeline`` (FLUX.2 [klein]).

vllm-omni's contract (0.28 and 0.30, measured): no base class; ``__init__(*, od_config)``, ``forward(batch)`` returning one
``DiffusionOutput`` per request, ``load_weights(weights) -> loaded names`` and ``weights_sources``. vllm-omni
builds the pipeline, then streams the transformer's checkpoint through ``load_weights`` and refuses to start if
any transformer weight was not loaded. The text encoders and the VAE are loaded by diffusers here, as in
vllm-omni's own pipelines. Name a pipeline with ``custom_pipeline_args={"pipeline_class": qualname}`` or register
it (:func:`register_pipelines`). The adapter's constructor options (``actor_rollout_ref.model.adapter_kwargs``,
e.g. FLUX.1's ``distilled_guidance_scale``) ride in ``custom_pipeline_args["adapter_kwargs"]``, so the rollout
samples the model the trainer trains.

This module imports vllm-omni; it is loaded only inside vllm-omni's workers and in tests that have it.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from typing import Any, ClassVar, Iterable, Optional

import torch
from torch import nn
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.model_loader.diffusers_loader import DiffusersPipelineLoader

from verl_diffusion.models import adapter_classes
from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout, trajectory_coefficients
from verl_diffusion.rollout.vllm_omni import PIPELINE_CLASSES
from verl_diffusion.rollout.vllm_omni.protocol import SampleRequest, parse_extra_args, read_lora_dir

__all__ = ["AdapterRolloutPipeline", "PIPELINES", "register_pipelines", *PIPELINE_CLASSES.values()]


def _import(qualname: str):
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    raise ValueError(f"prompt {prompt!r} is neither a string nor a dict with a 'prompt' string")


class AdapterRolloutPipeline(nn.Module):
    """A vllm-omni pipeline over a ``FlowModelAdapter``: training rollouts with log-probs (docs/algorithms.md §1).

    Subclasses set ``diffusers_pipeline`` and ``transformer_class`` (qualified diffusers class names) and
    ``adapter_class`` (qualified name of our adapter, which must offer ``from_pipeline``).
    Weights: the transformer is built from its config and filled by vllm-omni's loader through
    :meth:`load_weights` (also the full-weight sync); LoRA is peft's, as in the trainer (:meth:`add_lora`).
    """

    diffusers_pipeline: ClassVar[str]
    transformer_class: ClassVar[str]
    adapter_class: ClassVar[str]

    supports_request_batch: ClassVar[bool] = True
    _dit_modules: ClassVar[list[str]] = ["transformer"]
    # LoRA adapter slot in the peft-injected transformer (the trainer's is "default" too).
    lora_adapter_name: ClassVar[str] = "default"

    def __init__(self, *, od_config, prefix: str = ""):
        super().__init__()
        self.od_config = od_config
        path, dtype = od_config.model, od_config.dtype
        transformer_cls = _import(self.transformer_class)
        # Random init from the config; vllm-omni's loader then copies every checkpoint weight in load_weights.
        transformer = transformer_cls.from_config(transformer_cls.load_config(path, subfolder="transformer"))
        with warnings.catch_warnings():     # diffusers ≥ 0.42 renames torch_dtype; .to(dtype) of a fresh module
            warnings.simplefilter("ignore")
            pipe = _import(self.diffusers_pipeline).from_pretrained(path, transformer=transformer.to(dtype),
                                                                     torch_dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        adapter_kwargs = dict((getattr(od_config, "custom_pipeline_args", None) or {}).get("adapter_kwargs") or {})
        self.adapter = _import(self.adapter_class).from_pipeline(pipe, **adapter_kwargs)
        for name, module in pipe.components.items():      # children, so .to(device) and sleep mode see them
            if isinstance(module, nn.Module):
                setattr(self, name, module)
        self.weights_sources = [DiffusersPipelineLoader.ComponentSource(
            model_or_path=path, subfolder="transformer", revision=None, prefix="transformer.", fall_back_to_pt=True)]
        self._active_lora_id: Optional[int] = None
        self._lora_ids: set[int] = set()
        self._lock = threading.Lock()       # weight updates and forwards never interleave

    # ------------------------------------------------------------------ sampling

    @torch.no_grad()
    def forward(self, req) -> list[DiffusionOutput]:
        """One ``DiffusionOutput`` per request of a vllm-omni ``DiffusionRequestBatch`` (or one request).

        Requests are grouped by (rollout knobs, window); each group runs as one batch of micro-batches through
        ``DiffusersRollout.run_trajectory`` with the request's x_{t_0} and window noise, so a request's sample is
        the one ``DiffusersRollout.generate`` draws for the same plan.
        """
        requests = list(req.requests) if hasattr(req, "requests") else [req]
        parsed = [parse_extra_args(r.sampling_params.extra_args) for r in requests]
        groups: dict[tuple, list[int]] = {}
        for i, p in enumerate(parsed):
            groups.setdefault(p.batch_key(), []).append(i)
        outputs: list[Optional[DiffusionOutput]] = [None] * len(requests)
        with self._lock:
            for idx in groups.values():
                for i, out in zip(idx, self._run_group([requests[i] for i in idx], [parsed[i] for i in idx])):
                    outputs[i] = out
        return outputs

    def _run_group(self, requests: list, parsed: list[SampleRequest]) -> list[DiffusionOutput]:
        spec = parsed[0]
        cfg = spec.cfg
        rollout = DiffusersRollout(self.adapter, cfg)
        device = rollout.device
        shape = rollout._latent_shape()
        x_init = torch.cat([r.sampling_params.latents for r in requests]).to(dtype=torch.float32)
        if tuple(x_init.shape[1:]) != shape:
            raise ValueError(f"request latents have shape {tuple(x_init.shape[1:])} but a {cfg.height}x{cfg.width} "
                             f"image needs {shape}")
        bsz = x_init.shape[0]
        step_noise = {k: torch.stack([p.step_noise[j] for p in parsed]) for j, k in enumerate(spec.stochastic)}
        # The grid the diffusers rollout uses (rollout.grid: the model's scheduler sigmas or the formula grid (docs/algorithms.md §1.1)).
        sigmas_cpu = rollout.grid(cfg.num_steps).unsqueeze(0).expand(bsz, -1).contiguous()
        # Coefficients on the CPU, as the diffusers rollout and the replica compute them, then moved exactly.
        coefficients = [type(c)(c.c_x.to(device), c.c_v.to(device), c.std.to(device))
                        for c in trajectory_coefficients(cfg, sigmas_cpu, spec.stochastic)]
        sigmas = sigmas_cpu.to(device)
        cond = rollout.encode_prompts([_prompt_text(r.prompt) for r in requests])
        negative = rollout._negative(bsz)
        parts, images = [], []
        mb = cfg.micro_batch_size
        for lo in range(0, bsz, mb):
            hi = min(lo + mb, bsz)
            part = rollout.run_trajectory(
                cond[lo:hi], x_init[lo:hi].to(device), sigmas=sigmas[lo:hi], stochastic=spec.stochastic,
                trained=spec.trained, step_noise={k: z[lo:hi].to(device) for k, z in step_noise.items()},
                store_velocities=spec.store_velocities, negative_cond=None if negative is None else negative[lo:hi],
                coefficients=[type(c)(c.c_x[lo:hi], c.c_v[lo:hi], c.std[lo:hi]) for c in coefficients])
            images.append(self.adapter.decode(part["all_latents"][:, -1]).cpu())
            parts.append({k: t.cpu() for k, t in part.items()})
        out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        image = torch.cat(images)
        extra = {f"{k}": t.cpu() for k, t in cond.as_dict().items()}
        if negative is not None:
            extra.update({f"negative_{k}": t.cpu() for k, t in negative.as_dict().items()})
        results = []
        for i in range(bsz):
            trajectory = {"latents": out["all_latents"][i], "timesteps": sigmas_cpu[i].clone(),
                          "log_probs": out["rollout_log_probs"][i], "train_mask": out["train_mask"][i],
                          "sde_cx": out["sde_cx"][i], "sde_cv": out["sde_cv"][i], "sde_std": out["sde_std"][i],
                          **{k: t[i] for k, t in extra.items()}}
            if "old_velocities" in out:
                trajectory["old_velocities"] = out["old_velocities"][i]
            results.append(DiffusionOutput(
                output={"payload": {"image": image[i:i + 1], "trajectory": trajectory}},
                trajectory_latents=trajectory["latents"], trajectory_timesteps=trajectory["timesteps"],
                trajectory_log_probs=trajectory["log_probs"]))
        return results

    # ------------------------------------------------------------------ weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy ``(name, tensor)`` pairs into this pipeline's parameters and buffers; returns the names loaded.

        Names are the pipeline's (``transformer.<diffusers key>``, as vllm-omni's loader prefixes them); a
        transformer name without the prefix is accepted too (the trainer's full-weight sync). After a LoRA was
        attached, a base weight ``…to_q.weight`` lands in peft's ``…to_q.base_layer.weight``.
        """
        targets = dict(self.named_parameters())
        targets.update(dict(self.named_buffers()))
        loaded = set()
        with self._lock, torch.no_grad():
            for name, tensor in weights:
                key = self._resolve(name, targets)
                target = targets[key]
                if target.shape != tensor.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)} but {key!r} is "
                                     f"{tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                loaded.add(key)
        return loaded

    @staticmethod
    def _resolve(name: str, targets: dict) -> str:
        candidates = [name, f"transformer.{name}"]
        for c in list(candidates):
            head, _, leaf = c.rpartition(".")
            candidates.append(f"{head}.base_layer.{leaf}")
        for c in candidates:
            if c in targets:
                return c
        raise KeyError(f"weight {name!r} matches no parameter of the pipeline (tried {candidates}); full-weight sync "
                       "sends the transformer's state_dict names")

    # ------------------------------------------------------------------ LoRA (vllm-omni's add/remove LoRA API)

    def add_lora(self, lora_request) -> bool:
        """Load the peft LoRA at ``lora_request.lora_path`` and sample with it from now on.

        The transformer carries one peft adapter, configured as the trainer's, whose weights each call replaces:
        a weight sync is ``add_lora(new id)`` then ``remove_lora(old id)``. Returns True.
        """
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

        state, config = read_lora_dir(lora_request.lora_path)
        with self._lock:
            if not self.adapter.has_lora:
                # Injected as the trainer's engine injects it (workers/engine.py), in the base weights' dtype.
                targets = config["target_modules"]
                lora = LoraConfig(r=int(config["r"]), lora_alpha=config["lora_alpha"], bias="none",
                                  target_modules=targets if isinstance(targets, str) else list(targets))
                self.transformer.requires_grad_(False)
                inject_adapter_in_model(lora, self.transformer, adapter_name=self.lora_adapter_name)
                base = next(p.dtype for n, p in self.transformer.named_parameters() if "lora_" not in n)
                for n, p in self.transformer.named_parameters():
                    if "lora_" in n:
                        p.data = p.data.to(base)
            result = set_peft_model_state_dict(self.transformer, state, adapter_name=self.lora_adapter_name)
            unexpected = list(getattr(result, "unexpected_keys", []) or [])
            if unexpected:
                raise ValueError(f"LoRA {lora_request.lora_path!r} has weights for modules the transformer lacks: "
                                 f"{unexpected[:5]}")
            self._set_lora_enabled(True)
            self._active_lora_id = int(lora_request.lora_int_id)
            self._lora_ids.add(self._active_lora_id)
        return True

    def remove_lora(self, adapter_id: int) -> bool:
        """Forget adapter ``adapter_id``; removing the active one samples with the base weights again."""
        with self._lock:
            if int(adapter_id) not in self._lora_ids:
                return False
            self._lora_ids.discard(int(adapter_id))
            if self._active_lora_id == int(adapter_id):
                self._set_lora_enabled(False)
                self._active_lora_id = None
        return True

    def list_loras(self) -> list[int]:
        return sorted(self._lora_ids)

    def _set_lora_enabled(self, on: bool) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for m in self.transformer.modules():
            if isinstance(m, BaseTunerLayer):
                m.enable_adapters(on)


def _rollout_pipeline(adapter_cls) -> type[AdapterRolloutPipeline]:
    """The pipeline of one architecture: its diffusers checkpoint layout, with our kernels through its adapter."""
    return type(PIPELINE_CLASSES[adapter_cls.architecture], (AdapterRolloutPipeline,), {
        "__module__": __name__,
        "__doc__": f"``{adapter_cls.architecture}`` checkpoints with our kernels, through ``{adapter_cls.__name__}``.",
        "diffusers_pipeline": f"diffusers.{adapter_cls.architecture}",
        "transformer_class": f"diffusers.{adapter_cls.transformer_class}",
        "adapter_class": f"{adapter_cls.__module__}.{adapter_cls.__name__}",
    })


# diffusers pipeline class (model_index.json "_class_name") -> our pipeline, one per architecture module
# (verl_diffusion/models); each is also a module attribute under its name, where vllm-omni resolves it.
PIPELINES: dict[str, type[AdapterRolloutPipeline]] = {cls.architecture: _rollout_pipeline(cls)
                                                      for cls in adapter_classes().values()}
globals().update({cls.__name__: cls for cls in PIPELINES.values()})


def register_pipelines() -> dict[str, str]:
    """Register each pipeline with vllm-omni's registry as ``VerlDiffusion<architecture>``; returns the names.

    For vllm-omni processes that resolve pipelines by ``model_class_name``; ``custom_pipeline_args`` needs none.
    """
    from vllm_omni.diffusion.registry import register_diffusion_model

    names = {}
    for arch, cls in PIPELINES.items():
        names[arch] = f"VerlDiffusion{arch}"
        register_diffusion_model(names[arch], cls.__module__, cls.__name__)
    return names
