"""The trained model out of a run, into folders stock diffusers loads (verl_diffusion/export).

Per architecture (tiny SD3, Qwen-Image, FLUX.1, FLUX.2-klein models, built offline and saved): a full fine-tune's
weights written as a pipeline folder, and a LoRA written in diffusers' LoRA format, are loaded by the stock pipeline
(``DiffusionPipeline.from_pretrained`` / ``load_lora_weights``, no verl-diffusion code) and sample, from the same
prompts and noise, what our own ODE validation samples with the trained weights; a merged LoRA samples the same
within float rounding. A checkpoint sharded over 2 FSDP2 ranks gathers to the same tensors as one over 1 rank.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from export_stock import seeded_noise, stock_images
from verl_diffusion.export.shards import gather_state_dict, shard_files
from verl_diffusion.export.writer import INFO_NAME, LORA_WEIGHT_NAME, merge_lora, pipeline_kwargs, write_export
from verl_diffusion.models import get_adapter_cls
from verl_diffusion.models.tiny import save_tiny
from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout, RolloutConfig

ARCHS = ["sd3", "qwen_image", "flux", "flux2_klein"]
PROMPTS = ["a red cat", "a blue square"]
SEEDS = [3, 11]
SIZE, STEPS = 64, 4


@pytest.fixture(scope="module", params=ARCHS)
def base(request, tmp_path_factory):
    return request.param, str(save_tiny(request.param, tmp_path_factory.mktemp(request.param) / "base"))


def _adapter(path):
    from verl_diffusion.models import adapter_for_path

    return adapter_for_path(path).from_pretrained(path)


def _ours(adapter, guidance=1.0) -> torch.Tensor:
    """What the trainer's validation samples: our Euler ODE on the model's scheduler grid (uint8 images)."""
    cfg = RolloutConfig(num_steps=STEPS, grid="scheduler", sampler="ode", height=SIZE, width=SIZE,
                        guidance_scale=guidance, val_num_steps=STEPS)
    return DiffusersRollout(adapter, cfg).generate_ode(PROMPTS, seeds=SEEDS)


def _stock(pipe, adapter) -> torch.Tensor:
    pipe.set_progress_bar_config(disable=True)
    noise = seeded_noise(adapter.latent_shape(SIZE, SIZE), SEEDS)
    return stock_images(pipe, adapter, PROMPTS, noise, steps=STEPS, size=SIZE)


def _perturb(params, seed=0, scale=0.05):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _info(base_path, lora=None):
    return {"base_model": base_path, "lora": lora, "step": 2, "algorithm": "test", "weights": "trained",
            "sampling": {"num_steps": STEPS, "resolution": SIZE}}


def _close(a: torch.Tensor, b: torch.Tensor, levels: int = 1) -> None:
    """uint8 images equal up to ``levels`` grey levels (float rounding of two mathematically equal programs)."""
    diff = (a.int() - b.int()).abs()
    assert a.shape == b.shape and int(diff.max()) <= levels, (a.shape, b.shape, int(diff.max()))


def test_full_finetune_exports_a_pipeline_folder_that_samples_what_validation_samples(base, tmp_path):
    from diffusers import DiffusionPipeline

    arch, path = base
    adapter = _adapter(path)
    _perturb(adapter.transformer.parameters())
    ours = _ours(adapter)
    out = write_export(adapter.transformer.state_dict(), _info(path), str(tmp_path / "model"))
    info = json.loads(open(os.path.join(out, INFO_NAME)).read())
    assert info["kind"] == "full" and os.path.isfile(os.path.join(out, "model_index.json"))
    pipe = DiffusionPipeline.from_pretrained(out)
    assert type(pipe).__name__ == adapter.architecture
    loaded = pipe.transformer.state_dict()
    for k, v in adapter.transformer.state_dict().items():
        assert torch.equal(loaded[k], v), k
    _close(_stock(pipe, _adapter(out)), ours)
    assert not os.path.exists(out + ".tmp") and not os.path.exists(out + ".old")


def test_lora_exports_diffusers_lora_weights_and_a_merged_folder(base, tmp_path):
    from diffusers import DiffusionPipeline

    arch, path = base
    adapter = _adapter(path)
    rank, alpha = 4, 8.0   # alpha != rank: the scale comes from the file's metadata, not a default
    adapter.add_lora(rank, alpha)
    _perturb([p for n, p in adapter.transformer.named_parameters() if "lora_" in n], scale=0.2)
    ours = _ours(adapter)
    lora = {"rank": rank, "alpha": alpha, "target_modules": adapter.lora_targets()}
    state = {k: v for k, v in adapter.transformer.state_dict().items() if "lora_" in k}
    out = write_export(state, _info(path, lora), str(tmp_path / "lora"))
    assert sorted(os.listdir(out)) == sorted([LORA_WEIGHT_NAME, INFO_NAME, "README.md"])
    pipe = DiffusionPipeline.from_pretrained(path)
    untouched = _stock(pipe, get_adapter_cls(arch).from_pipeline(pipe))
    assert int((untouched.int() - ours.int()).abs().max()) > 4   # the LoRA changes the images: the test can fail
    pipe.load_lora_weights(out)
    stock_adapter = get_adapter_cls(arch).from_pipeline(pipe)
    _close(_stock(pipe, stock_adapter), ours)

    merged = write_export(state, _info(path, lora), str(tmp_path / "merged"), merge=True)
    assert json.loads(open(os.path.join(merged, INFO_NAME)).read())["kind"] == "merged"
    mpipe = DiffusionPipeline.from_pretrained(merged)
    _close(_stock(mpipe, _adapter(merged)), ours, levels=2)


def test_model_card_names_the_validation_settings_in_each_pipelines_terms():
    """The card's sampling line passes the run's CFG scale under the name the stock pipeline reads it by, and the
    text length the run encoded prompts with (each pipeline's defaults differ: SD3's CFG 7.0 and 256 tokens)."""
    assert pipeline_kwargs("StableDiffusion3Pipeline", {"guidance_scale": 1.0, "max_sequence_length": 12}) == \
        ", guidance_scale=1.0, max_sequence_length=12"
    assert pipeline_kwargs("StableDiffusion3Pipeline", {"guidance_scale": 4.5, "negative_prompt": "blurry"}) == \
        ", guidance_scale=4.5, negative_prompt='blurry'"
    assert pipeline_kwargs("QwenImagePipeline", {"guidance_scale": 4.0, "negative_prompt": " "}) == \
        ", true_cfg_scale=4.0, negative_prompt=' '"
    assert pipeline_kwargs("FluxPipeline", {"guidance_scale": 1.0, "max_sequence_length": 512}) == \
        ", true_cfg_scale=1.0, max_sequence_length=512"
    assert pipeline_kwargs("Flux2KleinPipeline", {"guidance_scale": 4.0, "negative_prompt": "x"}) == ", guidance_scale=4.0"
    assert pipeline_kwargs(None, {"guidance_scale": 4.0}) == pipeline_kwargs("FluxPipeline", {}) == ""


def test_model_card_call_samples_with_the_validation_settings(tmp_path):
    """The card's line, run as written on a tiny SD3 export (with a seeded generator added), gives the images of the
    stock pipeline at the validation's settings (CFG off, the run's text length), not those of its defaults."""
    import re

    from diffusers import DiffusionPipeline

    path = str(save_tiny("sd3", tmp_path / "base"))
    adapter = _adapter(path)
    info = dict(_info(path), architecture=adapter.architecture)
    info["sampling"].update(guidance_scale=1.0, max_sequence_length=adapter.max_sequence_length)
    out = write_export(adapter.transformer.state_dict(), info, str(tmp_path / "model"))
    card = open(os.path.join(out, "README.md")).read()
    inner = re.search(r"^pipe\((.*)\)\.images\[0\]", card, re.M).group(1)
    args, kwargs = eval(f"(lambda *a, **k: (a, k))({inner})")  # noqa: S307 - the card's own call
    pipe = DiffusionPipeline.from_pretrained(out)
    pipe.set_progress_bar_config(disable=True)

    def images(*a, **k):
        return pipe(*a, **k, generator=torch.Generator().manual_seed(0), output_type="pt").images

    card_images = images(*args, **kwargs)
    assert kwargs["guidance_scale"] == 1.0 and (kwargs["height"], kwargs["num_inference_steps"]) == (SIZE, STEPS)
    assert kwargs["max_sequence_length"] == adapter.max_sequence_length < 256
    assert torch.equal(card_images, images(args[0], height=SIZE, width=SIZE, num_inference_steps=STEPS,
                                           guidance_scale=1.0, max_sequence_length=adapter.max_sequence_length))
    # the pipeline's defaults (CFG 7, 256 tokens) and each one alone sample other images: the test can fail
    for k in ({}, {"guidance_scale": 1.0}, {"max_sequence_length": adapter.max_sequence_length}):
        other = images(args[0], height=SIZE, width=SIZE, num_inference_steps=STEPS, **k)
        assert float((other - card_images).abs().max()) > 0.01, k


def test_merge_lora_is_w_plus_scaled_b_a():
    a, b, w = torch.randn(2, 3), torch.randn(4, 2), torch.randn(4, 3)
    out = merge_lora({"m.weight": w}, {"m.lora_A.weight": a, "m.lora_B.weight": b}, rank=2, alpha=8.0)
    assert torch.allclose(out["m.weight"], w + 4.0 * b @ a)
    with pytest.raises(ValueError, match="no base weight"):
        merge_lora({}, {"m.lora_A.weight": a, "m.lora_B.weight": b}, rank=2, alpha=8.0)


SHARD_SCRIPT = r'''
import os, sys, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from verl_diffusion.models.base import transformer_class
rank, world, path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[5])
dist.init_process_group("gloo", rank=rank, world_size=world)
model = transformer_class(path).from_pretrained(path, subfolder="transformer")
for block in model.transformer_blocks:
    fully_shard(block)
fully_shard(model)
torch.save(model.state_dict(), os.path.join(out, f"model_world_size_{world}_rank_{rank}.pt"))
dist.barrier()
dist.destroy_process_group()
'''


def _shard(path, out, world, port):
    os.makedirs(out, exist_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", SHARD_SCRIPT, str(r), str(world), path, out, str(port)])
             for r in range(world)]
    assert all(p.wait(timeout=300) == 0 for p in procs)


def test_checkpoint_shards_of_two_ranks_gather_to_the_one_rank_checkpoint(tmp_path):
    from safetensors.torch import load_file

    path = str(save_tiny("sd3", tmp_path / "base"))
    _shard(path, str(tmp_path / "w1"), 1, 29631)
    _shard(path, str(tmp_path / "w2"), 2, 29632)
    assert len(shard_files(str(tmp_path / "w2"))) == 2
    one, two = gather_state_dict(str(tmp_path / "w1")), gather_state_dict(str(tmp_path / "w2"))
    original = load_file(os.path.join(path, "transformer", "diffusion_pytorch_model.safetensors"))
    assert list(one) == list(two) and set(one) == set(original)
    for k in one:
        assert torch.equal(one[k], two[k]) and torch.equal(one[k], original[k]), k
    os.remove(tmp_path / "w2" / "model_world_size_2_rank_1.pt")
    with pytest.raises(ValueError, match="ranks \\[1\\] are missing"):
        shard_files(str(tmp_path / "w2"))
