"""PickScore: human-preference reward (Kirstain et al. 2023, arXiv 2305.01569), a fine-tuned CLIP-H/14.

score = logit_scale.exp() · cos(text_embedding, image_embedding) / 26, as Flow-GRPO publishes it (the
division by 26 brings typical scores near 0.8 to 0.9).

Options: ``model_path`` (local directory of the converted ``yuvalkirstain/PickScore_v1`` checkpoint),
``processor_path`` (local directory of the ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` processor; defaults
to ``model_path``), ``device`` (default cuda if available), ``dtype`` (float32), ``batch_size`` (32).
"""

from __future__ import annotations

import numpy as np

from verl_diffusion.rewards._clip import image_features, load_clip, resolve_device, text_features
from verl_diffusion.rewards.base import Reward, RewardOutput, register_reward

PICKSCORE_SCALE = 26.0


@register_reward("pickscore")
class PickScoreReward(Reward):
    def __init__(
        self,
        model_path: str | None = None,
        processor_path: str | None = None,
        device: str | None = None,
        dtype: str = "float32",
        batch_size: int = 32,
    ):
        if not model_path:
            raise ValueError(
                "pickscore needs options.pickscore.model_path: a local directory holding the PickScore_v1 "
                "CLIPModel (save_pretrained layout); see docs/rewards.md"
            )
        self.model_path, self.processor_path = model_path, processor_path
        self.device, self.dtype, self.batch_size = device, dtype, int(batch_size)
        self._ready = False

    def setup(self) -> None:
        self.device = resolve_device(self.device)
        self._m_model, self._m_processor = load_clip(
            self.model_path, self.processor_path, device=self.device, dtype=self.dtype
        )

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        import torch

        model, processor = self._m_model, self._m_processor
        out = []
        with torch.no_grad():
            for s in range(0, len(images), self.batch_size):
                img = image_features(model, processor, images[s : s + self.batch_size], self.device)
                txt = text_features(model, processor, prompts[s : s + self.batch_size], self.device)
                img = img / img.norm(dim=-1, keepdim=True)
                txt = txt / txt.norm(dim=-1, keepdim=True)
                cos = (img * txt).sum(-1)
                out.append((model.logit_scale.exp() * cos / PICKSCORE_SCALE).float().cpu())
        return RewardOutput(torch.cat(out).double().numpy())
