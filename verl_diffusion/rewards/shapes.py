"""Shapes-world reward: detect the objects of each image by colour and geometry and score them
against the row's GenEval-style metadata (verl_diffusion/shapes/detect.py has the rule).

Metadata comes from ``reward_model.ground_truth`` (JSON text or a dict, as data_process/shapes.py
writes it) or a bare metadata dict. The score is the partial credit in [0, 1]; ``strict`` (all correct,
GenEval's metric) and ``strict/<tag>`` are details, so training logs ``reward/shapes/strict`` and
``reward/shapes/strict/<tag>``, and ``reward/<tag>`` the partial credit per tag. A row without metadata
scores NaN (MultiReward penalises and counts it) with the cause in ``errors``.
"""

from __future__ import annotations

import numpy as np

from verl_diffusion.rewards.base import Reward, RewardOutput, register_reward
from verl_diffusion.rewards.geneval import geneval_metadata

SCORE_KEYS = ("reward", "strict")


@register_reward("shapes")
class ShapesReward(Reward):
    """Options: ``score_key`` (reward: partial credit | strict: 1 if all correct else 0) and ``strict_weight`` w in
    [0, 1]: with ``score_key`` reward the score is (1 − w)·partial + w·strict, so that a sample with every object
    right but a colour bound to the wrong object (most of the partial credit) ranks below a fully correct one.
    """

    def __init__(self, score_key: str = "reward", strict_weight: float = 0.0):
        if score_key not in SCORE_KEYS:
            raise ValueError(f"shapes: score_key={score_key!r} is unknown; choose one of {list(SCORE_KEYS)}")
        if not 0.0 <= float(strict_weight) <= 1.0:
            raise ValueError(f"shapes: strict_weight={strict_weight!r} is out of range; choose a number in [0, 1]")
        self.score_key = score_key
        self.strict_weight = float(strict_weight)
        self._ready = False

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        from verl_diffusion.shapes.detect import score as score_image

        n = len(images)
        rewards, strict = np.full(n, np.nan), np.full(n, np.nan)
        per_tag: dict[str, np.ndarray] = {}
        missing = 0
        for i, (image, meta) in enumerate(zip(images, metadata)):
            m = geneval_metadata(meta)
            if m is None:
                missing += 1
                continue
            res = score_image(image, m)
            rewards[i], strict[i] = res.reward, float(res.strict)
            tag = str(m.get("tag", "unknown"))
            per_tag.setdefault(f"strict/{tag}", np.full(n, np.nan))[i] = strict[i]
            per_tag.setdefault(f"reward/{tag}", np.full(n, np.nan))[i] = rewards[i]
        errors = []
        if missing:
            errors.append(f"{missing} row(s) carry no shapes metadata (reward_model.ground_truth must be the "
                          "tag/include JSON that data_process/shapes.py writes)")
        if self.score_key == "strict":
            scores = strict
        else:
            scores = (1.0 - self.strict_weight) * rewards + self.strict_weight * strict
        return RewardOutput(scores, {"strict": strict, **per_tag}, errors=errors)
