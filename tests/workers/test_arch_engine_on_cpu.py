"""Qwen-Image, FLUX.1 and FLUX.2-klein through the diffusion engine with guidance on (CFG; FLUX.1 also its distilled
guidance embedding): training recomputes exactly what the rollout sampled, so the on-policy log-ratio is 0 (bitwise)
and the off-policy recompute equals the rollout's log-probs; LoRA on the architecture's default targets trains."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ARCHS = ("qwen_image", "flux", "flux2_klein")


@pytest.fixture(scope="module")
def rows() -> dict:
    env = dict(os.environ, VERL_PLATFORM="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(HERE / "arch_engine_smoke.py"), *ARCHS], capture_output=True, text=True,
                         env=env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    return {r["arch"]: r for r in (json.loads(line) for line in res.stdout.splitlines() if line.startswith("{"))}


@pytest.mark.parametrize("arch", ARCHS)
def test_on_policy_ratio_is_exactly_one_with_guidance(rows, arch):
    row = rows[arch]
    assert row["trained_items"] == 8
    assert row["lr0"] == 0.0
    assert row["recompute_abs_max"] == 0.0
    assert "negative_prompt_embeds" in row["negative_keys"]     # CFG's negative branch was stored and trained


@pytest.mark.parametrize("arch", ARCHS)
def test_lora_on_default_targets_trains(rows, arch):
    from verl_diffusion.models import get_adapter_cls

    row = rows[arch]
    assert row["grad_norm"] > 0
    targets = get_adapter_cls(arch).LORA_TARGETS
    assert row["changed_lora_layers"]
    for name in row["changed_lora_layers"]:
        assert re.fullmatch(targets, name) if isinstance(targets, str) else any(name.endswith(t) for t in targets)
    # Both streams learn: an image-stream and a text-stream projection moved.
    assert any(".attn.to_q" in n for n in row["changed_lora_layers"])
    assert any(".attn.add_k_proj" in n for n in row["changed_lora_layers"])
