"""vllm-omni rollout backend: custom pipelines on our step kernels and a verl rollout replica (docs/vllm_omni.md).

``protocol`` is pure Python; ``pipelines`` and ``worker_extension`` import vllm-omni and load only where it is
installed (``make setup-vllm-omni``); ``replica`` imports it only when an engine starts. This module holds what the
replica's driver side needs without vllm-omni: the architecture table and the latent shape of a checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

# diffusers pipeline class of a checkpoint (model_index.json "_class_name") -> our pipeline in ``pipelines``.
PIPELINE_CLASSES = {
    "StableDiffusion3Pipeline": "SD3RolloutPipeline",
    "QwenImagePipeline": "QwenImageRolloutPipeline",
    "FluxPipeline": "FluxRolloutPipeline",
    "Flux2KleinPipeline": "Flux2KleinRolloutPipeline",
}


def _config(model_path, subfolder: str) -> dict:
    return json.loads((Path(model_path) / subfolder / "config.json").read_text())


def latent_shape_of(model_path: str, height: int, width: int) -> tuple[int, int, int]:
    """The latent dims [C, h, w] of one ``height`` × ``width`` sample of the checkpoint at ``model_path``.

    Read from the transformer and VAE configs (no weights loaded), so the replica plans x_{t_0} and z_k before the
    engine has built anything. Mirrors each adapter's ``latent_shape`` (models/*.py; a test checks that they agree):
    SD3 keeps the VAE's latents; Qwen-Image and FLUX.1 pack 2×2 latent patches into the transformer's input channels
    (in_channels = 4·C); FLUX.2 [klein] runs the flow in the patchified space (in_channels = 4·C, h = H / 2f).
    """
    from verl_diffusion.models.base import pipeline_class_name

    arch = pipeline_class_name(model_path)
    if arch not in PIPELINE_CLASSES:
        raise ValueError(f"the vllm_omni replica has no pipeline for {arch!r} (model {model_path!r}); available: "
                         f"{sorted(PIPELINE_CLASSES)}")
    tr, vae = _config(model_path, "transformer"), _config(model_path, "vae")
    if arch == "QwenImagePipeline":          # the causal 3D VAE: factor 2 per temporal-downsample entry
        f = 2 ** len(vae["temperal_downsample"])
    else:
        f = 2 ** (len(vae["block_out_channels"]) - 1)
    channels = int(tr["in_channels"])
    if arch == "StableDiffusion3Pipeline":
        multiple, dims = f * int(tr.get("patch_size", 2)), (channels, height // f, width // f)
    elif arch == "Flux2KleinPipeline":
        multiple, dims = 2 * f, (channels, height // (2 * f), width // (2 * f))
    else:
        multiple, dims = 2 * f, (channels // 4, height // f, width // f)
    if height % multiple or width % multiple:
        raise ValueError(f"actor_rollout_ref.rollout.resolution {height}x{width} is not a multiple of {multiple}, "
                         f"which a {arch} needs")
    return dims
