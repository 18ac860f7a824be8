"""The shipped pretrained shapes model (verl_diffusion/assets/shapes_sd3, scripts/pretrain_shapes.py): its files
match the MANIFEST's SHA-256s, it fits the package budget, loads through the trainer's from_pretrained path with
word-level tokenizers for the whole prompt vocabulary, and its ODE samples of prompts are scored correct by the
``shapes`` detector about as often as the MANIFEST says."""

import hashlib
import importlib.resources
import json
from pathlib import Path

import numpy as np
import pytest
import torch

ASSET = Path(str(importlib.resources.files("verl_diffusion").joinpath("assets/shapes_sd3")))


@pytest.fixture(scope="module")
def manifest():
    return json.loads((ASSET / "MANIFEST.json").read_text())


@pytest.fixture(scope="module")
def adapter():
    from verl_diffusion.models.sd3 import SD3Adapter

    return SD3Adapter.from_pretrained(ASSET)


def test_files_match_the_manifest_and_fit_the_budget(manifest):
    files = {str(p.relative_to(ASSET)) for p in ASSET.rglob("*") if p.is_file() and p.name != "MANIFEST.json"}
    assert set(manifest["files"]) == files
    for rel, digest in manifest["files"].items():
        assert hashlib.sha256((ASSET / rel).read_bytes()).hexdigest() == digest, rel
    assert sum((ASSET / rel).stat().st_size for rel in files) <= 15 * 2 ** 20
    assert manifest["command"].startswith("python scripts/pretrain_shapes.py")


def test_every_prompt_word_is_one_token(adapter):
    from verl_diffusion.shapes.world import sample_prompt

    rng = np.random.default_rng(0)
    words = {w for split in ("train", "heldout") for _ in range(500) for w in sample_prompt(rng, split)[0].split()}
    for w in sorted(words):
        assert len(adapter.pipe.tokenizer(w).input_ids) == 3, w          # <start> word <end>
        assert len(adapter.pipe.tokenizer_3(w).input_ids) == 2, w        # ▁word </s>
    assert adapter.latent_shape(32, 32) == (4, 16, 16)


def _strict_accuracy(adapter, pairs, seed=0, steps=20):
    from verl_diffusion.shapes import score

    noise = torch.randn((len(pairs), *adapter.latent_shape(32, 32)), generator=torch.Generator().manual_seed(seed))
    grid = adapter.sampling_grid(steps, 32, 32)
    cond = adapter.encode_prompt([p for p, _ in pairs])
    x = noise
    with torch.no_grad():
        for k in range(len(grid) - 1):
            x = x + (grid[k + 1] - grid[k]) * adapter.velocity(x, grid[k].expand(len(pairs)), cond)
    images = adapter.decode(x).permute(0, 2, 3, 1).numpy()
    return float(np.mean([score(im, m).strict for im, (_, m) in zip(images, pairs)]))


def test_samples_are_as_accurate_as_the_manifest_says(adapter, manifest):
    from verl_diffusion.shapes.world import sample_prompt

    rng = np.random.default_rng(123)
    pairs = [sample_prompt(rng, "train") for _ in range(64)]
    acc = _strict_accuracy(adapter, pairs)
    want = manifest["results"]["final"]["train"]["strict"]
    # 64 prompts: a binomial standard error of at most 0.0625; 4 of them either side.
    assert abs(acc - want) <= 0.25, (acc, want)
    assert acc > 0.0
