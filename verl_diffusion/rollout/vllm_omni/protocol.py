"""What travels between the vllm-omni replica and our pipelines, in both directions (docs/vllm_omni.md).

Pure Python and torch: no vllm or vllm-omni import, so the replica's driver side and the tests of the main
environment use it too.

Request: the replica draws the whole batch's randomness on its CPU with :func:`plan_rollout` (the RNG order of
``DiffusersRollout.generate``) and sends one vllm-omni request per sample: the prompt, x_{t_0} as the
standard ``sampling_params.latents`` [1, *], and under ``sampling_params.extra_args["verl_diffusion"]`` the
rollout knobs, the window (stochastic and trained steps) and that sample's window noise z_k. The pipeline is
then a pure function of the request, so vllm-omni may batch requests however it likes.

Response: one ``DiffusionOutput`` per request with ``trajectory_latents`` [N+1, *], ``trajectory_timesteps``
[N+1] (the grid t_k) and ``trajectory_log_probs`` [N]; the other per-step tensors the trainer reads (mask,
coefficients, conditioning, v_old) ride in the output envelope's ``payload["trajectory"]`` mapping, which
vllm-omni hands to the client unchanged as ``multimodal_output["trajectory"]``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from verl_diffusion.rollout.diffusers_rollout import RolloutConfig, RolloutPlan

__all__ = ["EXTRA_ARGS_KEY", "SampleRequest", "request_extra_args", "parse_extra_args", "collate_trajectories",
           "TRAJECTORY_TO_ROLLOUT_KEYS", "write_lora_dir", "read_lora_dir"]

# Key of our entry in OmniDiffusionSamplingParams.extra_args.
EXTRA_ARGS_KEY = "verl_diffusion"

# payload["trajectory"] key -> DataProto key (docs/data_flow.md). latents / timesteps / log_probs are also the
# DiffusionOutput.trajectory_* fields of vllm-omni.
TRAJECTORY_TO_ROLLOUT_KEYS = {
    "latents": "all_latents",
    "timesteps": "sigmas",
    "log_probs": "rollout_log_probs",
    "train_mask": "train_mask",
    "sde_cx": "sde_cx",
    "sde_cv": "sde_cv",
    "sde_std": "sde_std",
    "old_velocities": "old_velocities",
    "prompt_embeds": "prompt_embeds",
    "pooled_prompt_embeds": "pooled_prompt_embeds",
    "prompt_mask": "prompt_mask",
    "negative_prompt_embeds": "negative_prompt_embeds",
    "negative_pooled_prompt_embeds": "negative_pooled_prompt_embeds",
    "negative_prompt_mask": "negative_prompt_mask",
    "image": "images",
}


@dataclasses.dataclass
class SampleRequest:
    """One sample's part of a plan, as the pipeline reads it back from a request."""

    cfg: RolloutConfig
    stochastic: tuple[int, ...]
    trained: tuple[int, ...]
    step_noise: torch.Tensor          # [S, *], z_k for the sorted stochastic steps
    store_velocities: bool

    def batch_key(self) -> tuple:
        """Requests with equal keys run as one batch through the same steps."""
        return (json.dumps(dataclasses.asdict(self.cfg), sort_keys=True), self.stochastic, self.trained,
                self.store_velocities)


def request_extra_args(cfg: RolloutConfig, plan: RolloutPlan, index: int, *,
                       store_velocities: bool = False) -> dict[str, Any]:
    """``extra_args`` of the request of sample ``index`` of ``plan`` (its x_{t_0} goes in ``latents``)."""
    noise = [plan.step_noise[k][index] for k in plan.stochastic]
    step_noise = torch.stack(noise) if noise else plan.initial_noise.new_zeros((0, *plan.initial_noise.shape[1:]))
    return {EXTRA_ARGS_KEY: {
        "rollout": dataclasses.asdict(cfg),
        "stochastic": list(plan.stochastic),
        "trained": list(plan.trained),
        "step_noise": step_noise.contiguous(),
        "store_velocities": bool(store_velocities),
    }}


def parse_extra_args(extra_args: Mapping[str, Any] | None) -> SampleRequest:
    """Inverse of :func:`request_extra_args`; a request without our entry is refused with the reason."""
    entry = (extra_args or {}).get(EXTRA_ARGS_KEY)
    if entry is None:
        raise ValueError(
            f"request has no extra_args[{EXTRA_ARGS_KEY!r}]; verl-diffusion pipelines sample only rollouts planned by "
            "the vllm_omni replica (verl_diffusion.rollout.vllm_omni.protocol.request_extra_args)")
    stochastic = tuple(int(k) for k in entry["stochastic"])
    step_noise = entry["step_noise"]
    if step_noise.shape[0] != len(stochastic):
        raise ValueError(f"extra_args step_noise has {step_noise.shape[0]} steps but the window has "
                         f"{len(stochastic)} stochastic steps {list(stochastic)}")
    return SampleRequest(cfg=RolloutConfig(**dict(entry["rollout"])), stochastic=stochastic,
                         trained=tuple(int(k) for k in entry["trained"]), step_noise=step_noise,
                         store_velocities=bool(entry.get("store_velocities", False)))


def collate_trajectories(trajectories: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-sample ``payload["trajectory"]`` mappings (+ ``image``) → the rollout batch (docs/data_flow.md keys).

    Every tensor gets a leading batch dimension; images [3, H, W] uint8 become ``images`` [B, 3, H, W].
    Text whose length varies per prompt (Qwen-Image: ``prompt_embeds`` [L, D] with ``prompt_mask`` [L]) may come
    back with different L from different vllm-omni batches: it is padded with zeros (mask 0) to the longest, as
    the diffusers rollout pads one batch (``Conditioning.cat``); real tokens keep their positions.
    """
    if not trajectories:
        raise ValueError("collate_trajectories got no outputs")
    keys = set(trajectories[0])
    for i, t in enumerate(trajectories):
        if set(t) != keys:
            raise ValueError(f"output {i} has keys {sorted(t)} but output 0 has {sorted(keys)}; one batch must use one "
                             "rollout configuration")
    unknown = keys - set(TRAJECTORY_TO_ROLLOUT_KEYS)
    if unknown:
        raise ValueError(f"unknown trajectory keys {sorted(unknown)}; known: {sorted(TRAJECTORY_TO_ROLLOUT_KEYS)}")
    return {TRAJECTORY_TO_ROLLOUT_KEYS[k]: _stack(k, [torch.as_tensor(t[k]).cpu() for t in trajectories], keys)
            for k in sorted(keys)}


def _stack(key: str, items: list[torch.Tensor], keys: set) -> torch.Tensor:
    lengths = {t.shape[0] if t.dim() else 0 for t in items}
    if len(lengths) > 1 and key.endswith(("prompt_embeds", "prompt_mask")) and not key.endswith("pooled_prompt_embeds"):
        mask_key = key.replace("prompt_embeds", "prompt_mask")
        if mask_key not in keys:
            raise ValueError(f"trajectory {key!r} has text lengths {sorted(lengths)} but no {mask_key!r} to pad with; "
                             "an architecture with a fixed text length returns one length")
        length = max(lengths)
        items = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 1) + (0, length - t.shape[0])) for t in items]
    return torch.stack(items)


# ---------------------------------------------------------------------- LoRA as vllm-omni's LoRARequest reads it

_LORA_CONFIG = "adapter_config.json"
_LORA_WEIGHTS = "adapter_model.safetensors"


def write_lora_dir(path: str | Path, state_dict: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Path:
    """Write a peft-format LoRA directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    ``state_dict``: peft key names as ``get_peft_model_state_dict`` returns them (no adapter name);
    ``config``: at least ``r``, ``lora_alpha`` and ``target_modules``. This is the ``lora_path`` of a vllm-omni
    ``LoRARequest``.
    """
    from safetensors.torch import save_file

    missing = {"r", "lora_alpha", "target_modules"} - set(config)
    if missing:
        raise ValueError(f"LoRA config lacks {sorted(missing)}; pass r, lora_alpha and target_modules")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", **{k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}}
    (path / _LORA_CONFIG).write_text(json.dumps(cfg, sort_keys=True))
    save_file({k: v.detach().cpu().contiguous() for k, v in state_dict.items()}, str(path / _LORA_WEIGHTS))
    return path


def read_lora_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Inverse of :func:`write_lora_dir`: (state_dict, config)."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / _LORA_CONFIG).is_file() or not (path / _LORA_WEIGHTS).is_file():
        raise FileNotFoundError(f"LoRA directory {str(path)!r} lacks {_LORA_CONFIG} or {_LORA_WEIGHTS}; "
                                "write it with verl_diffusion.rollout.vllm_omni.protocol.write_lora_dir")
    return load_file(str(path / _LORA_WEIGHTS)), json.loads((path / _LORA_CONFIG).read_text())
