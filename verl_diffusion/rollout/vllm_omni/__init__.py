"""vllm-omni rollout backend: custom pipelines on our step kernels and a verl rollout replica (docs/vllm_omni.md).

``protocol`` is pure Python; ``pipelines`` and ``worker_extension`` import vllm-omni and load only where it is
installed (``make setup-vllm-omni``); ``replica`` imports it only when an engine starts. This module holds what the
replica's driver side needs without vllm-omni: the architecture table and the latent shape of a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from verl_diffusion.models import adapter_classes, pipeline_architectures


def rollout_pipeline_name(adapter_cls) -> str:
    """Our vllm-omni pipeline class for an adapter (``SD3Adapter`` -> ``SD3RolloutPipeline``)."""
    return adapter_cls.__name__.removesuffix("Adapter") + "RolloutPipeline"


# diffusers pipeline class of a checkpoint (model_index.json "_class_name") -> our pipeline in ``pipelines``, one per
# architecture module (verl_diffusion/models).
PIPELINE_CLASSES = {cls.architecture: rollout_pipeline_name(cls) for cls in adapter_classes().values()}


def _config(model_path, subfolder: str) -> dict:
    return json.loads((Path(model_path) / subfolder / "config.json").read_text())


def latent_shape_of(model_path: str, height: int, width: int) -> tuple[int, int, int]:
    """The latent dims [C, h, w] of one ``height`` × ``width`` sample of the checkpoint at ``model_path``.

    Read from the transformer and VAE configs (no weights loaded), so the replica plans x_{t_0} and z_k before the
    engine has built anything: each adapter's ``latent_grid`` (models/<architecture>.py), which a test checks against
    the loaded adapter's ``latent_shape``.
    """
    from verl_diffusion.models.base import pipeline_class_name

    arch = pipeline_class_name(model_path)
    if arch not in PIPELINE_CLASSES:
        raise ValueError(f"the vllm_omni replica has no pipeline for {arch!r} (model {model_path!r}); available: "
                         f"{sorted(PIPELINE_CLASSES)}")
    adapter = adapter_classes()[pipeline_architectures()[arch]]
    multiple, dims = adapter.latent_grid(_config(model_path, "transformer"), _config(model_path, "vae"), height, width)
    if height % multiple or width % multiple:
        raise ValueError(f"actor_rollout_ref.rollout.resolution {height}x{width} is not a multiple of {multiple}, "
                         f"which a {arch} needs")
    return dims
