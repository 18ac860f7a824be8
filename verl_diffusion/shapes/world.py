"""The shapes world: small scenes of coloured shapes, GenEval-style prompts about them, and a fixed
split of prompt compositions into RL-train and held-out sets.

Pure Python + numpy (no torch, no network), deterministic from the caller's ``numpy.random.Generator``.

Scenes. 1 to 4 objects on a mid-grey background. An object is a shape (``SHAPES``) of a colour
(``COLOURS``) whose bounding box is ``size`` wide and high, centred at ``(x, y)``. Positions and sizes are
fractions of the image side, so one ``Scene`` renders at any resolution; ``scene_for(..., size=px)``
keeps every object at least ``MIN_OBJECT_PX`` pixels wide at that resolution. ``render`` rasterises each
shape from its signed distance with a one-pixel linear ramp (anti-aliased) and composites in order.

Prompts and metadata. The metadata dict is GenEval's (the format data_process/geneval.py checks and the
GenEval reward reads): ``{"tag", "prompt", "include": [{"class", "count", "color"?, "position"?}],
"exclude": [...]}``, with GenEval's tag names (``TAGS``):

    single_object  "a circle"                              include [{circle, 1}]
    colors         "a red circle"                          include [{circle, 1, red}]
    counting       "three red circles"                     include [{circle, 3, red}], exclude [{circle, 4, red}]
    two_object     "a circle and a square"                 include [{circle, 1}, {square, 1}]
    color_attr     "a blue square and a yellow triangle"   include [{square, 1, blue}, {triangle, 1, yellow}]
    position       "a green circle left of a red square"   include [{square, 1, red},
                                                                    {circle, 1, green, position: ["left of", 0]}]

As in GenEval, a position requirement says where include[i] is relative to include[position[1]]; the
subject of the sentence is the second include. Objects named in one prompt always have distinct shapes,
so no detected object can match two requirements. The scene satisfies a prompt exactly when it holds the
named objects in the named counts, nothing else, and the relation (``detect.satisfies``; ``detect.score`` applies
the same rule to detected objects).

Compositions and the split. A composition is what a prompt asks for, independent of word order:
single_object: the shape; colors: (colour, shape); counting: (count, colour, shape); two_object: the
unordered shape pair; color_attr: the unordered pair of (colour, shape); position: the relation read
left-to-right / top-to-bottom with its two (colour, shape) objects. ``compositions(tag)`` lists them;
``HELDOUT_FRACTION`` of each tag's list (at least ``MIN_HELDOUT``) is held out, chosen by ``SPLIT_SEED``, and never
appears as an RL train prompt (``sample_prompt(rng, "train")``); ``sample_prompt(rng, "heldout")`` draws
only held-out ones.

Pretraining distribution (``pretrain_sample``). Every composition, train and held-out alike, can appear;
what differs is how often. Tags are drawn with ``PRETRAIN_TAG_WEIGHTS`` (colors and single objects
common; counting, two_object middling; color_attr and position rare), and within counting the counts
three and four are rare (``PRETRAIN_COUNT_WEIGHTS``). The pretrained model is therefore weak exactly where
RL has headroom (many objects, attribute binding, relations), as SD3.5 is on GenEval.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

# Shape names (the GenEval "class"). Four convex shapes a bounding-box template fit separates at 7 px:
# in its own box a circle fills pi/4, a square 1, a triangle and a diamond 1/2 each (IoU 1/2 between them).
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
PLURALS = {s: s + "s" for s in SHAPES}

# Colour name -> RGB. Chosen so that no colour lies near the background-to-colour line of another
# (the detector un-mixes anti-aliased and blurred pixels along that line): the smallest distance of a
# colour to another's line, on the same side of the background, is above 90 (of 441).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "purple": (160, 50, 200),
    "cyan": (40, 200, 210),
}
BACKGROUND: tuple[int, int, int] = (128, 128, 128)

# GenEval's tag names, in the order prompts are listed.
TAGS: tuple[str, ...] = ("single_object", "colors", "counting", "two_object", "color_attr", "position")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
COUNT_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
COUNTS: tuple[int, ...] = (2, 3, 4)

DEFAULT_IMAGE_SIZE = 32
MIN_OBJECT_PX = 7.0
# Object box side as a fraction of the image: scenes of 1-2 objects, and of 3-4 objects.
SIZE_RANGE_FEW = (0.25, 0.40)
SIZE_RANGE_MANY = (0.22, 0.30)
# Empty space kept between object boxes, as a fraction of the image side (and at least 2 px).
GAP_FRACTION = 0.06
# In a position scene the main displacement is at least this many times the other one.
RELATION_DOMINANCE = 2.0

SPLIT_SEED = 0
HELDOUT_FRACTION = 0.25
# A tag holds out at least this many compositions, so that a held-out accuracy generalises over more than one
# prompt (single_object has four compositions: two are RL-trained, two held out).
MIN_HELDOUT = 2
PRETRAIN_TAG_WEIGHTS: dict[str, float] = {
    "single_object": 0.15, "colors": 0.30, "counting": 0.20, "two_object": 0.20, "color_attr": 0.08, "position": 0.07,
}
PRETRAIN_COUNT_WEIGHTS: dict[int, float] = {2: 1.0, 3: 0.2, 4: 0.1}


@dataclass(frozen=True)
class ObjectSpec:
    """One object: ``shape`` in SHAPES, ``colour`` in COLOURS; ``size`` is the side of its bounding box
    and ``(x, y)`` its centre, all as fractions of the image side (y grows downwards)."""

    shape: str
    colour: str
    size: float
    x: float
    y: float


@dataclass(frozen=True)
class Scene:
    objects: tuple[ObjectSpec, ...]
    background: tuple[int, int, int] = BACKGROUND


# ---------------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------------
def shape_signed_distance(shape: str, dx: np.ndarray, dy: np.ndarray, half_w: float, half_h: float) -> np.ndarray:
    """Signed distance in pixels (negative inside) of ``shape`` filling the box of half-sides
    ``half_w, half_h`` centred at the origin, at offsets ``dx, dy`` (pixels, y down). Exact inside and
    along edges, approximate beyond corners, which is all a one-pixel anti-aliasing ramp needs."""
    u, v = dx / half_w, dy / half_h
    scale = min(half_w, half_h)
    if shape == "circle":
        return (np.sqrt(u * u + v * v) - 1.0) * scale
    if shape == "square":
        return (np.maximum(np.abs(u), np.abs(v)) - 1.0) * scale
    if shape == "diamond":
        return (np.abs(u) + np.abs(v) - 1.0) * scale / math.sqrt(2.0)
    if shape == "triangle":  # apex up: (0, -1), (-1, 1), (1, 1)
        sides = (2.0 * np.abs(u) - (v + 1.0)) / math.sqrt(5.0)
        return np.maximum(sides, v - 1.0) * scale
    raise ValueError(f"shape={shape!r} is unknown; choose one of {list(SHAPES)}")


def shape_coverage(shape: str, cx: float, cy: float, w: float, h: float, size: int) -> np.ndarray:
    """Anti-aliased coverage in [0, 1], [size, size] float32, of ``shape`` in the ``w x h`` pixel box
    centred at pixel coordinates ``(cx, cy)`` (pixel i covers [i, i+1))."""
    grid = np.arange(size, dtype=np.float32) + 0.5
    sd = shape_signed_distance(shape, grid[None, :] - cx, grid[:, None] - cy, w / 2.0, h / 2.0)
    return np.clip(0.5 - sd, 0.0, 1.0).astype(np.float32)


def render(scene: Scene, size: int = DEFAULT_IMAGE_SIZE) -> np.ndarray:
    """The scene as a uint8 [size, size, 3] RGB image; objects are composited in order."""
    img = np.empty((size, size, 3), dtype=np.float32)
    img[:] = np.asarray(scene.background, dtype=np.float32)
    for obj in scene.objects:
        if obj.colour not in COLOURS:
            raise ValueError(f"colour={obj.colour!r} is unknown; choose one of {list(COLOURS)}")
        side = obj.size * size
        cov = shape_coverage(obj.shape, obj.x * size, obj.y * size, side, side, size)[..., None]
        img = img * (1.0 - cov) + np.asarray(COLOURS[obj.colour], dtype=np.float32) * cov
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


# ---------------------------------------------------------------------------------------------------
# prompts, metadata and compositions
# ---------------------------------------------------------------------------------------------------
def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _noun(colour: str | None, shape: str, count: int = 1) -> str:
    words = ([colour] if colour else []) + [PLURALS[shape] if count > 1 else shape]
    lead = COUNT_WORDS[count] if count > 1 else _article(words[0])
    return " ".join([lead] + words)


def _req(shape: str, count: int = 1, colour: str | None = None) -> dict:
    r = {"class": shape, "count": count}
    if colour is not None:
        r["color"] = colour
    return r


def make_metadata(tag: str, composition: tuple, *, swap: bool = False) -> dict:
    """Prompt text and GenEval metadata of one composition (see ``compositions``). ``swap`` chooses the
    other wording of the same composition (object order; "right of"/"below" instead of "left of"/"above")."""
    if tag == "single_object":
        (shape,) = composition
        prompt, include = _noun(None, shape), [_req(shape)]
        exclude: list[dict] = []
    elif tag == "colors":
        colour, shape = composition
        prompt, include, exclude = _noun(colour, shape), [_req(shape, 1, colour)], []
    elif tag == "counting":
        count, colour, shape = composition
        prompt = _noun(colour, shape, count)
        include, exclude = [_req(shape, count, colour)], [_req(shape, count + 1, colour)]
    elif tag == "two_object":
        a, b = composition[::-1] if swap else composition
        prompt, include, exclude = f"{_noun(None, a)} and {_noun(None, b)}", [_req(a), _req(b)], []
    elif tag == "color_attr":
        (ca, sa), (cb, sb) = composition[::-1] if swap else composition
        prompt = f"{_noun(ca, sa)} and {_noun(cb, sb)}"
        include, exclude = [_req(sa, 1, ca), _req(sb, 1, cb)], []
    elif tag == "position":
        # canonical: (first, relation, second) with relation "left of" / "above": first is left of / above second
        first, relation, second = composition
        if swap:
            first, second = second, first
            relation = {"left of": "right of", "above": "below"}[relation]
        (cs, ss), (co, so) = first, second
        prompt = f"{_noun(cs, ss)} {relation} {_noun(co, so)}"
        subject = _req(ss, 1, cs)
        subject["position"] = [relation, 0]
        include, exclude = [_req(so, 1, co), subject], []
    else:
        raise ValueError(f"tag={tag!r} is unknown; choose one of {list(TAGS)}")
    return {"tag": tag, "include": include, "exclude": exclude, "prompt": prompt}


@lru_cache(maxsize=None)
def compositions(tag: str) -> tuple[tuple, ...]:
    """Every composition of ``tag`` in a fixed order (see the module docstring)."""
    cs = [(c, s) for c in COLOURS for s in SHAPES]
    if tag == "single_object":
        return tuple((s,) for s in SHAPES)
    if tag == "colors":
        return tuple(cs)
    if tag == "counting":
        return tuple((n, c, s) for n in COUNTS for c, s in cs)
    if tag == "two_object":
        return tuple((a, b) for i, a in enumerate(SHAPES) for b in SHAPES[i + 1:])
    if tag == "color_attr":
        return tuple((p, q) for i, p in enumerate(cs) for q in cs[i + 1:] if p[0] != q[0] and p[1] != q[1])
    if tag == "position":
        return tuple((p, rel, q) for p in cs for rel in ("left of", "above") for q in cs if p[1] != q[1])
    raise ValueError(f"tag={tag!r} is unknown; choose one of {list(TAGS)}")


@lru_cache(maxsize=None)
def split_compositions(tag: str, split: str) -> tuple[tuple, ...]:
    """The compositions of ``tag`` in ``split`` ("train" or "heldout"): a fixed seeded choice of
    ``HELDOUT_FRACTION`` of them (at least ``MIN_HELDOUT``) is held out."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split={split!r} is unknown; choose 'train' or 'heldout'")
    allc = compositions(tag)
    n_held = min(len(allc) - 1, max(MIN_HELDOUT, round(HELDOUT_FRACTION * len(allc))))
    held = set(random.Random(f"{SPLIT_SEED}/{tag}").sample(range(len(allc)), n_held))
    return tuple(c for i, c in enumerate(allc) if (i in held) == (split == "heldout"))


def composition_of(metadata: Mapping) -> tuple[str, tuple]:
    """(tag, composition) of a metadata dict made by ``make_metadata`` (inverse up to wording)."""
    tag, inc = metadata["tag"], metadata["include"]
    if tag == "single_object":
        return tag, (inc[0]["class"],)
    if tag == "colors":
        return tag, (inc[0]["color"], inc[0]["class"])
    if tag == "counting":
        return tag, (inc[0]["count"], inc[0]["color"], inc[0]["class"])
    if tag == "two_object":
        a, b = inc[0]["class"], inc[1]["class"]
        return tag, (a, b) if SHAPES.index(a) < SHAPES.index(b) else (b, a)
    cs = [(c, s) for c in COLOURS for s in SHAPES]
    if tag == "color_attr":
        p, q = (inc[0]["color"], inc[0]["class"]), (inc[1]["color"], inc[1]["class"])
        return tag, (p, q) if cs.index(p) < cs.index(q) else (q, p)
    if tag == "position":
        ref, sub = (inc[0]["color"], inc[0]["class"]), (inc[1]["color"], inc[1]["class"])
        rel = inc[1]["position"][0]
        if rel in ("left of", "above"):
            return tag, (sub, rel, ref)
        return tag, (ref, {"right of": "left of", "below": "above"}[rel], sub)
    raise ValueError(f"tag={tag!r} is unknown; choose one of {list(TAGS)}")


def split_of(metadata: Mapping) -> str:
    """"train" or "heldout": which split the prompt's composition is in."""
    tag, comp = composition_of(metadata)
    return "heldout" if comp in split_compositions(tag, "heldout") else "train"


def sample_prompt(rng: np.random.Generator, split: str = "train", tags: Sequence[str] = TAGS) -> tuple[str, dict]:
    """(prompt, metadata) of a composition of ``split``: a tag uniformly from ``tags``, then a composition
    of that tag and a wording uniformly."""
    tag = tags[int(rng.integers(len(tags)))]
    comps = split_compositions(tag, split)
    meta = make_metadata(tag, comps[int(rng.integers(len(comps)))], swap=bool(rng.integers(2)))
    return meta["prompt"], meta


def pretrain_sample(
    rng: np.random.Generator,
    tag_weights: Mapping[str, float] = PRETRAIN_TAG_WEIGHTS,
    count_weights: Mapping[int, float] = PRETRAIN_COUNT_WEIGHTS,
) -> tuple[str, dict]:
    """(prompt, metadata) from the pretraining distribution: any composition of either split, tags
    weighted by ``tag_weights`` and counting's counts by ``count_weights`` (rare ones small)."""
    tags = list(tag_weights)
    p = np.asarray([tag_weights[t] for t in tags], dtype=np.float64)
    tag = tags[int(rng.choice(len(tags), p=p / p.sum()))]
    comps = compositions(tag)
    if tag == "counting":
        w = np.asarray([count_weights.get(c[0], 0.0) for c in comps], dtype=np.float64)
        comp = comps[int(rng.choice(len(comps), p=w / w.sum()))]
    else:
        comp = comps[int(rng.integers(len(comps)))]
    meta = make_metadata(tag, comp, swap=bool(rng.integers(2)))
    return meta["prompt"], meta


def heldout_prompts(n_per_tag: int, seed: int = 0, split: str = "heldout",
                    tags: Sequence[str] = TAGS) -> list[tuple[str, dict]]:
    """A fixed, tag-balanced list of ``n_per_tag`` prompts per tag of ``tags`` from ``split`` (cycling through
    the tag's compositions in a seeded order, so every composition appears before any repeats; a tag's prompts
    do not depend on which other tags are listed)."""
    out = []
    for tag in tags:
        r = random.Random(f"{seed}/{tag}")
        comps = list(split_compositions(tag, split))
        r.shuffle(comps)
        for i in range(n_per_tag):
            meta = make_metadata(tag, comps[i % len(comps)], swap=bool(r.getrandbits(1)))
            out.append((meta["prompt"], meta))
    return out


def balanced_prompts(min_per_tag: int, seed: int = 0, split: str = "heldout",
                     tags: Sequence[str] = TAGS) -> list[tuple[str, dict]]:
    """A validation set in which every composition of ``split`` counts: for each tag of ``tags``, each of its
    compositions ``ceil(min_per_tag / n)`` times (n compositions, so a tag has at least ``min_per_tag`` prompts and
    every composition the same number), the wording drawn per prompt from ``seed``. Tags with many compositions
    (position) get one prompt per composition and so more than ``min_per_tag``."""
    out = []
    for tag in tags:
        r = random.Random(f"{seed}/{tag}/balanced")
        comps = split_compositions(tag, split)
        reps = max(1, math.ceil(min_per_tag / len(comps)))
        for k in range(reps):
            for comp in comps:
                meta = make_metadata(tag, comp, swap=bool(r.getrandbits(1)))
                out.append((meta["prompt"], meta))
    return out


# ---------------------------------------------------------------------------------------------------
# scenes that satisfy a prompt
# ---------------------------------------------------------------------------------------------------
def relation_holds(relation: str, subject_xy: tuple[float, float], reference_xy: tuple[float, float]) -> bool:
    """Whether the subject is ``relation`` the reference: the displacement along the relation's axis
    has the right sign and is larger than the displacement across it (y grows downwards)."""
    dx, dy = subject_xy[0] - reference_xy[0], subject_xy[1] - reference_xy[1]
    if relation == "left of":
        return -dx > abs(dy)
    if relation == "right of":
        return dx > abs(dy)
    if relation == "above":
        return -dy > abs(dx)
    if relation == "below":
        return dy > abs(dx)
    raise ValueError(f"relation={relation!r} is unknown; choose one of {list(RELATIONS)}")


def _required_objects(metadata: Mapping, rng: np.random.Generator) -> list[tuple[str, str]]:
    objs = []
    for req in metadata["include"]:
        for _ in range(int(req["count"])):
            colour = req.get("color") or list(COLOURS)[int(rng.integers(len(COLOURS)))]
            objs.append((req["class"], colour))
    return objs


def scene_for(metadata: Mapping, rng: np.random.Generator, size: int = DEFAULT_IMAGE_SIZE, max_tries: int = 200) -> Scene:
    """A random scene that satisfies ``metadata``: the required objects (a random colour where none is
    named), random sizes and positions, boxes at least ``GAP_FRACTION`` apart, every object at least
    ``MIN_OBJECT_PX`` at ``size`` pixels, and a position relation held with margin ``RELATION_DOMINANCE``."""
    objs = _required_objects(metadata, rng)
    relation = None
    for i, req in enumerate(metadata["include"]):
        if "position" in req:
            relation = (req["position"][0], i, int(req["position"][1]))  # subject include i, reference include j
    lo, hi = SIZE_RANGE_FEW if len(objs) <= 2 else SIZE_RANGE_MANY
    lo = max(lo, MIN_OBJECT_PX / size)
    hi = max(hi, lo)
    gap = max(GAP_FRACTION, 2.0 / size)
    n = len(objs)
    for attempt in range(max_tries):
        shrink = 1.0 - 0.3 * attempt / max_tries  # give crowded scenes room if early tries fail
        sizes = rng.uniform(lo, max(lo, hi * shrink), n)
        half = sizes / 2.0
        xs, ys = np.zeros(n), np.zeros(n)
        ok = True
        for a in range(n):  # place one object at a time, each clear of those placed before
            for _ in range(30):
                xs[a] = rng.uniform(half[a] + 1.0 / size, 1.0 - half[a] - 1.0 / size)
                ys[a] = rng.uniform(half[a] + 1.0 / size, 1.0 - half[a] - 1.0 / size)
                need = half[:a] + half[a] + gap
                if not np.any((np.abs(xs[:a] - xs[a]) < need) & (np.abs(ys[:a] - ys[a]) < need)):
                    break
            else:
                ok = False
                break
        if ok and relation is not None:
            rel, i, j = relation  # with one object per include, object index = include index
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            along, across = (dx, dy) if rel in ("left of", "right of") else (dy, dx)
            sign = -1.0 if rel in ("left of", "above") else 1.0
            ok = sign * along > RELATION_DOMINANCE * abs(across)
        if ok:
            order = rng.permutation(n)
            return Scene(tuple(ObjectSpec(objs[k][0], objs[k][1], float(sizes[k]), float(xs[k]), float(ys[k])) for k in order))
    raise RuntimeError(f"scene_for: no layout found for {metadata.get('prompt')!r} at {size} px in {max_tries} tries")
