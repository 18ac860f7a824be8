"""Composition-weighted held-out accuracy per tag, its paired gain and standard error, within-prompt diversity
(verl_diffusion/trainer/tag_report.py)."""

import math

import numpy as np
import pytest

from verl_diffusion.shapes.world import make_metadata
from verl_diffusion.trainer.tag_report import (
    TAG_MEAN, composition_key, composition_metrics, tag_accuracy, tag_gains, within_prompt_diversity)
from verl_diffusion.trainer.validation import paired_standard_error


def test_both_wordings_of_a_composition_share_a_key():
    comp = (("red", "circle"), "left of", ("blue", "square"))
    a, b = make_metadata("position", comp), make_metadata("position", comp, swap=True)
    assert a["prompt"] != b["prompt"] and composition_key(a, a["prompt"]) == composition_key(b, b["prompt"])
    other = make_metadata("position", (("blue", "square"), "left of", ("red", "circle")))
    assert composition_key(other, other["prompt"]) != composition_key(a, a["prompt"])
    assert composition_key(None, "a photo") == "a photo"


def test_every_composition_and_every_tag_weighs_the_same():
    # tag A: composition x has 3 images (all right), y has 1 (wrong) -> 0.5, not 0.75; tag B: 2 of 4 right -> 0.5
    values = [1, 1, 1, 0, 1, 0, 1, 0]
    tags = ["A"] * 4 + ["B"] * 4
    keys = ["x", "x", "x", "y", "u", "u", "v", "v"]
    acc = tag_accuracy(values, tags, keys)
    assert acc == {"A": 0.5, "B": 0.5, TAG_MEAN: 0.5}
    # one tag with many more images does not outweigh another
    acc = tag_accuracy([1] * 10 + [0], ["A"] * 10 + ["B"], ["x"] * 10 + ["z"])
    assert acc[TAG_MEAN] == 0.5
    # a failed score (NaN) is left out
    assert tag_accuracy([1, float("nan"), 0], ["A"] * 3, ["x", "x", "y"])["A"] == 0.5


def test_gain_and_standard_error_reduce_to_the_paired_ones_when_balanced():
    rng = np.random.default_rng(0)
    before, after = rng.integers(0, 2, 60).astype(float), rng.integers(0, 2, 60).astype(float)
    keys = [f"c{i % 6}" for i in range(60)]           # 6 compositions, 10 images each
    rows = tag_gains(before, after, ["T"] * 60, keys)
    t, mean = rows
    assert t.tag == "T" and mean.tag == TAG_MEAN and t.compositions == 6 and t.images == 60
    assert t.before == pytest.approx(before.mean()) and t.after == pytest.approx(after.mean())
    assert t.gain == pytest.approx(after.mean() - before.mean())
    assert t.se == pytest.approx(paired_standard_error(before, after))
    assert mean.se == pytest.approx(t.se)


def test_gain_standard_error_of_unequal_compositions_and_tags():
    before = np.array([0, 0, 0, 0, 1, 0], dtype=float)
    after = np.array([1, 1, 0, 1, 1, 1], dtype=float)
    tags = ["A", "A", "A", "A", "B", "B"]
    keys = ["x", "x", "x", "y", "u", "v"]
    a, b, mean = tag_gains(before, after, tags, keys)
    # A: weights 1/6, 1/6, 1/6, 1/2; d = 1, 1, 0, 1 -> gain 2/3 + 1/6·0... = 1/6+1/6+0+1/2
    assert a.gain == pytest.approx(5 / 6)
    d = np.array([1, 1, 0, 1.0])
    assert a.se == pytest.approx(math.sqrt(3 / 36 + 1 / 4) * d.std(ddof=1))
    assert b.gain == pytest.approx(0.5) and b.se == pytest.approx(math.sqrt(0.5) * np.array([0, 1.0]).std(ddof=1))
    assert mean.gain == pytest.approx((5 / 6 + 0.5) / 2) and mean.se == pytest.approx(math.hypot(a.se, b.se) / 2)
    assert mean.compositions == 4 and mean.images == 6


def test_diversity_is_zero_for_collapsed_prompts_and_metrics_name_the_tags():
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (1, 3, 4, 4), dtype=np.uint8)
    same = np.concatenate([img, img, img])
    assert within_prompt_diversity(same, ["a", "a", "a"]) == pytest.approx(0.0, abs=1e-12)
    two = np.concatenate([np.zeros_like(img), np.full_like(img, 255)])
    assert within_prompt_diversity(two, ["a", "a"]) == pytest.approx(0.5)
    assert within_prompt_diversity(two, ["a", "b"]) is None    # one image per prompt: nothing to compare
    m = composition_metrics({"val/shapes/strict": [1, 0], "val/reward_mean": [0.3, 0.2]}, two,
                            {"tag": ["colors", "counting"], "composition": ["a", "b"]})
    assert m == {"val/shapes/strict/by_composition": 0.5, "val/shapes/strict/by_composition/colors": 1.0,
                 "val/shapes/strict/by_composition/counting": 0.0}
