"""HPSv3: human-preference score (Ma et al., ICCV 2025), a Qwen2-VL-7B reward model; the path-space paper's
Qwen-Image reward. Score = the model's preference mean μ for (image, prompt) (its ``reward`` returns (μ, σ)).

Built on the ``hpsv3`` package from PyPI (``HPSv3RewardInferencer``), loaded lazily in the scoring process.
Weights come from local paths only (no hub download): ``checkpoint_path`` (HPSv3.safetensors) and
``config_path`` (the package's HPSv3_7B.yaml, whose ``model_name_or_path`` must name a local
Qwen2-VL-7B-Instruct directory when offline).

Install: hpsv3 1.0.0 pins ``transformers==4.45.2`` (and wants torchvision, deepspeed, trl), which cannot be
installed next to verl 0.9.1's transformers 5 and our torch pin, so it is not a pip extra of this package.
Run it in an environment of its own, either as a reward server (scripts/reward_server.py protocol) or by
installing it there with this package; importing it here fails with one line saying so.

Options: ``checkpoint_path`` (required), ``config_path`` (None: the package's default config), ``device``
(cuda if available), ``batch_size`` (8).
"""

from __future__ import annotations

import os
from typing import Optional

import numpy as np

from verl_diffusion.rewards.base import Reward, RewardOutput, register_reward

INSTALL_HINT = ("the hpsv3 reward needs the `hpsv3` package (pip install hpsv3==1.0.0), which pins "
                "transformers==4.45.2 and cannot share an environment with verl 0.9.1 (transformers 5); run it in a "
                "separate environment (docs/rewards.md, HPSv3)")


@register_reward("hpsv3")
class HPSv3Reward(Reward):
    def __init__(self, checkpoint_path: Optional[str] = None, config_path: Optional[str] = None,
                 device: Optional[str] = None, batch_size: int = 8):
        if not checkpoint_path:
            raise ValueError("hpsv3 needs options.hpsv3.checkpoint_path: a local HPSv3.safetensors (the weights are "
                             "never downloaded at run time); see docs/rewards.md")
        self.checkpoint_path, self.config_path = os.path.expanduser(str(checkpoint_path)), config_path
        self.device, self.batch_size = device, max(1, int(batch_size))
        self._ready = False

    def setup(self) -> None:
        if not os.path.isfile(self.checkpoint_path):
            raise FileNotFoundError(f"hpsv3: checkpoint_path={self.checkpoint_path!r} is not a file")
        try:
            from hpsv3.inference import HPSv3RewardInferencer
        except ImportError as e:
            raise ImportError(f"{INSTALL_HINT} ({type(e).__name__}: {e})") from e
        from verl_diffusion.rewards._clip import resolve_device

        self.device = resolve_device(self.device)
        self._m_model = HPSv3RewardInferencer(config_path=self.config_path, checkpoint_path=self.checkpoint_path,
                                              device=self.device)

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        import torch
        from PIL import Image

        out = []
        with torch.no_grad():
            for s in range(0, len(images), self.batch_size):
                pil = [Image.fromarray(im) for im in images[s:s + self.batch_size]]
                rewards = self._m_model.reward(pil, list(prompts[s:s + self.batch_size]))   # [b, 2]: (μ, σ)
                out.append(torch.as_tensor(rewards)[:, 0].float().cpu())
        return RewardOutput(torch.cat(out).double().numpy())
