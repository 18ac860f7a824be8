"""Model adapters, one per architecture (STYLE §7). Resolved lazily: importing this package imports no
diffusers code."""

from __future__ import annotations

import importlib

# architecture name (``actor_rollout_ref.model.architecture``) → "module:Class", imported on first use.
MODEL_ADAPTERS: dict[str, str] = {
    "sd3": "verl_diffusion.models.sd3:SD3Adapter",
}


def get_adapter_cls(name: str):
    """The adapter class registered under ``name`` (imports its module now)."""
    if name not in MODEL_ADAPTERS:
        raise KeyError(f"model architecture {name!r} is unknown; choose one of {sorted(MODEL_ADAPTERS)}. "
                       "A new architecture is one file in verl_diffusion/models/ implementing "
                       "FlowModelAdapter (models/base.py) plus one line in MODEL_ADAPTERS.")
    module_name, _, cls_name = MODEL_ADAPTERS[name].partition(":")
    return getattr(importlib.import_module(module_name), cls_name)


__all__ = ["MODEL_ADAPTERS", "get_adapter_cls"]
