"""vllm-omni's engine serving our SD3 pipeline on a GPU: generate, LoRA through add/remove LoRA, full weights
through collective_rpc, sleep / wake (docs/vllm_omni.md, "What runs where").

vllm-omni has no CPU platform, so its worker processes start only on a GPU host with
``pip install -e '.[vllm-omni]'``; ``bash scripts/gpu_smoke.sh`` runs this file there.
"""

import asyncio

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("vllm-omni's diffusion engine needs a CUDA GPU (it has no CPU platform); bash scripts/gpu_smoke.sh "
                "runs this on a GPU host", allow_module_level=True)
pytest.importorskip("vllm_omni", reason="vllm-omni is not installed: pip install -e '.[vllm-omni]' on a GPU host")

from omegaconf import OmegaConf  # noqa: E402
from vllm_omni_cases import generate_request, rollout_config  # noqa: E402

from verl_diffusion.algos.sde import StepCoefficients, gaussian_log_prob, step_mean  # noqa: E402
from verl_diffusion.models.base import Conditioning  # noqa: E402
from verl_diffusion.models.sd3 import SD3Adapter  # noqa: E402
from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout  # noqa: E402
from verl_diffusion.rollout.vllm_omni.replica import VllmOmniServerAdapter  # noqa: E402

LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]


@pytest.fixture(scope="module")
def served(tiny_sd3_path):
    config = OmegaConf.create({"num_steps": 6, "resolution": 64, "micro_batch_size": 6, "dtype": "float32",
                               "enable_sleep_mode": True,
                               "sde": {"type": "flow_sde", "noise_level": 0.7,
                                       "window": {"mode": "fixed", "size": 2, "lo": 1, "hi": 6}}})
    model = OmegaConf.create({"path": tiny_sd3_path, "lora_rank": 4, "lora_alpha": 8, "target_modules": LORA_TARGETS})
    return VllmOmniServerAdapter(config=config, model_config=model, replica_rank=0)


def reference_batch(adapter, request):
    return DiffusersRollout(adapter, rollout_config()).generate(request["prompts"], torch.tensor(request["group_ids"]),
                                                                seed=request["seed"] * 1000, store_velocities=True)


def consistency_gap(adapter, batch) -> float:
    """mean |log π_train − log π_rollout| over trained steps, the trainer recomputing on its own device."""
    cond = Conditioning.from_dict({k: v.cuda() for k, v in batch.items() if "prompt" in k})
    gaps = []
    for k in torch.nonzero(batch["train_mask"].any(0)).flatten().tolist():
        x, x1 = batch["all_latents"][:, k].cuda(), batch["all_latents"][:, k + 1].cuda()
        with torch.no_grad():
            v = adapter.velocity(x, batch["sigmas"][:, k].cuda(), cond)
        coef = StepCoefficients(*(batch[n][:, k].cuda() for n in ("sde_cx", "sde_cv", "sde_std")))
        lp = gaussian_log_prob(x1, step_mean(x, v, coef), coef.std)
        gaps.append((lp.cpu() - batch["rollout_log_probs"][:, k]).abs())
    return torch.cat(gaps).mean().item()


def test_engine_generates_the_diffusers_rollout(served, tiny_sd3_path):
    request = generate_request(seed=3)
    out = served.serve(request)
    ref = reference_batch(SD3Adapter.from_pretrained(tiny_sd3_path, device="cuda"), request)
    batch = out["batch"]
    for key in ("all_latents", "rollout_log_probs", "sde_cx", "sde_std", "train_mask", "prompt_embeds"):
        torch.testing.assert_close(batch[key], ref[key], rtol=1e-4, atol=1e-4, msg=key)
    bitwise = all(torch.equal(batch[k], ref[k]) for k in ref)
    gap = consistency_gap(SD3Adapter.from_pretrained(tiny_sd3_path, device="cuda"), batch)
    print(f"\nvllm-omni vs diffusers on GPU: bitwise={bitwise}; train/rollout mean |Δ log π| = {gap:.3e}")
    assert gap < 1e-4 and out["extra_fields"]["global_steps"] == 0


def test_lora_then_full_weights_then_sleep_and_wake(served, tiny_sd3_path):
    from peft import LoraConfig, inject_adapter_in_model

    trained = SD3Adapter.from_pretrained(tiny_sd3_path, device="cuda")
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, bias="none"),
                            trained.transformer, adapter_name="default")
    with torch.no_grad():
        for n, p in trained.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    named = [(n, p.detach().cpu()) for n, p in trained.transformer.named_parameters() if "lora_" in n]
    for step in (1, 2):                        # two syncs: add_lora(new) + remove_lora(old) each time
        asyncio.run(served.update_weights(iter(named), global_steps=step))
    request = generate_request(seed=5)
    out = served.serve(request)
    assert out["extra_fields"]["global_steps"] == 2
    assert served._engine.call(served._engine.engine.list_loras()) in ([2], [[2]])
    torch.testing.assert_close(out["batch"]["rollout_log_probs"], reference_batch(trained, request)["rollout_log_probs"],
                               rtol=1e-4, atol=1e-4)

    full = SD3Adapter.from_pretrained(tiny_sd3_path, device="cuda")
    with torch.no_grad():
        for p in full.transformer.parameters():
            p.add_(0.01 * torch.randn_like(p))
    served.load_full({k: v.cpu() for k, v in full.transformer.state_dict().items()})
    served._engine.call(served._engine.engine.remove_lora(2))
    before = served.serve(request)["batch"]
    torch.testing.assert_close(before["all_latents"], reference_batch(full, request)["all_latents"],
                               rtol=1e-4, atol=1e-4)
    free0 = torch.cuda.mem_get_info()[0]
    served.sleep_engine()
    freed = torch.cuda.mem_get_info()[0] - free0
    served.wake_up_engine()
    after = served.serve(request)["batch"]
    print(f"\nsleep(level=1) freed {freed / 2**20:.1f} MiB on the device")
    assert torch.equal(after["all_latents"], before["all_latents"])
