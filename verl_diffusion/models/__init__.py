"""Model adapters, one file per architecture. Importing this package imports no diffusers code.

An architecture is one module of this package that names its adapter ``ADAPTER`` (a ``DiffusersAdapter`` subclass
with its ``name``, pipeline class, transformer class and config-only latent grid) and defines
``build_tiny_pipeline``; the tables below are derived from those modules, so a new architecture is one file (and
its test). An adapter is chosen by name (``actor_rollout_ref.model.architecture``) or, by default, by the diffusers
pipeline class that a model directory's ``model_index.json`` names (:func:`adapter_for_path`).
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

# Modules of this package that are not an architecture.
_SHARED_MODULES = frozenset({"base", "lora", "tiny", "tiny_parts"})


@lru_cache(maxsize=None)
def architecture_modules() -> dict:
    """architecture name → its module (the adapter modules import torch and models.base only)."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name in _SHARED_MODULES:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        adapter = getattr(module, "ADAPTER", None)
        if adapter is not None:
            found[adapter.name] = module
    return found


def adapter_classes() -> dict:
    """architecture name → adapter class."""
    return {name: module.ADAPTER for name, module in architecture_modules().items()}


def pipeline_architectures() -> dict:
    """diffusers pipeline class (``model_index.json``'s ``_class_name``) → architecture name."""
    return {cls.architecture: name for name, cls in adapter_classes().items()}


def __getattr__(attr: str):
    # MODEL_ADAPTERS (name → "module:Class") and PIPELINE_ARCHITECTURES (diffusers pipeline class → name), derived
    # from the architecture modules when first read.
    if attr == "MODEL_ADAPTERS":
        return {name: f"{cls.__module__}:{cls.__name__}" for name, cls in adapter_classes().items()}
    if attr == "PIPELINE_ARCHITECTURES":
        return pipeline_architectures()
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


def get_adapter_cls(name: str):
    """The adapter class of architecture ``name``."""
    classes = adapter_classes()
    if name not in classes:
        raise KeyError(f"model architecture {name!r} is unknown; choose one of {sorted(classes)}. "
                       "A new architecture is one file in verl_diffusion/models/ whose DiffusersAdapter subclass "
                       "(models/base.py) it names ADAPTER (docs/development.md).")
    return classes[name]


def architecture_of(path) -> str:
    """The architecture name of a local diffusers directory, from its pipeline class name."""
    from verl_diffusion.models.base import pipeline_class_name

    found = pipeline_class_name(path)
    by_pipeline = pipeline_architectures()
    if found not in by_pipeline:
        raise ValueError(f"model path {str(path)!r} holds a {found!r} pipeline; supported pipelines: "
                         f"{sorted(by_pipeline)}")
    return by_pipeline[found]


def adapter_for_path(path):
    """The adapter class for a local diffusers directory (by its ``model_index.json`` ``_class_name``)."""
    return get_adapter_cls(architecture_of(path))


__all__ = ["MODEL_ADAPTERS", "PIPELINE_ARCHITECTURES", "adapter_classes", "adapter_for_path", "architecture_modules",
           "architecture_of", "get_adapter_cls", "pipeline_architectures"]
