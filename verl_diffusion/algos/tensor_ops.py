"""Small tensor helpers the loss families share."""

from __future__ import annotations

import torch


def bcast(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] matching ``like``'s rank."""
    return s.reshape(s.shape[0], *([1] * (like.dim() - 1)))


def mean_e(u: torch.Tensor) -> torch.Tensor:
    """Per-element mean over latent dims: [B, *] -> [B]."""
    return u.flatten(1).mean(dim=1)
