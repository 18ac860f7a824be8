"""Model adapters, one per architecture. Resolved lazily: importing this package imports no
diffusers code.

An adapter is chosen by name (``actor_rollout_ref.model.architecture``) or, by default, by the diffusers
pipeline class that a model directory's ``model_index.json`` names (:func:`adapter_for_path`).
"""

from __future__ import annotations

import importlib

# architecture name → "module:Class", imported on first use.
MODEL_ADAPTERS: dict[str, str] = {
    "sd3": "verl_diffusion.models.sd3:SD3Adapter",
    "qwen_image": "verl_diffusion.models.qwen_image:QwenImageAdapter",
    "flux": "verl_diffusion.models.flux:FluxAdapter",
    "flux2_klein": "verl_diffusion.models.flux2:Flux2KleinAdapter",
}

# diffusers pipeline class (model_index.json ``_class_name``) → architecture name.
PIPELINE_ARCHITECTURES: dict[str, str] = {
    "StableDiffusion3Pipeline": "sd3",
    "QwenImagePipeline": "qwen_image",
    "FluxPipeline": "flux",
    "Flux2KleinPipeline": "flux2_klein",
}


def get_adapter_cls(name: str):
    """The adapter class registered under ``name`` (imports its module now)."""
    if name not in MODEL_ADAPTERS:
        raise KeyError(f"model architecture {name!r} is unknown; choose one of {sorted(MODEL_ADAPTERS)}. "
                       "A new architecture is one file in verl_diffusion/models/ implementing "
                       "FlowModelAdapter (models/base.py) plus one line in MODEL_ADAPTERS.")
    module_name, _, cls_name = MODEL_ADAPTERS[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


def architecture_of(path) -> str:
    """The architecture name of a local diffusers directory, from its pipeline class name."""
    from verl_diffusion.models.base import pipeline_class_name

    found = pipeline_class_name(path)
    if found not in PIPELINE_ARCHITECTURES:
        raise ValueError(f"model path {str(path)!r} holds a {found!r} pipeline; supported pipelines: "
                         f"{sorted(PIPELINE_ARCHITECTURES)}")
    return PIPELINE_ARCHITECTURES[found]


def adapter_for_path(path):
    """The adapter class for a local diffusers directory (by its ``model_index.json`` ``_class_name``)."""
    return get_adapter_cls(architecture_of(path))


__all__ = ["MODEL_ADAPTERS", "PIPELINE_ARCHITECTURES", "adapter_for_path", "architecture_of", "get_adapter_cls"]
