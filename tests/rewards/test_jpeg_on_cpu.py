"""JPEG (in)compressibility: DDPO's kB definition, the bpp normalisation, monotone in image complexity."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from verl_diffusion.rewards import build_reward
from verl_diffusion.rewards.jpeg import JpegCompressibility, JpegIncompressibility


def _complexity_ladder(size: int = 64) -> list[np.ndarray]:
    """Flat, then increasing amounts of noise: strictly more information per image."""
    rng = np.random.default_rng(0)
    base = np.full((size, size, 3), 128.0)
    noise = rng.standard_normal((size, size, 3))
    return [np.clip(base + a * noise, 0, 255).astype(np.uint8) for a in (0, 4, 16, 48, 128)]


def test_kb_unit_is_ddpo_definition():
    img = _complexity_ladder()[3]
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=95)
    out = JpegCompressibility(unit="kb")([img], [""], [{}])
    assert out.scores[0] == pytest.approx(-len(buf.getvalue()) / 1000)


def test_monotone_in_complexity():
    ladder = _complexity_ladder()
    comp = JpegCompressibility()(ladder, [""] * 5, [{}] * 5).scores
    incomp = JpegIncompressibility()(ladder, [""] * 5, [{}] * 5).scores
    assert comp[0] == 0.0  # flat image: the reference
    assert np.all(np.diff(comp) < 0) and np.all(np.diff(incomp) > 0)
    np.testing.assert_allclose(comp, -incomp)


def test_bpp_is_order_one_at_any_resolution():
    rng = np.random.default_rng(1)
    for size in (32, 256):
        noise = (rng.random((size, size, 3)) * 255).astype(np.uint8)
        s = JpegIncompressibility()([noise], [""], [{}]).scores[0]
        assert 7.0 < s < 12.0  # uniform noise ≈ 9.3 bits per pixel at quality 95


def test_tensor_input_through_multireward():
    ladder = torch.from_numpy(np.stack(_complexity_ladder())).permute(0, 3, 1, 2).contiguous()  # [B,3,H,W] uint8
    res = build_reward({"jpeg_compressibility": 1.0})(ladder, [""] * 5, [{}] * 5)
    assert res.scores.dtype == torch.float32 and res.scores.shape == (5,)
    assert torch.all(res.scores[1:] < res.scores[:-1])


def test_bad_unit_message():
    with pytest.raises(ValueError, match="unit='mb'.*bpp"):
        JpegCompressibility(unit="mb")
