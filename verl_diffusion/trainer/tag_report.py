"""Held-out accuracy per tag, weighted so that every composition counts the same, and its paired gain.

A GenEval-style validation set has tags (single_object, counting, position, ...) and, within a tag, compositions (what
a prompt asks for, whatever its wording). A plain mean over images lets the tag with the most prompts, or one prompt
repeated many times, dominate. Here:

- a tag's accuracy is the mean over its compositions of the mean over that composition's images;
- the overall accuracy is the mean over tags of the tag accuracies (``TAG_MEAN``), so each tag weighs 1/T and each
  composition 1/(T·C_t);
- a gain between two validations of the same images (prompts and noise) is the same weighted mean of the per-image
  differences d_i; its standard error is sqrt(Σ a_i²)·sd_t(d) within a tag (a_i the image weights, summing to 1 in
  the tag; sd the tag's sample sd of d), combined over tags as sqrt(Σ_t SE_t²)/T. With one image per composition
  this is sd/√n, the plain paired standard error.

Within-prompt diversity: for each composition with two or more images, the per-pixel standard deviation across its
images (in [0, 1] image units) averaged over pixels, then over compositions. A gain that comes from collapsing every
prompt onto one image shows as this number falling.

Numpy and the rows' metadata (read as the GenEval reward reads it); the trainer and the sample command feed it the
per-image values.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

TAG_MEAN = "all tags"
# Suffix of the composition-weighted mean over tags of a per-image metric: val/shapes/strict/by_composition (and
# .../by_composition/<tag> per tag).
BY_COMPOSITION = "/by_composition"


def _geneval(metadata: Optional[Mapping]) -> Optional[dict]:
    from verl_diffusion.rewards.geneval import geneval_metadata

    return geneval_metadata(metadata)


def composition_key(metadata: Optional[Mapping], prompt: str) -> str:
    """What a prompt asks for, independent of its wording: the shapes world's composition when the metadata is
    GenEval-style (tag + include; a dataset row's ``reward_model.ground_truth`` or the bare dict), the sorted
    requirements for other GenEval metadata, else the prompt text itself."""
    metadata = _geneval(metadata)
    if metadata and "tag" in metadata and "include" in metadata:
        try:
            from verl_diffusion.shapes.world import composition_of

            tag, comp = composition_of(metadata)
            return json.dumps([tag, comp])
        except (KeyError, ValueError, IndexError, TypeError):
            pass
        reqs = sorted(json.dumps(r, sort_keys=True) for r in metadata["include"])
        return json.dumps([metadata["tag"], reqs])
    return prompt


def tag_of(metadata: Optional[Mapping]) -> str:
    """The row's GenEval tag (its ground truth's, else ``extra_info.tag``), or "untagged"."""
    g = _geneval(metadata) or {}
    extra = (metadata or {}).get("extra_info") or {}
    return str(g.get("tag") or (extra.get("tag") if isinstance(extra, Mapping) else None) or "untagged")


def _weights(tags: Sequence[str], keys: Sequence[str]) -> dict[str, np.ndarray]:
    """Per tag: its image indices' weights a_i (summing to 1), 0 elsewhere."""
    tags, keys = np.asarray(tags, dtype=object), np.asarray(keys, dtype=object)
    out = {}
    for t in dict.fromkeys(tags.tolist()):   # first-appearance order (a validation file lists tags in order)
        w = np.zeros(len(tags))
        in_t = tags == t
        comps = sorted(set(keys[in_t].tolist()))
        for c in comps:
            m = in_t & (keys == c)
            w[m] = 1.0 / (len(comps) * m.sum())
        out[t] = w
    return out


@dataclass(frozen=True)
class TagRow:
    """One tag (or ``TAG_MEAN``): its compositions and images, accuracy before and after, gain and its paired s.e."""

    tag: str
    compositions: int
    images: int
    before: float
    after: Optional[float] = None
    gain: Optional[float] = None
    se: Optional[float] = None


def tag_accuracy(values: Sequence[float], tags: Sequence[str], keys: Sequence[str]) -> dict[str, float]:
    """Composition-weighted accuracy per tag and their mean (``TAG_MEAN``); NaN values (a failed score) are dropped."""
    v = np.asarray(values, dtype=np.float64)
    ok = np.isfinite(v)
    w = _weights([t for t, o in zip(tags, ok) if o], [k for k, o in zip(keys, ok) if o])
    out = {t: float((wt * v[ok]).sum()) for t, wt in w.items()}
    if out:
        out[TAG_MEAN] = float(np.mean(list(out.values())))
    return out


def tag_gains(before: Sequence[float], after: Optional[Sequence[float]], tags: Sequence[str],
              keys: Sequence[str]) -> list[TagRow]:
    """Per tag and for the mean over tags: the composition-weighted accuracy before and after (same images in the
    same order), the gain and its paired standard error (module docstring). ``after`` None: accuracy only."""
    b = np.asarray(before, dtype=np.float64)
    a = np.asarray(after, dtype=np.float64) if after is not None else None
    ok = np.isfinite(b) & (np.isfinite(a) if a is not None else True)
    tags_ok = [t for t, o in zip(tags, ok) if o]
    keys_ok = [k for k, o in zip(keys, ok) if o]
    b = b[ok]
    a = a[ok] if a is not None else None
    rows = []
    for t, w in _weights(tags_ok, keys_ok).items():
        idx = w > 0
        n_comp = len({k for k, tt in zip(keys_ok, tags_ok) if tt == t})
        if a is None:
            rows.append(TagRow(t, n_comp, int(idx.sum()), float((w * b).sum())))
            continue
        d = a - b
        sd = float(d[idx].std(ddof=1)) if idx.sum() >= 2 else float("nan")
        se = math.sqrt(float((w[idx] ** 2).sum())) * sd
        rows.append(TagRow(t, n_comp, int(idx.sum()), float((w * b).sum()), float((w * a).sum()),
                           float((w * d).sum()), se))
    if rows:
        n_t = len(rows)
        mean = lambda xs: float(np.mean(xs))
        if a is None:
            rows.append(TagRow(TAG_MEAN, sum(r.compositions for r in rows), sum(r.images for r in rows),
                               mean([r.before for r in rows])))
        else:
            se = math.sqrt(sum(r.se ** 2 for r in rows if np.isfinite(r.se))) / n_t
            rows.append(TagRow(TAG_MEAN, sum(r.compositions for r in rows), sum(r.images for r in rows),
                               mean([r.before for r in rows]), mean([r.after for r in rows]),
                               mean([r.gain for r in rows]), se))
    return rows


def within_prompt_diversity(images, keys: Sequence[str]) -> Optional[float]:
    """Mean over compositions with ≥ 2 images of the per-pixel std across them ([N, C, H, W] uint8 or float in
    [0, 1]); None when no composition has two images."""
    x = np.asarray(images, dtype=np.float64)
    if np.issubdtype(np.asarray(images).dtype, np.integer):
        x = x / 255.0
    keys = np.asarray(keys, dtype=object)
    stds = [float(x[keys == k].std(axis=0).mean()) for k in sorted(set(keys.tolist())) if (keys == k).sum() >= 2]
    return float(np.mean(stds)) if stds else None


def composition_metrics(per_image: Mapping[str, Sequence[float]], images, groups: Mapping[str, Sequence[str]]
                        ) -> dict[str, float]:
    """Validation metrics from per-image values: for each ``val/<reward>/strict`` (a 0/1 per image) its
    composition-weighted mean over tags (``...{BY_COMPOSITION}``) and per tag (``.../<tag>``); ``val/diversity``
    (within-prompt diversity of ``images``). ``groups`` holds the images' "tag" and "composition"."""
    out: dict[str, float] = {}
    tags, keys = list(groups["tag"]), list(groups["composition"])
    for key, values in per_image.items():
        if not key.endswith("/strict"):
            continue
        acc = tag_accuracy(values, tags, keys)
        for t, v in acc.items():
            out[key + BY_COMPOSITION + ("" if t == TAG_MEAN else "/" + t)] = v
    div = within_prompt_diversity(images.cpu().numpy() if hasattr(images, "cpu") else images, keys)
    if div is not None:
        out["val/diversity"] = div
    return out


def table_lines(rows: Sequence[TagRow], label: str = "strict", before: str = "before",
                after: str = "after") -> list[str]:
    """A fixed-width table: tag, compositions, images, before, after, gain ± s.e. (points)."""
    head = f"{'tag':14s} {'comps':>5s} {'images':>6s} {label + ' ' + before:>14s} {after:>8s} {'gain ± s.e.':>16s}"
    out = [head]
    for r in rows:
        line = f"{r.tag:14s} {r.compositions:5d} {r.images:6d} {100 * r.before:13.1f}%"
        if r.after is not None:
            line += f" {100 * r.after:7.1f}% {100 * r.gain:+8.1f} ± {100 * r.se:4.1f}"
        out.append(line)
    return out
