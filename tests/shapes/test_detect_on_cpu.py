"""Detection and scoring in the shapes world (issue 9): all-correct on ground-truth renders of every
template, zero on renders of another prompt, robust to the blur and colour shift of a small VAE, partial
credit that rises with the number of matched objects."""

import json

import numpy as np
import pytest

from verl_diffusion.shapes.detect import Detection, detect, evaluate, satisfies, score
from verl_diffusion.shapes.world import (
    BACKGROUND, COLOURS, SHAPES, TAGS, ObjectSpec, Scene, compositions, make_metadata, render, sample_prompt, scene_for,
)

N_PER_TAG = 25


def gaussian_blur(img: np.ndarray, sigma: float) -> np.ndarray:
    r = int(np.ceil(3 * sigma))
    x = np.arange(-r, r + 1)
    k = np.exp(-x ** 2 / (2 * sigma ** 2))
    k /= k.sum()
    f = img.astype(np.float64)
    h, w = f.shape[:2]
    f = np.pad(f, ((r, r), (0, 0), (0, 0)), mode="edge")
    f = sum(k[i] * f[i:i + h] for i in range(2 * r + 1))
    f = np.pad(f, ((0, 0), (r, r), (0, 0)), mode="edge")
    return sum(k[i] * f[:, i:i + w] for i in range(2 * r + 1))


def vae_like(img: np.ndarray, rng: np.random.Generator, sigma: float, shift: float, noise: float,
             saturation: float = 1.0) -> np.ndarray:
    """Blur, colours pulled towards the background (``saturation`` < 1: washed out), a global colour shift
    of up to ``shift`` per channel and pixel noise of std ``noise``."""
    f = gaussian_blur(img, sigma) if sigma else img.astype(np.float64)
    bg = np.asarray(BACKGROUND, dtype=np.float64)
    f = bg + saturation * (f - bg)
    f = f + rng.uniform(-shift, shift, 3) + rng.normal(0.0, noise, f.shape)
    return np.clip(np.rint(f), 0, 255).astype(np.uint8)


def prompts_of(tag: str, rng: np.random.Generator, n: int) -> list[dict]:
    comps = compositions(tag)
    return [make_metadata(tag, comps[int(rng.integers(len(comps)))], swap=bool(rng.integers(2))) for _ in range(n)]


@pytest.mark.parametrize("size", [32, 64])
@pytest.mark.parametrize("tag", TAGS)
def test_ground_truth_renders_are_all_correct(tag, size):
    rng = np.random.default_rng([TAGS.index(tag), size])
    for meta in prompts_of(tag, rng, N_PER_TAG):
        res = score(render(scene_for(meta, rng, size), size), meta)
        assert res.strict and res.reward == 1.0, (meta["prompt"], res.details)


@pytest.mark.parametrize("size", [32, 64])
@pytest.mark.parametrize("tag", TAGS)
def test_renders_of_another_prompt_score_zero_strict(tag, size):
    """Score the render of prompt A against a prompt B of the same template that A's scene does not
    satisfy (ground truth): never strict, and the reward is below 1."""
    rng = np.random.default_rng([1000, TAGS.index(tag), size])
    n = 0
    for a, b in zip(prompts_of(tag, rng, N_PER_TAG), prompts_of(tag, rng, N_PER_TAG)):
        scene = scene_for(a, rng, size)
        if satisfies(scene, b):  # e.g. "a circle" vs a render of "a red circle": the same demand
            continue
        res = score(render(scene, size), b)
        assert not res.strict and res.reward < 1.0, (a["prompt"], b["prompt"], res.details)
        n += 1
    assert n >= N_PER_TAG // 2


@pytest.mark.parametrize("size", [32, 64])
@pytest.mark.parametrize("sigma,shift,noise,sat", [(0.7, 0, 0, 1), (1.0, 0, 0, 1), (0, 20, 0, 1), (0, 0, 8, 1),
                                                   (0, 0, 0, 0.6), (1.0, 20, 8, 1), (1.0, 20, 8, 0.6)])
def test_robust_to_vae_blur_and_colour_shift(size, sigma, shift, noise, sat):
    """Blur sigma in pixels of a 32-px image (scaled with the size), a global shift of up to 20 levels
    per channel, pixel noise of std 8, colours washed out to 60 %: at least 97 % strict over all templates."""
    rng = np.random.default_rng(7 + size)
    n, ok = 0, 0
    for _ in range(100):
        _, meta = sample_prompt(rng, "train")
        img = vae_like(render(scene_for(meta, rng, size), size), rng, sigma * size / 32, shift, noise, sat)
        ok += score(img, meta).strict
        n += 1
    assert ok / n >= 0.97


def test_detections_recover_the_scene():
    scene = Scene((ObjectSpec("circle", "red", 0.3, 0.25, 0.25), ObjectSpec("triangle", "cyan", 0.3, 0.75, 0.3),
                   ObjectSpec("diamond", "yellow", 0.3, 0.3, 0.75), ObjectSpec("square", "purple", 0.25, 0.72, 0.72)))
    dets = sorted(detect(render(scene, 32)), key=lambda d: (d.y > 0.5, d.x))
    assert [(d.shape, d.colour) for d in dets] == [("circle", "red"), ("triangle", "cyan"), ("diamond", "yellow"),
                                                   ("square", "purple")]
    for d, o in zip(dets, [scene.objects[i] for i in (0, 1, 2, 3)]):
        cy = o.y + (o.size / 6 if o.shape == "triangle" else 0.0)  # a triangle's centroid sits 1/6 below its box centre
        assert d.x == pytest.approx(o.x, abs=0.02) and d.y == pytest.approx(cy, abs=0.02)


def test_empty_image_scores_zero():
    meta = make_metadata("colors", ("red", "circle"))
    res = score(render(Scene(()), 32), meta)
    assert res.details["detections"] == [] and res.reward == 0.0 and not res.strict


def D(shape, colour, x=0.5, y=0.5):
    return Detection(shape, colour, x, y, 50.0)


def test_partial_credit_formula_by_hand():
    meta = make_metadata("color_attr", (("blue", "square"), ("yellow", "triangle")))  # N = 2
    assert evaluate([D("square", "blue"), D("triangle", "yellow")], meta).reward == 1.0
    assert evaluate([D("square", "blue")], meta).reward == 0.5                           # F=1
    assert evaluate([D("square", "blue"), D("triangle", "red")], meta).reward == 0.75    # F=1, H=1
    assert evaluate([D("square", "blue"), D("circle", "red")], meta).reward == 0.25      # F=1, E=1
    assert evaluate([D("square", "yellow"), D("triangle", "blue")], meta).reward == 0.5  # H=2 (swapped colours)
    count = make_metadata("counting", (3, "red", "circle"))                                # N = 3
    r = [evaluate([D("circle", "red")] * k, count).reward for k in range(7)]
    assert r == pytest.approx([0, 1 / 3, 2 / 3, 1, 5 / 6, 2 / 3, 1 / 2])
    assert [evaluate([D("circle", "red")] * k, count).strict for k in range(7)] == [False] * 3 + [True] + [False] * 3


def test_position_relation():
    meta = make_metadata("position", (("green", "circle"), "left of", ("red", "square")))
    left, right = D("circle", "green", 0.2, 0.5), D("square", "red", 0.8, 0.55)
    assert evaluate([left, right], meta).strict
    res = evaluate([D("circle", "green", 0.8, 0.5), D("square", "red", 0.2, 0.5)], meta)  # swapped
    assert not res.strict and res.reward == 0.5 and res.details["relation"] is False
    res = evaluate([D("circle", "green", 0.5, 0.1), D("square", "red", 0.6, 0.9)], meta)  # above, not left
    assert not res.strict and res.details["relation"] is False
    below = make_metadata("position", (("green", "circle"), "above", ("red", "square")), swap=True)  # square below circle
    assert evaluate([D("circle", "green", 0.5, 0.1), D("square", "red", 0.6, 0.9)], below).strict


@pytest.mark.parametrize("tag", TAGS)
def test_reward_rises_with_matched_objects(tag):
    """Adding a required object (in the right place) to a scene raises the reward, for every template."""
    rng = np.random.default_rng(3)
    for meta in prompts_of(tag, rng, 10):
        scene = scene_for(meta, rng, 64)
        rewards = [score(render(Scene(scene.objects[:k]), 64), meta).reward for k in range(len(scene.objects) + 1)]
        assert all(a < b for a, b in zip(rewards, rewards[1:])), (meta["prompt"], rewards)
        assert rewards[-1] == 1.0


def test_score_is_deterministic():
    rng = np.random.default_rng(11)
    _, meta = sample_prompt(rng, "train")
    img = vae_like(render(scene_for(meta, rng, 32), 32), rng, 1.0, 20, 8)
    a, b = score(img, meta), score(img.copy(), meta)
    assert a.reward == b.reward and a.strict == b.strict and a.details["detections"] == b.details["detections"]


def test_shapes_reward_registered_and_reports_strict_per_tag():
    from verl_diffusion.rewards import build_reward, get_reward_cls

    assert get_reward_cls("shapes").name == "shapes"
    rng = np.random.default_rng(0)
    metas = [make_metadata(t, compositions(t)[0]) for t in TAGS]
    images = np.stack([render(scene_for(m, rng, 32), 32) for m in metas])
    wrong = make_metadata("single_object", ("square",)) if metas[0]["include"][0]["class"] != "square" else \
        make_metadata("single_object", ("circle",))
    rows = [{"reward_model": {"ground_truth": json.dumps(m)}} for m in [wrong] + metas[1:]] + [{}]
    images = np.concatenate([images, images[:1]])
    res = build_reward({"shapes": 1.0})(images.transpose(0, 3, 1, 2), [m["prompt"] for m in metas] + ["x"], rows)
    assert res.scores.tolist() == [0.0] + [1.0] * (len(TAGS) - 1) + [0.0]
    assert res.failures["shapes"] == 1  # the row without metadata: counted and penalised
    assert res.metrics["reward/shapes/strict"] == pytest.approx((len(TAGS) - 1) / len(TAGS))
    assert res.metrics["reward/shapes/strict/single_object"] == 0.0
    assert all(res.metrics[f"reward/shapes/strict/{t}"] == 1.0 for t in TAGS[1:])
    with pytest.raises(ValueError, match="score_key"):
        build_reward({"shapes": 1.0}, options={"shapes": {"score_key": "nope"}})


def test_strict_weight_mixes_partial_credit_and_strict():
    """strict_weight w: score = (1 − w)·partial + w·strict, so a colour-swapped attribute-binding image (both shapes
    and both colours present, most of the partial credit) falls further below a correct one."""
    from verl_diffusion.rewards import build_reward

    rng = np.random.default_rng(3)
    meta = make_metadata("color_attr", (("red", "circle"), ("green", "square")))
    swapped = make_metadata("color_attr", (("green", "circle"), ("red", "square")))
    images = np.stack([render(scene_for(m, rng, 32), 32) for m in (meta, swapped)])
    partial = [score(img, meta) for img in images]
    assert partial[0].strict and partial[0].reward == 1.0
    assert not partial[1].strict and 0.0 < partial[1].reward < 1.0
    rows = [{"reward_model": {"ground_truth": json.dumps(meta)}}] * 2
    chw = images.transpose(0, 3, 1, 2)
    for w in (0.0, 0.25, 0.5, 1.0):
        res = build_reward({"shapes": 1.0}, options={"shapes": {"strict_weight": w}})(chw, [meta["prompt"]] * 2, rows)
        assert res.scores.tolist() == pytest.approx([1.0, (1 - w) * partial[1].reward])
    with pytest.raises(ValueError, match="strict_weight=1.5"):
        build_reward({"shapes": 1.0}, options={"shapes": {"strict_weight": 1.5}})


def test_a_shapeless_blob_has_no_shape_but_keeps_its_colour():
    """A bar (6:1) is no shape of the world: shape "unknown", so "a red square" gets only the colour's half
    credit, never strict."""
    from verl_diffusion.shapes.detect import SHAPE_MIN_FIT, UNKNOWN_SHAPE

    img = np.full((32, 32, 3), BACKGROUND, dtype=np.uint8)
    img[14:17, 4:22] = COLOURS["red"]
    (det,) = detect(img)
    assert det.shape == UNKNOWN_SHAPE and det.colour == "red" and det.fit < SHAPE_MIN_FIT
    res = score(img, make_metadata("colors", ("red", "square")))
    assert not res.strict and res.reward == 0.5
    # every clean render fits its shape well above the threshold
    rng = np.random.default_rng(4)
    for shape in SHAPES:
        for _ in range(10):
            scene = Scene((ObjectSpec(shape, "green", rng.uniform(0.22, 0.4), 0.5, 0.5),))
            (d,) = detect(render(scene, 32))
            assert d.shape == shape and d.fit > 0.8
