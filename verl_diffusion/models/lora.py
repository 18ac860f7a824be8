"""LoRA layers injected into a transformer in place (peft, no ``PeftModel`` wrapper): the module keeps its diffusers
class, so FSDP2 still finds ``_no_split_modules``."""

from __future__ import annotations

import os

import torch


def inject_lora(module: torch.nn.Module, model_config) -> torch.nn.Module:
    """peft LoRA layers injected into ``module`` in place (``DiffusionModelConfig``: rank, alpha, targets, init,
    adapter path); only the adapter trains. The engine and a standalone rollout replica build the same layers."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    targets = model_config.target_modules
    targets = list(targets) if not isinstance(targets, str) else targets
    cfg = LoraConfig(r=model_config.lora_rank, lora_alpha=model_config.lora_alpha,
                     target_modules=targets, init_lora_weights=model_config.init_lora_weights,
                     bias="none")
    module.requires_grad_(False)
    inject_adapter_in_model(cfg, module, adapter_name="default")
    if model_config.lora_adapter_path:
        from safetensors.torch import load_file

        path = model_config.lora_adapter_path
        f = os.path.join(path, "adapter_model.safetensors") if os.path.isdir(path) else path
        set_peft_model_state_dict(module, load_file(f), adapter_name="default")
    base_dtype = next((p.dtype for n, p in module.named_parameters() if "lora_" not in n), None)
    for name, p in module.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name and base_dtype is not None and p.dtype != base_dtype:
            p.data = p.data.to(base_dtype)
    return module
