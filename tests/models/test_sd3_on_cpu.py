"""SD3 adapter on the tiny offline pipeline: loading, velocity, CFG, LoRA, full fine-tuning, errors."""

import json

import pytest
import torch

from verl_diffusion.models import MODEL_ADAPTERS, get_adapter_cls
from verl_diffusion.models.base import Conditioning, FlowModelAdapter
from verl_diffusion.models.sd3 import SD3Adapter
from verl_diffusion.models.tiny import build_tiny_sd3_pipeline, save_tiny_sd3

PROMPTS = ["a red cat", "the word hello"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "model", seed=0)


@pytest.fixture()
def adapter(tiny_dir):
    return SD3Adapter.from_pretrained(tiny_dir)


def _inputs(adapter, b=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((b, *adapter.latent_shape(64, 64)), generator=g)
    t = torch.tensor([0.9, 0.4][:b])
    return x, t


def test_registry_and_protocol(adapter):
    assert get_adapter_cls("sd3") is SD3Adapter
    assert set(MODEL_ADAPTERS) >= {"sd3"}
    with pytest.raises(KeyError, match="unknown; choose one of"):
        get_adapter_cls("sdxl")
    assert isinstance(adapter, FlowModelAdapter)


def test_tiny_model_is_small(tiny_dir):
    size = sum(p.stat().st_size for p in tiny_dir.rglob("*") if p.is_file())
    assert size < 5 * 2**20
    assert json.loads((tiny_dir / "model_index.json").read_text())["_class_name"] == "StableDiffusion3Pipeline"


def test_round_trip_gives_identical_velocities(adapter):
    built = SD3Adapter.from_pipeline(build_tiny_sd3_pipeline(seed=0))
    x, t = _inputs(adapter)
    c1, c2 = adapter.encode_prompt(PROMPTS), built.encode_prompt(PROMPTS)
    assert torch.equal(c1.prompt_embeds, c2.prompt_embeds)
    assert torch.equal(c1.pooled_prompt_embeds, c2.pooled_prompt_embeds)
    with torch.no_grad():
        assert torch.equal(adapter.velocity(x, t, c1), built.velocity(x, t, c2))


def test_shapes_and_decode(adapter):
    cond = adapter.encode_prompt(PROMPTS)
    assert cond.prompt_embeds.shape == (2, 32, 32)           # 16 CLIP + 16 T5 tokens, T5 width 32
    assert cond.pooled_prompt_embeds.shape == (2, 32)
    assert adapter.latent_shape(64, 64) == (16, 16, 16)
    x, t = _inputs(adapter)
    with torch.no_grad():
        v = adapter.velocity(x, t, cond)
    assert v.shape == x.shape and v.dtype == torch.float32
    img = adapter.decode(x)
    assert img.shape == (2, 3, 64, 64) and img.dtype == torch.uint8
    with pytest.raises(ValueError, match="not a multiple of 8"):
        adapter.latent_shape(60, 64)


def test_velocity_passes_1000t_to_transformer(adapter):
    seen = {}
    hook = adapter.transformer.register_forward_pre_hook(
        lambda m, a, kw: seen.update(t=kw["timestep"].clone()), with_kwargs=True)
    x, t = _inputs(adapter)
    with torch.no_grad():
        adapter.velocity(x, t, adapter.encode_prompt(PROMPTS))
    hook.remove()
    assert torch.allclose(seen["t"], 1000 * t)


def test_cfg_formula(adapter):
    x, t = _inputs(adapter)
    cond, neg = adapter.encode_prompt(PROMPTS), adapter.encode_prompt(["", ""])
    with torch.no_grad():
        v_c, v_n = adapter.velocity(x, t, cond), adapter.velocity(x, t, neg)
        v = adapter.velocity(x, t, cond, guidance_scale=4.5, negative_cond=neg)
    torch.testing.assert_close(v, v_n + 4.5 * (v_c - v_n), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs negative_cond"):
        adapter.velocity(x, t, cond, guidance_scale=4.5)


def test_full_finetune_by_default(adapter):
    n_all = sum(p.numel() for p in adapter.transformer.parameters())
    assert sum(p.numel() for p in adapter.trainable_parameters()) == n_all
    assert not any(p.requires_grad for p in adapter.pipe.text_encoder_3.parameters())
    assert not any(p.requires_grad for p in adapter.vae.parameters())
    x, t = _inputs(adapter)
    adapter.velocity(x, t, adapter.encode_prompt(PROMPTS)).square().mean().backward()
    assert all(p.grad is not None for p in adapter.trainable_parameters())
    with pytest.raises(ValueError, match="frozen copy"):
        adapter.disable_adapter()
    ref = adapter.frozen_copy()
    assert not any(p.requires_grad for p in ref.parameters())


@pytest.mark.parametrize("init", ["gaussian", True])
def test_lora_zero_b_init_keeps_velocity(adapter, init):
    x, t = _inputs(adapter)
    cond = adapter.encode_prompt(PROMPTS)
    with torch.no_grad():
        v_base = adapter.velocity(x, t, cond)
    n_base = sum(p.numel() for p in adapter.transformer.parameters())
    adapter.add_lora(rank=4, alpha=4, init_lora_weights=init)
    trainable = dict((n, p) for n, p in adapter.transformer.named_parameters() if p.requires_grad)
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(p.numel() for p in adapter.transformer.parameters()) - n_base == \
        sum(p.numel() for p in trainable.values())
    with torch.no_grad():
        assert torch.equal(adapter.velocity(x, t, cond), v_base)
    sd = adapter.lora_state_dict()
    assert sd and all("lora_" in k for k in sd)
    assert sum(v.numel() for v in sd.values()) == sum(p.numel() for p in trainable.values())


def test_lora_disable_adapter_gives_base_velocity(adapter):
    x, t = _inputs(adapter)
    cond = adapter.encode_prompt(PROMPTS)
    with torch.no_grad():
        v_base = adapter.velocity(x, t, cond)
    adapter.add_lora(rank=4, alpha=8)
    with torch.no_grad():
        for n, p in adapter.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.1)
        v_lora = adapter.velocity(x, t, cond)
        with adapter.disable_adapter():
            v_ref = adapter.velocity(x, t, cond)
        v_again = adapter.velocity(x, t, cond)
    assert not torch.allclose(v_lora, v_base)
    assert torch.equal(v_ref, v_base)
    assert torch.equal(v_again, v_lora)
    assert all(p.requires_grad for n, p in adapter.transformer.named_parameters() if "lora_" in n)
    # Gradients reach the LoRA weights only.
    adapter.velocity(x, t, cond).square().mean().backward()
    assert all((p.grad is not None) == ("lora_" in n) for n, p in adapter.transformer.named_parameters())


def test_transformer_is_replaceable(adapter):
    x, t = _inputs(adapter)
    cond = adapter.encode_prompt(PROMPTS)
    calls = []

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **kw):
            calls.append(1)
            return self.inner(**kw)

    with torch.no_grad():
        v0 = adapter.velocity(x, t, cond)
        adapter.transformer = Wrapped(adapter.transformer)
        assert torch.equal(adapter.velocity(x, t, cond), v0) and calls


def test_conditioning_helpers(adapter):
    cond = adapter.encode_prompt(PROMPTS)
    rep = cond.repeat_interleave(3)
    assert len(rep) == 6 and torch.equal(rep.prompt_embeds[2], cond.prompt_embeds[0])
    sel = rep.index_select(torch.tensor([5, 0]))
    assert torch.equal(sel.pooled_prompt_embeds[0], cond.pooled_prompt_embeds[1])
    assert set(cond.as_dict()) == {"prompt_embeds", "pooled_prompt_embeds"}
    back = Conditioning.from_dict(cond.as_dict())
    assert torch.equal(back.prompt_embeds, cond.prompt_embeds)
    assert Conditioning.cat([cond, cond]).to(dtype=torch.float64).prompt_embeds.dtype == torch.float64
    tiled = cond.repeat(2)
    assert len(tiled) == 4 and torch.equal(tiled.pooled_prompt_embeds[2], cond.pooled_prompt_embeds[0])


def test_bad_paths_teach(tmp_path, tiny_dir):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nope")):
        SD3Adapter.from_pretrained(tmp_path / "nope")
    other = tmp_path / "flux"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    with pytest.raises(ValueError, match="'FluxPipeline' pipeline, not a StableDiffusion3Pipeline"):
        SD3Adapter.from_pretrained(other)


def test_bf16_load_returns_velocity_in_input_dtype(tiny_dir):
    adapter = SD3Adapter.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    assert adapter.dtype == torch.bfloat16
    x, t = _inputs(adapter)
    with torch.no_grad():
        v = adapter.velocity(x, t, adapter.encode_prompt(PROMPTS))
    assert v.dtype == torch.float32 and torch.isfinite(v).all()
    assert adapter.decode(x).dtype == torch.uint8


def test_scheduler_grid_is_the_stock_pipelines(adapter):
    """SPEC §1.1: SD3.5's FlowMatchEulerDiscreteScheduler(shift=3) at N = 10, the grid Flow-GRPO samples with;
    the formula grid's t_9 is 0.25, the scheduler's 0.0089."""
    g = adapter.sampling_grid(10, 64, 64)
    want = torch.tensor([1, 0.9601, 0.9133, 0.8577, 0.7904, 0.7073, 0.6022, 0.4649, 0.2780, 0.0089, 0])
    torch.testing.assert_close(g, want, rtol=0, atol=5e-5)
    pipe = adapter.pipe
    pipe(prompt="a cat", num_inference_steps=10, height=64, width=64, guidance_scale=1.0, output_type="latent")
    assert torch.equal(g, pipe.scheduler.sigmas.float())
