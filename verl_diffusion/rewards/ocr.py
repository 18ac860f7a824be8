"""OCR reward for visual text rendering (Flow-GRPO's published definition).

target = the text between the first pair of double quotes in the prompt (or the row's
``reward_model.ground_truth``, which data_process/ocr.py stores), lower-cased with spaces removed;
recognised = the OCR engine's text lines joined, lower-cased with spaces removed;
dist = 0 if target is a substring of recognised, else min(Levenshtein(recognised, target), len(target));
score = 1 - dist / len(target), in [0, 1].

Engine: rapidocr-onnxruntime (PP-OCR ONNX weights ship inside the wheel, so it runs offline on CPU).
Install with ``pip install verl-diffusion[ocr]``.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from verl_diffusion.rewards.base import Reward, RewardOutput, register_reward, row_ground_truth


def extract_target(prompt: str) -> str | None:
    """The text between the first pair of double quotes, or None when the prompt has no such pair."""
    parts = prompt.split('"')
    if len(parts) < 3:
        return None
    return parts[1]


def normalize_text(text: str) -> str:
    """Lower-case and remove spaces (the published normalisation)."""
    return text.replace(" ", "").lower()


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions all cost 1); O(len(a)·len(b)) time, O(len(b)) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def ocr_score(recognized: str, target: str) -> float:
    """1 - min(dist, len) / len on normalised strings; a target contained in the recognised text scores 1."""
    rec, tgt = normalize_text(recognized), normalize_text(target)
    if not tgt:
        raise ValueError("OCR target text is empty after normalisation")
    dist = 0 if tgt in rec else min(levenshtein(rec, tgt), len(tgt))
    return 1.0 - dist / len(tgt)


@register_reward("ocr")
class OCRReward(Reward):
    """Options: ``min_confidence`` (drop recognised lines below it; 0 keeps all, as published),
    ``use_cls`` (text-direction classifier; off as published), ``num_threads`` (onnxruntime intra-op
    threads per engine; -1 = library default, use 1 inside a process pool)."""

    def __init__(self, min_confidence: float = 0.0, use_cls: bool = False, num_threads: int = -1):
        self.min_confidence = float(min_confidence)
        self.use_cls = bool(use_cls)
        self.num_threads = int(num_threads)
        self._ready = False

    def setup(self) -> None:
        self._m_local = threading.local()  # one engine per scoring thread (thread executor)
        self._engine()  # load now, so a missing package fails here with its message

    def _engine(self) -> Any:
        engine = getattr(self._m_local, "engine", None)
        if engine is None:
            try:
                from rapidocr_onnxruntime import RapidOCR
            except ImportError as e:
                raise ImportError(
                    "the ocr reward needs rapidocr-onnxruntime: pip install 'verl-diffusion[ocr]'"
                ) from e
            kwargs: dict[str, Any] = {}
            if self.num_threads > 0:
                kwargs = {"intra_op_num_threads": self.num_threads, "inter_op_num_threads": 1}
            engine = self._m_local.engine = RapidOCR(**kwargs)
        return engine

    def recognize(self, image: np.ndarray) -> str:
        """All recognised text lines of one RGB uint8 image, joined in reading order."""
        bgr = np.ascontiguousarray(image[..., ::-1])  # the engine takes OpenCV's BGR order
        result, _ = self._engine()(bgr, use_cls=self.use_cls)
        if not result:
            return ""
        return "".join(text for _, text, conf in result if float(conf) >= self.min_confidence)

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        scores = np.full(len(images), np.nan)
        errors = []
        for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata)):
            target = row_ground_truth(meta)
            if not isinstance(target, str) or not target.strip():
                target = extract_target(prompt)
            if target is None or not normalize_text(target):
                # NaN: counted as a failure and given the penalty
                errors.append(f"no target text: prompt has no non-empty text between double quotes: {prompt[:80]!r}")
                continue
            scores[i] = ocr_score(self.recognize(image), target)
        return RewardOutput(scores, errors=errors)
