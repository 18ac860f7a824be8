"""Rollout-side settings read from the composed config: the sampler's :class:`RolloutConfig`, the model adapter class
and its options, the TempFlow branched-rollout settings and the LoRA layout. The actor worker and the standalone
replicas build the same objects from the same nodes, so they live here, below both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from omegaconf import DictConfig, OmegaConf


def torch_dtype(name: str) -> torch.dtype:
    table = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
             "fp16": torch.float16, "float16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype={name!r} is unknown; choose one of {sorted(table)}")
    return table[name]


def _plain(node) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def build_rollout_config(rollout_cfg: DictConfig):
    """Our RolloutConfig from ``actor_rollout_ref.rollout`` (sde.{type,noise_level,window}, steps, size)."""
    from verl_diffusion.rollout.diffusers_rollout import RolloutConfig

    sde = _plain(rollout_cfg.get("sde", {})) or {}
    res = rollout_cfg.get("resolution", 512)
    return RolloutConfig(
        num_steps=int(rollout_cfg.get("num_steps", 10)),
        grid=str(rollout_cfg.get("grid", "scheduler")),
        shift=float(rollout_cfg.get("shift", 3.0)),
        sampler=str(sde.get("type", "flow_sde")),
        noise_level=float(sde.get("noise_level", 0.7)),
        window=dict(sde.get("window", {}) or {}),
        log_prob_convention=str(sde.get("log_prob_convention", "exact")),
        same_noise_per_group=bool(rollout_cfg.get("same_noise_per_group", False)),
        guidance_scale=float(rollout_cfg.get("guidance_scale", 1.0)),
        negative_prompt=str(rollout_cfg.get("negative_prompt", "") or ""),
        height=int(res), width=int(res),
        micro_batch_size=int(rollout_cfg.get("micro_batch_size", 8)),
        store_velocities=False,
        val_num_steps=int(rollout_cfg.get("val_num_steps", 40)),
    )


def model_adapter_cls(model_cfg):
    """The adapter class of ``actor_rollout_ref.model``: ``architecture`` when set, else the one the model
    directory's ``model_index.json`` names (models.PIPELINE_ARCHITECTURES)."""
    from verl_diffusion.models import adapter_for_path, get_adapter_cls

    name = model_cfg.get("architecture", None)
    return get_adapter_cls(str(name)) if name else adapter_for_path(str(model_cfg.path))


def adapter_kwargs(model_cfg) -> dict:
    """``actor_rollout_ref.model.adapter_kwargs`` (constructor options of the adapter, e.g. FLUX.1's
    distilled_guidance_scale), checked against the adapter's signature."""
    import inspect

    kwargs = dict(_plain(model_cfg.get("adapter_kwargs", None)) or {})
    cls = model_adapter_cls(model_cfg)
    params = inspect.signature(cls.__init__).parameters
    unknown = sorted(set(kwargs) - {n for n, p in params.items() if p.kind == p.KEYWORD_ONLY})
    if unknown:
        accepted = sorted(n for n, p in params.items() if p.kind == p.KEYWORD_ONLY)
        raise ValueError(f"model.adapter_kwargs has {unknown}, which {cls.__name__} does not take; accepted: {accepted}")
    return kwargs


def branched_settings(rollout_cfg) -> Optional[dict]:
    """``actor_rollout_ref.rollout.branched`` as {num_children, branch_steps (sorted list)} when enabled, else None."""
    from verl_diffusion.rollout.branched import resolve_branch_steps

    br = _plain(rollout_cfg.get("branched", None)) or {}
    if not bool(br.get("enabled", False)):
        return None
    kb = br.get("num_children", 2)
    if isinstance(kb, bool) or not isinstance(kb, int) or kb < 2:
        raise ValueError(f"rollout.branched.num_children={kb!r} must be an int >= 2 (the process advantages are "
                         "normalised across the children of one (prompt, k); one child gets 0)")
    steps = resolve_branch_steps(br.get("branch_steps", None), int(rollout_cfg.get("num_steps", 10)))
    return {"num_children": kb, "branch_steps": steps}


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA layout of ``actor_rollout_ref.model`` (what ``models.lora.inject_lora`` reads): the actor's engine and a
    standalone replica inject exactly the same layers."""

    lora_rank: int
    lora_alpha: int
    target_modules: Union[list, str]
    init_lora_weights: Any = True
    lora_adapter_path: Optional[str] = None


def lora_settings(m) -> LoraSettings:
    """``model.lora_rank`` etc.; ``target_modules`` unset or "all-linear": the architecture's own list (every attention /
    feed-forward projection for Qwen-Image and FLUX, Flow-GRPO's joint-attention projections for SD3)."""
    targets = _plain(m.get("target_modules", None))
    if targets in (None, "all-linear"):
        targets = model_adapter_cls(m).LORA_TARGETS
    targets = targets if isinstance(targets, str) else list(targets)
    return LoraSettings(lora_rank=int(m.get("lora_rank", 0) or 0), lora_alpha=int(m.get("lora_alpha", 16)),
                        target_modules=targets, init_lora_weights=m.get("init_lora_weights", True),
                        lora_adapter_path=m.get("lora_adapter_path", None))
