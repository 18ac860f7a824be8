"""Tiny random diffusers pipelines, built fully offline, for tests, benchmarks and the CPU demo.

Nothing is downloaded: every component is created from a small config with a seeded random init, and the
tokenizers from an in-memory vocabulary (models/tiny_parts.py). The pipelines have the real classes (SD3:
``StableDiffusion3Pipeline`` with ``SD3Transformer2DModel``, ``AutoencoderKL``, two ``CLIPTextModelWithProjection``
and a ``T5EncoderModel``; Qwen-Image, FLUX.1 and FLUX.2-klein likewise), so ``save_pretrained`` /
``from_pretrained`` and every adapter code path are exercised exactly as with the real weights. Each architecture's
builder is its module's ``build_tiny_pipeline`` (models/<architecture>.py); :data:`TINY_BUILDERS` indexes them and
:func:`save_tiny` saves any of them, optionally with a sharded transformer checkpoint.

SD3 sizes (defaults): latent 16 channels × 16 × 16 (64 × 64 pixels, VAE factor 4), transformer 2 layers of
width 32, text encoders of width 16/16/32; about 136k parameters, 0.7 MB on disk in total.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from verl_diffusion.models import architecture_modules
from verl_diffusion.models.sd3 import build_tiny_pipeline as build_tiny_sd3_pipeline

# architecture name -> builder; save_tiny(name, path) saves any of them.
TINY_BUILDERS = {name: module.build_tiny_pipeline for name, module in architecture_modules().items()}


def save_tiny_sd3(path: Union[str, Path], **kwargs) -> Path:
    """Build a tiny SD3 pipeline (kwargs of :func:`build_tiny_sd3_pipeline`) and ``save_pretrained`` it.

    Returns: the directory, readable by ``SD3Adapter.from_pretrained`` and ``StableDiffusion3Pipeline``.
    """
    path = Path(path)
    build_tiny_sd3_pipeline(**kwargs).save_pretrained(str(path), safe_serialization=True)
    return path


def save_tiny(architecture: str, path: Union[str, Path], *, max_shard_size: Optional[str] = None, **kwargs) -> Path:
    """Build the tiny pipeline of ``architecture`` (a key of :data:`TINY_BUILDERS`) and ``save_pretrained`` it.

    ``max_shard_size`` (e.g. "100KB") saves the transformer as a sharded safetensors checkpoint with an
    index file, as the real Qwen-Image / FLUX checkpoints are. Returns the directory.
    """
    if architecture not in TINY_BUILDERS:
        raise KeyError(f"tiny architecture {architecture!r} is unknown; choose one of {sorted(TINY_BUILDERS)}")
    path = Path(path)
    pipe = TINY_BUILDERS[architecture](**kwargs)
    pipe.save_pretrained(str(path), safe_serialization=True)
    if max_shard_size is not None:
        import shutil

        shutil.rmtree(path / "transformer")
        pipe.transformer.save_pretrained(str(path / "transformer"), safe_serialization=True,
                                         max_shard_size=max_shard_size)
    return path
