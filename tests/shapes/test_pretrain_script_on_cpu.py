"""scripts/pretrain_shapes.py end to end at toy length: both stages run, the directory it saves loads through the
trainer's from_pretrained path, and its MANIFEST lists every file with its SHA-256 and the command."""

import hashlib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_pretrain_script_saves_a_loadable_model_with_its_manifest(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import pretrain_shapes
    finally:
        sys.path.pop(0)
    out = tmp_path / "model"
    argv = ["--out", str(out), "--vae-steps", "2", "--vae-batch", "4", "--steps", "3", "--batch", "4", "--pool", "16",
            "--warmup", "1", "--eval-every", "2", "--eval-prompts", "2", "--eval-steps", "2",
            "--final-eval-prompts", "2", "--layers", "1", "--threads", "1", "--vae-check", "8"]
    pretrain_shapes.main(argv)
    manifest = json.loads((out / "MANIFEST.json").read_text())
    assert manifest["command"] == "python scripts/pretrain_shapes.py " + " ".join(argv)
    files = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != "MANIFEST.json"}
    assert set(manifest["files"]) == files and "transformer/diffusion_pytorch_model.safetensors" in files
    for rel, digest in manifest["files"].items():
        assert hashlib.sha256((out / rel).read_bytes()).hexdigest() == digest, rel
    hist = manifest["results"]["history"]
    assert [h["step"] for h in hist] == [2, 3]
    assert all(0.0 <= h[s]["strict"] <= 1.0 for h in hist for s in ("train", "heldout"))

    from verl_diffusion.models.sd3 import SD3Adapter

    adapter = SD3Adapter.from_pretrained(out)
    assert adapter.latent_shape(32, 32) == (4, 16, 16)
    # The saved VAE carries the latent statistics of the pool (unit-variance latents for the transformer).
    assert adapter.vae.config.scaling_factor != 1.5305
    tok = adapter.pipe.tokenizer
    assert tok.convert_ids_to_tokens(tok("three red circles").input_ids)[1:-1] == ["three</w>", "red</w>", "circles</w>"]
