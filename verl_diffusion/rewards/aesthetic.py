"""LAION aesthetic predictor (improved-aesthetic-predictor v2, as used by DDPO): an MLP on normalised CLIP
ViT-L/14 image embeddings that predicts a 1 to 10 rating.

Options: ``clip_path`` (local directory of ``openai/clip-vit-large-patch14``, save_pretrained layout),
``processor_path`` (defaults to ``clip_path``), ``mlp_path`` (the predictor's state dict, e.g.
``sac+logos+ava1-l14-linearMSE.pth``; keys ``layers.{0,2,4,6,7}.{weight,bias}``), ``device``, ``dtype``,
``batch_size``.
"""

from __future__ import annotations

import os

import numpy as np

from verl_diffusion.rewards._clip import image_features, load_clip, resolve_device
from verl_diffusion.rewards.base import Reward, RewardOutput, register_reward


def build_aesthetic_mlp(input_dim: int = 768):
    """The predictor's MLP. Layer indices match the published state dict (dropouts at 1, 3, 5)."""
    from torch import nn

    class AestheticMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(
                nn.Linear(input_dim, 1024),
                nn.Dropout(0.2),
                nn.Linear(1024, 128),
                nn.Dropout(0.2),
                nn.Linear(128, 64),
                nn.Dropout(0.1),
                nn.Linear(64, 16),
                nn.Linear(16, 1),
            )

        def forward(self, embed):  # [B, D] -> [B]
            return self.layers(embed).squeeze(-1)

    return AestheticMLP()


@register_reward("aesthetic")
class AestheticReward(Reward):
    def __init__(
        self,
        clip_path: str | None = None,
        mlp_path: str | None = None,
        processor_path: str | None = None,
        device: str | None = None,
        dtype: str = "float32",
        batch_size: int = 32,
    ):
        if not clip_path or not mlp_path:
            raise ValueError(
                "aesthetic needs options.aesthetic.clip_path (local CLIP ViT-L/14 directory) and "
                "options.aesthetic.mlp_path (predictor state dict .pth); see docs/rewards.md"
            )
        self.clip_path, self.mlp_path, self.processor_path = clip_path, mlp_path, processor_path
        self.device, self.dtype, self.batch_size = device, dtype, int(batch_size)
        self._ready = False

    def setup(self) -> None:
        import torch

        self.device = resolve_device(self.device)
        path = os.path.expanduser(self.mlp_path)
        if not os.path.isfile(path):
            raise ValueError(f"aesthetic mlp_path {self.mlp_path!r} is not a file")
        self._m_model, self._m_processor = load_clip(
            self.clip_path, self.processor_path, device=self.device, dtype=self.dtype
        )
        state = torch.load(path, map_location="cpu", weights_only=True)
        mlp = build_aesthetic_mlp(self._m_model.config.projection_dim)
        mlp.load_state_dict(state)
        self._m_mlp = mlp.to(device=self.device, dtype=getattr(torch, self.dtype)).eval()

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        import torch

        out = []
        with torch.no_grad():
            for s in range(0, len(images), self.batch_size):
                emb = image_features(self._m_model, self._m_processor, images[s : s + self.batch_size], self.device)
                emb = emb / emb.norm(dim=-1, keepdim=True)
                out.append(self._m_mlp(emb).float().cpu())
        return RewardOutput(torch.cat(out).double().numpy())
