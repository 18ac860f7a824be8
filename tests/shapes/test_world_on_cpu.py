"""The shapes world: rendering, prompts, metadata, the composition split and scene sampling (issue 9)."""

import json

import numpy as np
import pytest

from verl_diffusion.shapes import world
from verl_diffusion.shapes.detect import satisfies
from verl_diffusion.shapes.world import (
    COLOURS, SHAPES, TAGS, ObjectSpec, Scene, compositions, heldout_prompts, make_metadata, pretrain_sample, render,
    sample_prompt, scene_for, split_compositions, split_of,
)


def test_palette_and_shapes_sizes():
    assert len(SHAPES) >= 4 and {"circle", "square", "triangle"} <= set(SHAPES)
    assert len(COLOURS) >= 6


def test_render_is_deterministic_and_draws_the_colour():
    scene = Scene((ObjectSpec("square", "red", 0.5, 0.5, 0.5),))
    a, b = render(scene, 32), render(scene, 32)
    assert a.dtype == np.uint8 and a.shape == (32, 32, 3) and np.array_equal(a, b)
    assert tuple(a[16, 16]) == COLOURS["red"] and tuple(a[1, 1]) == world.BACKGROUND
    # a 16-px square covers 16 * 16 pixels exactly (its edges fall on pixel boundaries)
    assert int((a == COLOURS["red"]).all(-1).sum()) == 256


@pytest.mark.parametrize("shape,fill", [("circle", np.pi / 4), ("square", 1.0), ("triangle", 0.5), ("diamond", 0.5)])
def test_rendered_area_matches_the_shape(shape, fill):
    img = render(Scene((ObjectSpec(shape, "blue", 0.5, 0.5, 0.5),)), 128).astype(np.float64)
    bg, col = np.asarray(world.BACKGROUND, float), np.asarray(COLOURS["blue"], float)
    coverage = ((img - bg) @ (col - bg) / ((col - bg) @ (col - bg))).sum()
    assert coverage == pytest.approx(fill * 64 * 64, rel=0.01)


@pytest.mark.parametrize("tag", TAGS)
def test_split_is_fixed_disjoint_and_covers_every_composition(tag):
    train, held = split_compositions(tag, "train"), split_compositions(tag, "heldout")
    assert set(train).isdisjoint(held) and set(train) | set(held) == set(compositions(tag))
    assert len(held) >= 1 and len(train) >= 1
    assert len(held) == max(world.MIN_HELDOUT, round(world.HELDOUT_FRACTION * len(compositions(tag))))
    assert len(held) >= 2   # a held-out accuracy is never one prompt


def test_train_prompts_never_use_heldout_compositions():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        _, meta = sample_prompt(rng, "train")
        assert split_of(meta) == "train"
        _, meta = sample_prompt(rng, "heldout")
        assert split_of(meta) == "heldout"


def test_prompt_texts_and_metadata_are_geneval_format():
    assert make_metadata("counting", (3, "red", "circle"))["prompt"] == "three red circles"
    m = make_metadata("position", (("green", "circle"), "left of", ("red", "square")))
    assert m["prompt"] == "a green circle left of a red square"
    assert m["include"] == [{"class": "square", "count": 1, "color": "red"},
                            {"class": "circle", "count": 1, "color": "green", "position": ["left of", 0]}]
    swapped = make_metadata("position", (("green", "circle"), "left of", ("red", "square")), swap=True)
    assert swapped["prompt"] == "a red square right of a green circle"
    assert make_metadata("color_attr", (("blue", "square"), ("yellow", "triangle")))["prompt"] == \
        "a blue square and a yellow triangle"
    assert make_metadata("single_object", ("circle",))["prompt"] == "a circle"
    # data_process/geneval.py's checker accepts every template's metadata
    import importlib.util, pathlib
    spec = importlib.util.spec_from_file_location(
        "geneval_dp", pathlib.Path(__file__).parents[2] / "data_process" / "geneval.py")
    geneval_dp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(geneval_dp)
    for tag in TAGS:
        for comp in compositions(tag)[:20]:
            for swap in (False, True):
                meta = json.loads(json.dumps(make_metadata(tag, comp, swap=swap)))
                geneval_dp.check(meta, "x", 1)
                assert world.composition_of(meta) == (tag, comp)


@pytest.mark.parametrize("size", [32, 64])
def test_scene_for_satisfies_its_prompt_with_room(size):
    rng = np.random.default_rng(size)
    for i in range(300):
        _, meta = pretrain_sample(rng) if i % 2 else sample_prompt(rng, "heldout")
        scene = scene_for(meta, rng, size)
        assert satisfies(scene, meta)
        assert len(scene.objects) == sum(r["count"] for r in meta["include"])
        for o in scene.objects:
            assert o.size * size >= world.MIN_OBJECT_PX - 1e-9
            assert o.size / 2 <= o.x <= 1 - o.size / 2 and o.size / 2 <= o.y <= 1 - o.size / 2
        objs = scene.objects
        for a in range(len(objs)):
            for b in range(a + 1, len(objs)):
                need = (objs[a].size + objs[b].size) / 2
                assert abs(objs[a].x - objs[b].x) >= need or abs(objs[a].y - objs[b].y) >= need


def test_scene_for_is_deterministic_and_varied():
    _, meta = sample_prompt(np.random.default_rng(1), "train")
    s1 = scene_for(meta, np.random.default_rng(5))
    assert s1 == scene_for(meta, np.random.default_rng(5))
    others = {scene_for(meta, np.random.default_rng(k)) for k in range(20)}
    assert len(others) == 20


def test_pretraining_distribution_makes_rare_compositions_rare():
    rng = np.random.default_rng(0)
    tags, counts = [], []
    for _ in range(4000):
        _, meta = pretrain_sample(rng)
        tags.append(meta["tag"])
        if meta["tag"] == "counting":
            counts.append(meta["include"][0]["count"])
    frac = {t: tags.count(t) / len(tags) for t in TAGS}
    w = world.PRETRAIN_TAG_WEIGHTS
    for t in TAGS:
        assert frac[t] == pytest.approx(w[t] / sum(w.values()), abs=0.025)
    assert frac["position"] < frac["colors"] / 3 and frac["color_attr"] < frac["colors"] / 3
    assert counts.count(2) > 3 * (counts.count(3) + counts.count(4)) > 0


def test_heldout_prompts_are_fixed_balanced_and_heldout():
    a, b = heldout_prompts(8, seed=3), heldout_prompts(8, seed=3)
    assert a == b and len(a) == 8 * len(TAGS)
    assert all(split_of(m) == "heldout" for _, m in a)
    assert {m["tag"] for _, m in a} == set(TAGS)


@pytest.mark.parametrize("tag", TAGS)
def test_balanced_prompts_weight_every_heldout_composition_equally(tag):
    """Every held-out composition of a tag appears, each the same number of times, at least min_per_tag prompts."""
    from collections import Counter

    from verl_diffusion.shapes.world import composition_of

    prompts = world.balanced_prompts(64, seed=0, tags=(tag,))
    assert prompts == world.balanced_prompts(64, seed=0, tags=(tag,))
    counts = Counter(composition_of(m)[1] for _, m in prompts)
    held = split_compositions(tag, "heldout")
    assert set(counts) == set(held) and len(set(counts.values())) == 1
    assert len(prompts) >= 64 and len(prompts) == len(held) * -(-64 // len(held))
    assert all(split_of(m) == "heldout" and m["tag"] == tag for _, m in prompts)


def test_shapes_package_needs_numpy_only():
    """The world and its detector import neither torch nor verl (the pretraining data loader and reward
    processes stay light)."""
    import subprocess
    import sys

    code = ("import sys, verl_diffusion.shapes\n"
            "print(','.join(sorted({n.split('.')[0] for n in sys.modules})))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert not {"torch", "verl", "ray", "diffusers", "PIL"} & set(res.stdout.strip().split(","))
