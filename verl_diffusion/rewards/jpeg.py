"""JPEG compressibility / incompressibility (DDPO; Black et al. 2023, arXiv 2305.13301).

The image is encoded with PIL's JPEG encoder at ``quality`` (95, as in DDPO). DDPO's reward is
``-size_kB`` (compressibility) or ``+size_kB`` (incompressibility), ``unit="kb"`` here.

The default ``unit="bpp"`` rescales it so scores are O(1) at any resolution: bits per pixel above a flat
(uniform grey) image of the same size and quality, which removes the fixed header cost (~0.6 kB, which
would dominate tiny demo images):

    bpp = 8 * (size_bytes - size_bytes(flat image, same H, W)) / (H * W)

A flat image scores 0, a 512² photo about 1 to 4, uniform noise about 9.3 at quality 95. Both units are
monotone in the compressed size, so within a group they rank samples identically.
"""

from __future__ import annotations

import numpy as np

from verl_diffusion.rewards.base import Reward, RewardOutput, encode_jpeg, register_reward

JPEG_UNITS = ("bpp", "kb")


class _JpegSize(Reward):
    sign = -1.0

    def __init__(self, quality: int = 95, unit: str = "bpp"):
        if unit not in JPEG_UNITS:
            raise ValueError(f"{self.name}: unit={unit!r} is unknown; choose one of {list(JPEG_UNITS)}")
        if not 1 <= int(quality) <= 100:
            raise ValueError(f"{self.name}: quality={quality} must be in [1, 100]")
        self.quality = int(quality)
        self.unit = unit
        self._flat_bytes: dict[tuple[int, int], int] = {}
        self._ready = False

    def _flat(self, h: int, w: int) -> int:
        if (h, w) not in self._flat_bytes:
            self._flat_bytes[(h, w)] = len(encode_jpeg(np.full((h, w, 3), 128, np.uint8), self.quality))
        return self._flat_bytes[(h, w)]

    def size(self, image: np.ndarray) -> float:
        """Unsigned size of one image in this reward's unit."""
        nbytes = len(encode_jpeg(image, self.quality))
        if self.unit == "kb":
            return nbytes / 1000.0
        h, w = image.shape[:2]
        return 8.0 * (nbytes - self._flat(h, w)) / (h * w)

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        return RewardOutput(np.array([self.sign * self.size(im) + 0.0 for im in images], dtype=np.float64))


@register_reward("jpeg_compressibility")
class JpegCompressibility(_JpegSize):
    """Smaller JPEG is better: score = -size. Options: ``quality`` (95), ``unit`` (bpp | kb)."""

    sign = -1.0


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(_JpegSize):
    """Larger JPEG is better: score = +size. Options: ``quality`` (95), ``unit`` (bpp | kb)."""

    sign = 1.0
