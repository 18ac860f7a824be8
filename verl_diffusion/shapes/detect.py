"""Detection and scoring in the shapes world: what a generated image shows, and how well it
matches a prompt's GenEval metadata.

Detection (``detect``), pure numpy:

1. Background: the image's per-channel median (most pixels are background), or ``BACKGROUND`` when the
   median is more than ``BACKGROUND_TOLERANCE`` from it (an image mostly covered by something).
2. Colour of each pixel by un-mixing: an anti-aliased or blurred edge pixel is ``bg + a * (colour - bg)``,
   so for each palette colour the pixel's offset from the background is projected on ``colour - bg``:
   ``a`` is the mixing weight, ``residual`` the distance off that line. A pixel belongs to the colour with
   the smallest residual among those with ``ALPHA_RANGE[0] <= a <= ALPHA_RANGE[1]`` and
   ``residual <= MAX_RESIDUAL``; other pixels are background. This tolerates blur (mixes with the
   background stay on the line) and a colour shift or noise of a few tens of levels (the residual).
3. Connected components (8-neighbour) of each colour are blobs. A blob whose 90th-percentile weight
   (its peak) is below ``PEAK_MIN`` is noise; otherwise its pixels at half its peak or more, split again
   into components, are objects (so a washed-out colour, as a small VAE makes, is judged against its own
   saturation, and a faint bridge between two objects does not join them). Objects smaller than
   ``MIN_AREA_FRACTION`` of the image are dropped.
4. Shape: the object's coverage (weights over its peak, on its pixels and a two-pixel rim) is compared
   with each shape of ``SHAPES`` rasterised by the renderer's own geometry, sized from the coverage's sum
   and placed at its centroid, at several blur levels (``classify_shape``); the best soft IoU wins, unless
   it is below ``SHAPE_MIN_FIT``: then the object is a shapeless blob (shape ``"unknown"``).

Scoring (``evaluate`` / ``score``). Requirements are the metadata's ``include`` entries (class, count,
optional colour, optional position); objects of one prompt have distinct shapes, so an object matches at
most one requirement. With N required objects:

- full matches F: objects of the required shape and colour (if named), up to each requirement's count;
- half matches H: of the objects left, one of the right shape in the wrong colour, or (for a requirement
  that names a colour) the right colour in the wrong shape, for each still unfilled slot;
- extras E: objects neither matched.

    objects  = clip((F + H/2 - E/2) / N, 0, 1)
    reward   = objects                                   (no relation)
             = (objects + relation) / 2                  (position: relation = 1 if both objects are
                                                          fully matched and the relation holds, else 0)
    strict   = F == N and E == 0 and (relation holds, if any)

so a missing object costs 1/N, a wrong attribute 1/(2N), a surplus object 1/(2N) (a count off by k costs
k/N or k/(2N)), and ``reward == 1`` exactly when ``strict`` holds (GenEval's all-correct metric; exact
counts and no other objects, which also implements GenEval's count ``exclude``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from verl_diffusion.shapes.world import BACKGROUND, COLOURS, SHAPES, Scene, relation_holds, shape_signed_distance

ALPHA_RANGE = (0.25, 1.8)
# A colour blob counts if its 90th-percentile mixing weight reaches this (fainter blobs are noise); its
# object pixels are those at half that peak or more.
PEAK_MIN = 0.45
MAX_RESIDUAL = 55.0
BACKGROUND_TOLERANCE = 60.0
# An object whose best shape fits worse than this (soft IoU) is a blob of no shape: its shape is "unknown",
# so it can match a requirement only by colour (half credit). Clean renders fit at 0.85-1.0, renders blurred
# by 1.4 px with colour noise at 0.6 or more; a bar or a smear fits below 0.5.
SHAPE_MIN_FIT = 0.5
UNKNOWN_SHAPE = "unknown"
# Components below this fraction of the image area are noise (a 7-px triangle at 32 px covers 2.4 %).
MIN_AREA_FRACTION = 0.008

_PALETTE_NAMES = tuple(COLOURS)
_PALETTE = np.asarray([COLOURS[c] for c in _PALETTE_NAMES], dtype=np.float32)  # [K, 3]


@dataclass(frozen=True)
class Detection:
    """A detected object: shape and colour names, centroid (x, y) as fractions of the image side,
    area in pixels, and the IoU of the best shape template (1 = a perfect fit)."""

    shape: str
    colour: str
    x: float
    y: float
    area: float
    fit: float = 1.0


@dataclass
class ScoreResult:
    """``reward`` in [0, 1] (partial credit), ``strict`` (all correct), ``details`` (counts F, H, E, N,
    the relation outcome, the detections)."""

    reward: float
    strict: bool
    details: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------
# detection
# ---------------------------------------------------------------------------------------------------
def estimate_background(img: np.ndarray) -> np.ndarray:
    med = np.median(img.reshape(-1, 3), axis=0)
    bg = np.asarray(BACKGROUND, dtype=np.float32)
    return med.astype(np.float32) if np.linalg.norm(med - bg) <= BACKGROUND_TOLERANCE else bg


def colour_labels(img: np.ndarray, bg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[H, W] int: palette index of each pixel (see the module docstring), -1 for background; and
    [H, W, K] float: each pixel's mixing weight of each palette colour, 0 where the residual is too large."""
    d = img.reshape(-1, 3) - bg  # [P, 3]
    dirs = _PALETTE - bg  # [K, 3]
    alpha = d @ dirs.T / np.maximum((dirs * dirs).sum(1), 1e-6)  # [P, K]
    resid = np.linalg.norm(d[:, None, :] - alpha[..., None] * dirs[None], axis=-1)  # [P, K]
    ok = (alpha >= ALPHA_RANGE[0]) & (alpha <= ALPHA_RANGE[1]) & (resid <= MAX_RESIDUAL)
    resid_all = resid
    resid = np.where(ok, resid, np.inf)
    lab = resid.argmin(1)
    lab[~ok.any(1)] = -1
    mix = np.where((resid_all <= MAX_RESIDUAL) & (alpha > 0), np.clip(alpha, 0.0, 1.0), 0.0)
    return lab.reshape(img.shape[:2]), mix.reshape(*img.shape[:2], -1)


def _dilate(mask: np.ndarray) -> np.ndarray:
    h, w = mask.shape
    p = np.pad(mask, 1)
    out = mask.copy()
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            out |= p[1 + dy:1 + dy + h, 1 + dx:1 + dx + w]
    return out


def connected_components(labels: np.ndarray) -> np.ndarray:
    """[H, W] int component ids (8-neighbour, same label; -1 stays -1): each pixel takes the largest
    id among its same-label neighbours until nothing changes."""
    h, w = labels.shape
    ids = np.where(labels >= 0, np.arange(h * w).reshape(h, w), -1)
    pad_lab = np.pad(labels, 1, constant_values=-1)
    shifts = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx]
    same = [pad_lab[1 + dy:1 + dy + h, 1 + dx:1 + dx + w] == labels for dy, dx in shifts]
    fg = labels >= 0
    while True:
        pad_ids = np.pad(ids, 1, constant_values=-1)
        new = ids.copy()
        for (dy, dx), s in zip(shifts, same):
            nb = pad_ids[1 + dy:1 + dy + h, 1 + dx:1 + dx + w]
            new = np.where(s & fg, np.maximum(new, nb), new)
        if np.array_equal(new, ids):
            return ids
        ids = new


# Area of each shape as a fraction of its bounding box, and its centroid's offset below the box centre
# (fraction of the side): the template fit places and sizes each candidate from the component's moments.
SHAPE_FILL = {"circle": np.pi / 4.0, "square": 1.0, "triangle": 0.5, "diamond": 0.5}
SHAPE_CENTROID_DY = {"circle": 0.0, "square": 0.0, "triangle": 1.0 / 6.0, "diamond": 0.0}


# Blur levels (Gaussian sigma, pixels) at which each template is compared: a small VAE blurs edges.
TEMPLATE_BLURS = (0.0, 0.7, 1.0, 1.4, 2.0)


def classify_shape(alpha: np.ndarray, region: np.ndarray | None = None) -> tuple[str, float]:
    """(shape, soft IoU) of the shape template that best fits one object's coverage map ``alpha``
    [H, W] in [0, 1]: each shape is sized from the total coverage (its area, which blur preserves) and
    placed at the coverage's centroid, rasterised like ``render`` does, blurred by each of
    ``TEMPLATE_BLURS``, and compared by sum(min) / sum(max) over ``region`` (default: everywhere)."""
    area = float(alpha.sum())
    h, w = alpha.shape
    if region is None:
        region = np.ones_like(alpha, dtype=bool)
    grid_y, grid_x = np.mgrid[0:h, 0:w].astype(np.float32) + 0.5
    cx, cy = float((alpha * grid_x).sum() / area), float((alpha * grid_y).sum() / area)
    best, best_iou = SHAPES[0], -1.0
    for shape in SHAPES:
        side = float(np.sqrt(area / SHAPE_FILL[shape]))
        t0 = _coverage_rect(shape, cx, cy - SHAPE_CENTROID_DY[shape] * side, side, h, w)
        for sigma in TEMPLATE_BLURS:
            t = np.where(region, _blur(t0, sigma), 0.0)
            iou = float(np.minimum(t, alpha).sum() / max(np.maximum(t, alpha).sum(), 1e-6))
            if iou > best_iou:
                best, best_iou = shape, iou
    return best, best_iou


@lru_cache(maxsize=256)
def _blur_matrix(n: int, sigma: float) -> np.ndarray:
    x = np.arange(n, dtype=np.float32)
    k = np.exp(-((x[:, None] - x[None, :]) ** 2) / (2.0 * sigma * sigma))
    return (k / k.sum(1, keepdims=True)).astype(np.float32)


def _blur(a: np.ndarray, sigma: float) -> np.ndarray:
    if sigma <= 0:
        return a
    return _blur_matrix(a.shape[0], sigma) @ a @ _blur_matrix(a.shape[1], sigma).T


def _coverage_rect(shape: str, cx: float, cy: float, side: float, h: int, w: int) -> np.ndarray:
    gy = np.arange(h, dtype=np.float32)[:, None] + 0.5
    gx = np.arange(w, dtype=np.float32)[None, :] + 0.5
    sd = shape_signed_distance(shape, gx - cx, gy - cy, side / 2.0, side / 2.0)
    return np.clip(0.5 - sd, 0.0, 1.0)


def detect(image: np.ndarray) -> list[Detection]:
    """Objects in a uint8 [H, W, 3] RGB image (see the module docstring)."""
    img = np.asarray(image, dtype=np.float32)
    if img.ndim != 3 or img.shape[-1] != 3:
        raise ValueError(f"image must be [H, W, 3] RGB, got shape {img.shape}")
    h, w = img.shape[:2]
    labels, mix = colour_labels(img, estimate_background(img))
    ids = connected_components(labels)
    min_area = MIN_AREA_FRACTION * h * w
    out = []
    uniq, counts = np.unique(ids[ids >= 0], return_counts=True)
    for cid in uniq[counts >= min_area]:
        blob_full = ids == cid
        ys, xs = np.nonzero(blob_full)
        # work in a window around the blob (its rim included)
        y0, y1 = max(ys.min() - 4, 0), min(ys.max() + 5, h)
        x0, x1 = max(xs.min() - 4, 0), min(xs.max() + 5, w)
        blob, lab = blob_full[y0:y1, x0:x1], labels[y0:y1, x0:x1]
        k = int(labels[ys[0], xs[0]])
        a = mix[y0:y1, x0:x1, k]
        # the blob's own saturation: a washed-out object (a VAE's colour shift) is judged against its peak
        peak = float(np.percentile(a[blob], 90))
        if peak < PEAK_MIN:
            continue
        core = blob & (a >= 0.5 * peak)
        sub = connected_components(np.where(core, 0, -1))  # a faint bridge between two objects splits here
        sids, scounts = np.unique(sub[sub >= 0], return_counts=True)
        for sid in sids[scounts >= min_area]:
            m = sub == sid
            my, mx = np.nonzero(m)
            # the object's coverage: its pixels and their blurred rim (two-pixel ring), weights over the peak
            region = _dilate(_dilate(m)) & (~core | m) & ((lab < 0) | blob)
            alpha = np.where(region, np.clip(a / peak, 0.0, 1.0), 0.0).astype(np.float32)
            shape, fit = classify_shape(alpha, region)
            if fit < SHAPE_MIN_FIT:
                shape = UNKNOWN_SHAPE
            out.append(Detection(shape, _PALETTE_NAMES[k], float((mx.mean() + x0 + 0.5) / w),
                                 float((my.mean() + y0 + 0.5) / h), float(m.sum()), fit))
    return out


# ---------------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------------
def evaluate(detections: Sequence[Detection], metadata: Mapping) -> ScoreResult:
    """Partial credit and strict correctness of detected objects against GenEval metadata (module docstring)."""
    reqs = list(metadata["include"])
    need = [int(r["count"]) for r in reqs]
    n_req = sum(need)
    free = list(range(len(detections)))
    assigned: list[list[int]] = [[] for _ in reqs]

    def full(r: Mapping, d: Detection) -> bool:
        return d.shape == r["class"] and (r.get("color") is None or d.colour == r["color"])

    def half(r: Mapping, d: Detection) -> bool:
        return d.shape == r["class"] or (r.get("color") is not None and d.colour == r["color"])

    for i, r in enumerate(reqs):
        for k in [k for k in free if full(r, detections[k])][: need[i]]:
            assigned[i].append(k)
            free.remove(k)
    n_full = sum(len(a) for a in assigned)
    n_half = 0
    for i, r in enumerate(reqs):
        for _ in range(need[i] - len(assigned[i])):
            k = next((k for k in free if half(r, detections[k])), None)
            if k is None:
                break
            free.remove(k)
            n_half += 1
    n_extra = len(free)
    objects = float(np.clip((n_full + 0.5 * n_half - 0.5 * n_extra) / max(n_req, 1), 0.0, 1.0))

    relation = None
    for i, r in enumerate(reqs):
        if "position" in r:
            rel, j = r["position"][0], int(r["position"][1])
            ok = len(assigned[i]) == need[i] == 1 and len(assigned[j]) == need[j] == 1
            if ok:
                a, b = detections[assigned[i][0]], detections[assigned[j][0]]
                ok = relation_holds(rel, (a.x, a.y), (b.x, b.y))
            relation = bool(ok) if relation is None else (relation and bool(ok))
    reward = objects if relation is None else 0.5 * (objects + float(relation))
    strict = n_full == n_req and n_extra == 0 and relation is not False
    details = {"full": n_full, "half": n_half, "extra": n_extra, "required": n_req, "relation": relation,
               "detections": list(detections)}
    return ScoreResult(reward=reward, strict=bool(strict), details=details)


def score(image: np.ndarray, metadata: Mapping) -> ScoreResult:
    """Detect the objects of a uint8 [H, W, 3] image and evaluate them against GenEval metadata."""
    return evaluate(detect(image), metadata)


def satisfies(scene: Scene, metadata: Mapping) -> bool:
    """Ground truth: whether the scene's objects satisfy the prompt exactly (the strict rule of detect.score)."""
    dets = [Detection(o.shape, o.colour, o.x, o.y, o.size * o.size) for o in scene.objects]
    return evaluate(dets, metadata).strict
