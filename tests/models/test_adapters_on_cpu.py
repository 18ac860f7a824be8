"""Qwen-Image, FLUX.1 and FLUX.2-klein adapters on their tiny offline pipelines (saved with a sharded
transformer and loaded through the real path): the stock diffusers pipeline is the reference throughout.

Per architecture: the adapter's velocity is the pipeline's own transformer call; the Euler ODE on the model's
scheduler grid reproduces the stock pipeline's latents and image for the same noise (CFG on and off); the grid
is the pipeline's; LoRA targets are exactly every attention / feed-forward projection of both streams and each
receives a gradient; a save/load round trip is bitwise.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from verl_diffusion.models import adapter_for_path, architecture_of, get_adapter_cls
from verl_diffusion.models.base import Conditioning, FlowModelAdapter
from verl_diffusion.models.tiny import TINY_BUILDERS, save_tiny
from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout, RolloutConfig

ARCHS = ["qwen_image", "flux", "flux2_klein"]
PROMPTS = ["a red cat", 'a sign that says "hi"']
H = W = 64
N = 4
# Negative prompts the stock pipelines use with CFG (Qwen-Image's examples: " "; FLUX.2-klein: "").
NEGATIVE = {"qwen_image": " ", "flux": "", "flux2_klein": ""}


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="module")
def saved(arch, tmp_path_factory):
    """The tiny model saved with its transformer sharded (several safetensors files + index)."""
    return save_tiny(arch, tmp_path_factory.mktemp(arch) / "model", max_shard_size="60KB")


@pytest.fixture(scope="module")
def pipe(arch):
    return TINY_BUILDERS[arch]()


@pytest.fixture()
def adapter(arch, pipe):
    """Over the module's shared pipeline: for tests that do not change weights."""
    return get_adapter_cls(arch).from_pipeline(pipe)


@pytest.fixture()
def fresh(arch):
    """Over a pipeline of its own: for tests that add LoRA or accumulate gradients."""
    return get_adapter_cls(arch).from_pipeline(TINY_BUILDERS[arch]())


def _noise(adapter, b=2, h=H, w=W, seed=0):
    return torch.randn((b, *adapter.latent_shape(h, w)), generator=torch.Generator().manual_seed(seed))


def _stock(arch, pipe, adapter, x0, *, guidance, height=H, width=W, output_type="latent"):
    """The stock pipeline from the same initial noise, N steps; returns latents in the adapter's layout
    (output_type latent) or float images in [0, 1] (output_type pt)."""
    _, _, h, w = x0.shape
    kw = dict(prompt=PROMPTS, num_inference_steps=N, height=height, width=width, output_type=output_type)
    if arch == "qwen_image":
        kw.update(latents=adapter.pack(x0), true_cfg_scale=guidance,
                  negative_prompt=[NEGATIVE[arch]] * 2 if guidance != 1 else None)
    elif arch == "flux":
        kw.update(latents=adapter.pack(x0), true_cfg_scale=guidance, guidance_scale=adapter.distilled_guidance_scale,
                  negative_prompt=[NEGATIVE[arch]] * 2 if guidance != 1 else None,
                  max_sequence_length=adapter.max_sequence_length)
    else:
        kw.update(latents=x0, guidance_scale=guidance, max_sequence_length=adapter.max_sequence_length)
    out = pipe(**kw).images
    if output_type != "latent":
        return out
    if arch == "flux2_klein":   # the pipeline returns un-normalised, unpatchified VAE latents
        bn = pipe.vae.bn
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
        return (pipe._patchify_latents(out) - bn.running_mean.view(1, -1, 1, 1)) / std
    return adapter.unpack(out, h, w)


def _rollout(adapter, arch, guidance, *, height=H, width=W):
    return DiffusersRollout(adapter, RolloutConfig(num_steps=N, grid="scheduler", sampler="ode", height=height,
                                                   width=width, guidance_scale=guidance,
                                                   negative_prompt=NEGATIVE[arch]))


# ------------------------------------------------------------------------------------------------ loading

def test_registry_protocol_and_architecture_from_path(arch, saved, adapter):
    assert architecture_of(saved) == arch
    assert adapter_for_path(saved) is get_adapter_cls(arch)
    assert isinstance(adapter, FlowModelAdapter)
    index = json.loads((saved / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1   # really sharded


def test_sharded_save_load_round_trip_is_bitwise(arch, saved, adapter):
    loaded = get_adapter_cls(arch).from_pretrained(saved)
    a = dict(adapter.transformer.state_dict())
    b = dict(loaded.transformer.state_dict())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c1, c2 = adapter.encode_prompt(PROMPTS), loaded.encode_prompt(PROMPTS)
    for k, v in c1.as_dict().items():
        assert torch.equal(v, c2.as_dict()[k]), k
    x, t = _noise(adapter), torch.tensor([0.9, 0.3])
    with torch.no_grad():
        assert torch.equal(adapter.velocity(x, t, c1), loaded.velocity(x, t, c2))
        assert torch.equal(adapter.decode(x), loaded.decode(x))


def test_wrong_pipeline_is_refused(arch, saved, tmp_path):
    other = "sd3" if arch != "sd3" else "flux"
    with pytest.raises(ValueError, match="pipeline, not a"):
        get_adapter_cls(other).from_pretrained(saved)
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        get_adapter_cls(arch).from_pretrained(tmp_path / "nope")


# ------------------------------------------------------------------------------------------------ primitives

def test_velocity_is_the_pipelines_transformer_call(arch, pipe, adapter):
    """The same transformer call the stock pipeline makes in its loop (packing, ids, masks, guidance, 1000·t/1000)."""
    x, t = _noise(adapter), torch.tensor([0.8, 0.8])
    cond = adapter.encode_prompt(PROMPTS)
    with torch.no_grad():
        ours = adapter.velocity(x, t, cond)
        timestep = (t * 1000) / 1000
        if arch == "qwen_image":
            emb, mask = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=adapter.max_sequence_length)
            ref = pipe.transformer(hidden_states=adapter.pack(x), timestep=timestep, guidance=None,
                                   encoder_hidden_states_mask=mask, encoder_hidden_states=emb,
                                   img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]
            ref = adapter.unpack(ref, 8, 8)
        elif arch == "flux":
            emb, pooled, txt_ids = pipe.encode_prompt(PROMPTS, None, device="cpu",
                                                      max_sequence_length=adapter.max_sequence_length)
            ids = pipe._prepare_latent_image_ids(2, 4, 4, "cpu", torch.float32)
            ref = pipe.transformer(hidden_states=adapter.pack(x), timestep=timestep,
                                   guidance=torch.full([2], 3.5), pooled_projections=pooled,
                                   encoder_hidden_states=emb, txt_ids=txt_ids, img_ids=ids, return_dict=False)[0]
            ref = adapter.unpack(ref, 8, 8)
        else:
            emb, txt_ids = pipe.encode_prompt(PROMPTS, device="cpu", max_sequence_length=adapter.max_sequence_length)
            lat, ids = pipe.prepare_latents(2, x.shape[1] // 4, H, W, torch.float32, "cpu", None, latents=x)
            ref = pipe.transformer(hidden_states=lat, timestep=timestep, guidance=None, encoder_hidden_states=emb,
                                   txt_ids=txt_ids, img_ids=ids, return_dict=False)[0]
            ref = ref.permute(0, 2, 1).reshape(x.shape)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("guidance", [1.0, 4.0])
def test_ode_rollout_reproduces_the_stock_pipeline(arch, pipe, adapter, guidance):
    """Our sampler (DiffusersRollout, ODE on the scheduler grid) = the stock pipeline, latents and image."""
    ro = _rollout(adapter, arch, guidance)
    x0 = _noise(adapter)
    ours = ro.run_trajectory(ro.encode_prompts(PROMPTS), x0, sigmas=ro.grid(N).expand(2, -1),
                             negative_cond=ro._negative(2))["all_latents"][:, -1]
    ref = _stock(arch, pipe, adapter, x0, guidance=guidance)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-5)
    image = _stock(arch, pipe, adapter, x0, guidance=guidance, output_type="pt")
    ours_img = adapter.decode(ours).float() / 255
    assert (ours_img - image).abs().max() <= 1 / 255 + 1e-6


def test_generate_ode_at_a_non_square_size(arch, pipe, adapter):
    """Position ids / image shapes follow the latent: a 64×128 image reproduces the stock pipeline too."""
    ro = _rollout(adapter, arch, 1.0, height=64, width=128)
    images = ro.generate_ode(PROMPTS, seeds=[3, 4], num_steps=N, height=64, width=128)
    assert images.shape == (2, 3, 64, 128)
    x0 = torch.stack([torch.randn(adapter.latent_shape(64, 128), generator=torch.Generator().manual_seed(s))
                      for s in (3, 4)])
    ref = _stock(arch, pipe, adapter, x0, guidance=1.0, height=64, width=128, output_type="pt")
    assert (images.float() / 255 - ref).abs().max() <= 1 / 255 + 1e-6


def test_grid_is_the_pipelines_scheduler_sigmas(arch, pipe, adapter):
    x0 = _noise(adapter)
    _stock(arch, pipe, adapter, x0, guidance=1.0)
    assert torch.equal(adapter.sampling_grid(N, H, W), pipe.scheduler.sigmas.float())
    g = adapter.sampling_grid(10, H, W)
    assert g.shape == (11,) and g[0] == 1 and g[-1] == 0 and bool((g[1:] < g[:-1]).all())
    # Dynamic shift: more image tokens shift the grid towards noise (Qwen-Image keeps its terminal time 0.02).
    big = adapter.sampling_grid(10, 4 * H, 4 * W)
    assert bool((big[1:6] > g[1:6]).all()) and bool((big[1:-1] >= g[1:-1]).all())


def test_size_errors_teach(adapter):
    with pytest.raises(ValueError, match="not a multiple of 16"):
        adapter.latent_shape(60, 64)


# ------------------------------------------------------------------------------------------------ training

def _expected_lora_layers(arch, transformer) -> set[str]:
    """Every nn.Linear of the blocks that projects attention (q, k, v, out; both streams) or feeds forward,
    read off the module tree (modulation / norm layers excluded)."""
    out = set()
    for name, m in transformer.named_modules():
        if not isinstance(m, torch.nn.Linear) or "transformer_blocks." not in name:
            continue
        leaf = name.split(".", 2)[2]
        if "mod" in leaf.split(".")[0] or leaf.startswith("norm") or ".norm" in leaf:
            continue
        out.add(name)
    return out


def test_lora_targets_cover_every_attention_and_feed_forward_projection(arch, fresh):
    adapter = fresh
    import re

    expected = _expected_lora_layers(arch, adapter.transformer)
    # Both streams and (FLUX) both block kinds are present.
    assert any("add_q_proj" in n for n in expected) and any("mlp" in n or "ff" in n for n in expected)
    targets = adapter.lora_targets()
    if isinstance(targets, str):
        matched = {n for n, _ in adapter.transformer.named_modules() if re.fullmatch(targets, n)}
    else:
        matched = {n for n, _ in adapter.transformer.named_modules() if any(n == t or n.endswith("." + t)
                                                                           for t in targets)}
    assert matched == expected
    adapter.add_lora(rank=2, alpha=4)
    wrapped = {n.rsplit(".lora_A", 1)[0] for n, _ in adapter.transformer.named_parameters() if ".lora_A." in n}
    assert wrapped == expected


def test_every_lora_target_receives_a_gradient_and_zero_init_keeps_the_velocity(arch, fresh):
    adapter = fresh
    x, t = _noise(adapter), torch.tensor([0.9, 0.4])
    cond = adapter.encode_prompt(PROMPTS)
    neg = adapter.encode_prompt([NEGATIVE[arch]] * 2)
    with torch.no_grad():
        v0 = adapter.velocity(x, t, cond, guidance_scale=4.0, negative_cond=neg)
    adapter.add_lora(rank=2, alpha=4, init_lora_weights="gaussian")
    with torch.no_grad():
        assert torch.equal(adapter.velocity(x, t, cond, guidance_scale=4.0, negative_cond=neg), v0)
        for n, p in adapter.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.05)
    adapter.velocity(x, t, cond, guidance_scale=4.0, negative_cond=neg).square().mean().backward()
    lora = {n: p for n, p in adapter.transformer.named_parameters() if "lora_" in n}
    dead = {n for n, p in lora.items() if p.grad is None or float(p.grad.abs().sum()) == 0}
    if arch == "qwen_image":
        # Qwen-Image has no single-stream blocks: the last block's text-stream output is discarded, so its text
        # query / output / MLP cannot affect the velocity (true of the real model too; verl's target list has them).
        last = f"transformer_blocks.{len(adapter.transformer.transformer_blocks) - 1}."
        assert dead == {n for n in lora if n.startswith(last) and any(
            k in n for k in ("attn.add_q_proj", "attn.to_add_out", "txt_mlp."))}
    else:
        assert not dead
    assert all(p.grad is None for n, p in adapter.transformer.named_parameters() if "lora_" not in n)
    with torch.no_grad(), adapter.disable_adapter():
        assert torch.equal(adapter.velocity(x, t, cond, guidance_scale=4.0, negative_cond=neg), v0)


def test_full_finetune_gradients_reach_every_weight(arch, fresh):
    adapter = fresh
    x, t = _noise(adapter, b=1), torch.tensor([0.7])
    adapter.velocity(x, t, adapter.encode_prompt(PROMPTS[:1])).square().mean().backward()
    params = adapter.trainable_parameters()
    assert len(params) == len(list(adapter.transformer.parameters()))
    assert sum(p.grad is not None for p in params) / len(params) > 0.9
    assert not any(p.requires_grad for p in adapter.pipe.text_encoder.parameters())
    assert not any(p.requires_grad for p in adapter.vae.parameters())


def test_cfg_formula(arch, adapter):
    """v = v_neg + s·(v_cond − v_neg); Qwen-Image then rescales each packed token to ‖v_cond‖."""
    x, t = _noise(adapter), torch.tensor([0.9, 0.4])
    cond, neg = adapter.encode_prompt(PROMPTS), adapter.encode_prompt([NEGATIVE[arch]] * 2)
    with torch.no_grad():
        v_c, v_n = adapter.velocity(x, t, cond), adapter.velocity(x, t, neg)
        v = adapter.velocity(x, t, cond, guidance_scale=4.0, negative_cond=neg)
    comb = v_n + 4.0 * (v_c - v_n)
    if arch == "qwen_image":
        pc, pv = adapter.pack(v_c), adapter.pack(comb)
        comb = adapter.unpack(pv * pc.norm(dim=-1, keepdim=True) / pv.norm(dim=-1, keepdim=True), 8, 8)
        token_norm = adapter.pack(v).norm(dim=-1)
        torch.testing.assert_close(token_norm, pc.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(v, comb, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs negative_cond"):
        adapter.velocity(x, t, cond, guidance_scale=4.0)


# ------------------------------------------------------------------------------------------------ Qwen-Image text

def test_qwen_image_drops_the_34_template_tokens_and_masks_padding():
    from verl_diffusion.models.qwen_image import QwenImageAdapter

    pipe = TINY_BUILDERS["qwen_image"]()
    adapter = QwenImageAdapter.from_pipeline(pipe)
    tok = pipe.tokenizer
    template = pipe.prompt_template_encode
    assert pipe.prompt_template_encode_start_idx == 34
    assert len(tok(template.split("{}")[0]).input_ids) == 34      # the tiny tokenizer splits the template as Qwen's
    short, long = "a cat", 'a sign that says "hello world"'
    cond = adapter.encode_prompt([short, long])
    n_short = len(tok(template.format(short)).input_ids) - 34       # prompt + "<|im_end|>\n<|im_start|>assistant\n"
    n_long = len(tok(template.format(long)).input_ids) - 34
    assert cond.prompt_embeds.shape[1] == n_long
    assert cond.prompt_mask.sum(1).tolist() == [n_short, n_long]


def test_qwen_image_padding_never_changes_the_velocity():
    from verl_diffusion.models.qwen_image import QwenImageAdapter

    adapter = QwenImageAdapter.from_pipeline(TINY_BUILDERS["qwen_image"]())
    x, t = _noise(adapter), torch.tensor([0.9, 0.5])
    cond = adapter.encode_prompt(["a cat", 'a sign that says "hello world"'])
    with torch.no_grad():
        v = adapter.velocity(x, t, cond)
        # Extra padding (another rank's longer prompts, or _pad_text before Ray) is trimmed: bitwise the same.
        assert torch.equal(adapter.velocity(x, t, cond.pad_to(cond.prompt_embeds.shape[1] + 7)), v)
        # A row alone (no padding at all) equals its row in the padded batch up to round-off.
        alone = adapter.velocity(x[:1], t[:1], adapter.encode_prompt(["a cat"]))
    torch.testing.assert_close(alone, v[:1], rtol=1e-4, atol=1e-5)
    # Conditioning.cat pads rows of different lengths with mask 0.
    both = Conditioning.cat([adapter.encode_prompt(["a cat"]), adapter.encode_prompt(['a sign that says "hi"'])])
    assert both.prompt_mask[0].sum() < both.prompt_mask.shape[1] and bool(both.prompt_mask[1].all())


def test_worker_pads_text_for_the_driver():
    from verl_diffusion.workers.worker import _pad_text

    emb, mask = torch.randn(2, 5, 3), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    out = {"prompt_embeds": emb, "prompt_mask": mask, "negative_prompt_embeds": emb[:, :2],
           "negative_prompt_mask": mask[:, :2], "images": torch.zeros(2)}
    _pad_text(out, 8)
    assert out["prompt_embeds"].shape == (2, 8, 3) and out["negative_prompt_embeds"].shape == (2, 8, 3)
    assert torch.equal(out["prompt_embeds"][:, :5], emb) and out["prompt_mask"][:, 5:].sum() == 0
    assert torch.equal(Conditioning.from_dict(out).trimmed().prompt_embeds, emb)
    fixed = {"prompt_embeds": emb}                   # no mask (SD3 / FLUX): untouched
    _pad_text(fixed, 8)
    assert fixed["prompt_embeds"] is emb
