"""vllm-omni's engine serving our pipelines on a GPU, for SD3, Qwen-Image, FLUX.1 and FLUX.2 [klein]: generate,
LoRA through add/remove LoRA, full weights through collective_rpc, sleep / wake (docs/vllm_omni.md, "What runs
where").

vllm-omni has no CPU platform (and its worker layer needs torchvision, which has no CPU wheel here), so its worker
processes start only on a GPU host with ``pip install -e '.[vllm-omni]'``; ``bash scripts/gpu_smoke.sh vllm-omni``
runs this file there. One engine per architecture (module-scoped, shut down before the next starts).
"""

import asyncio

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("vllm-omni's diffusion engine needs a CUDA GPU (it has no CPU platform, and its worker layer needs "
                "torchvision); bash scripts/gpu_smoke.sh vllm-omni runs this on a GPU host", allow_module_level=True)
pytest.importorskip("vllm_omni", reason="vllm-omni is not installed: pip install -e '.[vllm-omni]' on a GPU host")

from omegaconf import OmegaConf  # noqa: E402
from vllm_omni_cases import generate_request, rollout_config  # noqa: E402

from verl_diffusion.algos.sde import StepCoefficients, gaussian_log_prob, step_mean  # noqa: E402
from verl_diffusion.models import get_adapter_cls  # noqa: E402
from verl_diffusion.models.base import Conditioning  # noqa: E402
from verl_diffusion.models.tiny import save_tiny  # noqa: E402
from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout  # noqa: E402
from verl_diffusion.rollout.vllm_omni.replica import VllmOmniServerAdapter  # noqa: E402

# architecture -> rollout overrides (each runs the model's scheduler grid; CFG where the model uses it)
CASES = {"sd3": {"grid": "formula"}, "qwen_image": {"guidance_scale": 4.0, "negative_prompt": " "}, "flux": {},
         "flux2_klein": {"guidance_scale": 3.0}}


def _cfg(arch):
    return rollout_config(**{"grid": "scheduler", **CASES[arch]})


@pytest.fixture(scope="module", params=sorted(CASES))
def served(request, tmp_path_factory):
    arch = request.param
    path = str(save_tiny(arch, tmp_path_factory.mktemp("vllm_omni_gpu") / arch))
    cfg = _cfg(arch)
    config = OmegaConf.create({"num_steps": cfg.num_steps, "resolution": 64, "micro_batch_size": 6, "dtype": "float32",
                               "grid": cfg.grid, "guidance_scale": cfg.guidance_scale,
                               "negative_prompt": cfg.negative_prompt, "enable_sleep_mode": True,
                               "sde": {"type": "flow_sde", "noise_level": 0.7,
                                       "window": {"mode": "fixed", "size": 2, "lo": 1, "hi": 6}}})
    model = OmegaConf.create({"path": path, "lora_rank": 4, "lora_alpha": 8, "target_modules": "all-linear"})
    adapter = VllmOmniServerAdapter(config=config, model_config=model, replica_rank=0)
    assert adapter.cfg == cfg, "the served rollout settings must be the reference's"
    yield arch, path, adapter
    adapter.shutdown_engine()


def _adapter(arch, path):
    return get_adapter_cls(arch).from_pretrained(path, device="cuda")


def reference_batch(adapter, arch, request):
    return DiffusersRollout(adapter, _cfg(arch)).generate(request["prompts"], torch.tensor(request["group_ids"]),
                                                          seed=request["seed"] * 1000, store_velocities=True)


def consistency_gap(adapter, arch, batch) -> float:
    """mean |log π_train − log π_rollout| over trained steps, the trainer recomputing on its own device."""
    scale = _cfg(arch).guidance_scale
    cond = Conditioning.from_dict({k: v.cuda() for k, v in batch.items() if k.startswith("prompt")
                                   or k == "pooled_prompt_embeds"})
    neg = None if scale == 1.0 else Conditioning.from_dict(
        {k[len("negative_"):]: v.cuda() for k, v in batch.items() if k.startswith("negative_")})
    gaps = []
    for k in torch.nonzero(batch["train_mask"].any(0)).flatten().tolist():
        x, x1 = batch["all_latents"][:, k].cuda(), batch["all_latents"][:, k + 1].cuda()
        with torch.no_grad():
            v = adapter.velocity(x, batch["sigmas"][:, k].cuda(), cond, guidance_scale=scale, negative_cond=neg)
        coef = StepCoefficients(*(batch[n][:, k].cuda() for n in ("sde_cx", "sde_cv", "sde_std")))
        lp = gaussian_log_prob(x1, step_mean(x, v, coef), coef.std)
        gaps.append((lp.cpu() - batch["rollout_log_probs"][:, k]).abs())
    return torch.cat(gaps).mean().item()


def test_engine_generates_the_diffusers_rollout(served):
    arch, path, adapter = served
    request = generate_request(seed=3)
    out = adapter.serve(request)
    ref = reference_batch(_adapter(arch, path), arch, request)
    batch = out["batch"]
    for key in ("all_latents", "rollout_log_probs", "sde_cx", "sde_std", "train_mask", "prompt_embeds"):
        torch.testing.assert_close(batch[key], ref[key], rtol=1e-4, atol=1e-4, msg=key)
    diff = max((batch[k].double() - ref[k].double()).abs().max().item() for k in ("all_latents", "rollout_log_probs"))
    gap = consistency_gap(_adapter(arch, path), arch, batch)
    print(f"\n{arch}: vllm-omni engine vs diffusers on GPU: max |Δ| = {diff:.2e}; train/rollout mean |Δ log π| = "
          f"{gap:.3e}")
    assert gap < 1e-4 and out["extra_fields"]["global_steps"] == 0


def test_lora_then_full_weights_then_sleep_and_wake(served):
    from peft import LoraConfig, inject_adapter_in_model

    arch, path, adapter = served
    trained = _adapter(arch, path)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=trained.lora_targets(), bias="none"),
                            trained.transformer, adapter_name="default")
    with torch.no_grad():
        for n, p in trained.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    named = [(n, p.detach().cpu()) for n, p in trained.transformer.named_parameters() if "lora_" in n]
    for step in (1, 2):                        # two syncs: add_lora(new) + remove_lora(old) each time
        asyncio.run(adapter.update_weights(iter(named), global_steps=step))
    request = generate_request(seed=5)
    out = adapter.serve(request)
    assert out["extra_fields"]["global_steps"] == 2
    engine = adapter._engine
    assert engine.call(engine.engine.list_loras()) in ([2], [[2]])
    torch.testing.assert_close(out["batch"]["rollout_log_probs"],
                               reference_batch(trained, arch, request)["rollout_log_probs"], rtol=1e-4, atol=1e-4)

    full = _adapter(arch, path)
    with torch.no_grad():
        for p in full.transformer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    adapter.load_full({k: v.cpu() for k, v in full.transformer.state_dict().items()})
    engine.call(engine.engine.remove_lora(2))
    before = adapter.serve(request)["batch"]
    torch.testing.assert_close(before["all_latents"], reference_batch(full, arch, request)["all_latents"],
                               rtol=1e-4, atol=1e-4)
    free0 = torch.cuda.mem_get_info()[0]
    adapter.sleep_engine()
    freed = torch.cuda.mem_get_info()[0] - free0
    adapter.wake_up_engine()
    after = adapter.serve(request)["batch"]
    print(f"\n{arch}: sleep(level=1) freed {freed / 2**20:.1f} MiB on the device")
    assert torch.equal(after["all_latents"], before["all_latents"])
