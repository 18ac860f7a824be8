"""Shared CLIP loading and feature extraction for the PickScore and aesthetic rewards (transformers)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np


def resolve_device(device: str | None) -> str:
    import torch

    if device:
        return device
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_clip(model_path: str, processor_path: str | None, *, device: str, dtype: str) -> tuple[Any, Any]:
    """Load ``CLIPModel`` and its processor from local directories (``save_pretrained`` layout).

    Raises a ValueError naming the path when it is missing, so a typo fails before training starts.
    """
    import torch
    from transformers import AutoProcessor, CLIPModel

    for p in {model_path, processor_path or model_path}:
        if not p or not os.path.isdir(os.path.expanduser(p)):
            raise ValueError(
                f"CLIP directory {p!r} does not exist; pass a local save_pretrained directory "
                "(convert hub checkpoints beforehand: docs/rewards.md)"
            )
    model_path = os.path.expanduser(model_path)
    processor = AutoProcessor.from_pretrained(os.path.expanduser(processor_path or model_path))
    model = CLIPModel.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device).eval()
    model.requires_grad_(False)
    return model, processor


def image_features(model: Any, processor: Any, images: list[np.ndarray], device: str) -> Any:
    """Projected CLIP image embeddings [B, D] (not normalised)."""
    from PIL import Image

    inputs = processor(images=[Image.fromarray(im) for im in images], return_tensors="pt")
    pixel_values = inputs["pixel_values"].to(device=device, dtype=model.dtype)
    pooled = model.vision_model(pixel_values=pixel_values).pooler_output
    return model.visual_projection(pooled)


def text_features(model: Any, processor: Any, prompts: list[str], device: str) -> Any:
    """Projected CLIP text embeddings [B, D] (not normalised); prompts truncated to the model's length."""
    max_len = model.config.text_config.max_position_embeddings
    inputs = processor(text=list(prompts), padding=True, truncation=True, max_length=max_len, return_tensors="pt")
    out = model.text_model(input_ids=inputs["input_ids"].to(device), attention_mask=inputs["attention_mask"].to(device))
    return model.text_projection(out.pooler_output)
