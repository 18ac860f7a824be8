"""benchmarks/heldout_fresh_noise.py: every model sees the same prompts and noise, so a copy of the reference scores
image for image what the reference scores (a gain of exactly 0), and a changed model scores other images."""

from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "verl_diffusion" / "assets" / "shapes_sd3"


@pytest.fixture(scope="module")
def hfn(load_benchmark):
    return load_benchmark("heldout_fresh_noise")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from diffusers import DiffusionPipeline

    root = tmp_path_factory.mktemp("models")
    pipe = DiffusionPipeline.from_pretrained(BASE)
    pipe.save_pretrained(root / "copy")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in pipe.transformer.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.detach().std().clamp_min(1e-3))
    pipe.save_pretrained(root / "perturbed")
    return str(BASE), str(root / "copy"), str(root / "perturbed")


def test_copy_scores_the_same_images_and_a_changed_model_others(hfn, models, capsys):
    base, copy, perturbed = models
    prompts = str(REPO / "verl_diffusion" / "data" / "shapes" / "test.parquet")
    table = hfn.score_models([base, copy, perturbed], ["two_object"], prompts, seeds_per_prompt=2, max_prompts=2,
                             log=lambda line: None)
    s0, r0, t0 = table[(base, "two_object")]
    s1, r1, t1 = table[(copy, "two_object")]
    s2, r2, t2 = table[(perturbed, "two_object")]
    assert len(r0) == len(r1) == len(r2) == 4
    assert np.array_equal(s0, s1) and np.array_equal(r0, r1) and np.array_equal(t0, t1)
    assert np.abs(r2 - r0).max() > 1e-3
    assert ((0 <= r0) & (r0 <= 1)).all() and set(np.unique(s0)) <= {0.0, 1.0}

    assert hfn.main(["--models", base, copy, "--tags", "two_object", "--max-prompts", "1", "--seeds-per-prompt", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| two_object |")]
    assert len(rows) == 2 and rows[0].endswith("| — |") and rows[1].endswith("| +0.0 ± 0.0 |")
