"""Write a trained transformer as a folder that stock diffusers loads, with no verl-diffusion code.

Three kinds (``export_info.json``'s ``kind``):

* ``lora``: ``pytorch_lora_weights.safetensors`` as the pipeline's own ``save_lora_weights`` writes it (keys
  ``transformer.<module>.lora_A.weight``, the adapter's rank, alpha and targets in the file's metadata), read by
  ``pipe.load_lora_weights(dir)`` on the base pipeline;
* ``full``: a complete pipeline folder (``model_index.json``, the trained ``transformer/`` as safetensors, the base
  model's other components hard-linked or copied), read by ``DiffusionPipeline.from_pretrained(dir)``;
* ``merged``: the same pipeline folder with a LoRA folded into the base weights, W + (alpha / r)·B·A.

The state dict comes from the live FSDP module (workers/worker.py, at every save and at the end of a run) or from
a checkpoint's shard files (:mod:`.shards`); keys are the transformer's own, with peft's adapter name
(``.lora_A.default.weight``) for LoRA layers and ``.base_layer.`` for the wrapped base weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Optional

import torch

INFO_NAME = "export_info.json"
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
_ADAPTER_RE = re.compile(r"\.(lora_[AB])\.[^.]+\.weight$")


def lora_keys(state: dict) -> list[str]:
    """The LoRA matrices of a state dict (peft naming ``<module>.lora_A.<adapter>.weight``)."""
    return [k for k in state if _ADAPTER_RE.search(k)]


def diffusers_lora_state(state: dict) -> dict[str, torch.Tensor]:
    """peft-injected LoRA keys → the keys ``save_lora_weights`` takes: the adapter name dropped
    (``blocks.0.attn.to_q.lora_A.default.weight`` → ``blocks.0.attn.to_q.lora_A.weight``)."""
    out = {_ADAPTER_RE.sub(r".\1.weight", k): v.detach().contiguous() for k, v in state.items() if _ADAPTER_RE.search(k)}
    if not out:
        raise ValueError("the state dict holds no LoRA weights (keys '<module>.lora_A.<adapter>.weight'); this run "
                         "trained the full transformer: export it as a pipeline folder")
    return out


def base_state(state: dict) -> dict[str, torch.Tensor]:
    """A full fine-tune's state dict in the plain transformer's naming (peft's ``.base_layer.`` dropped, LoRA
    matrices left out)."""
    return {k.replace(".base_layer.", "."): v for k, v in state.items() if not _ADAPTER_RE.search(k)}


def merge_lora(base: dict, lora: dict, *, rank: int, alpha: float) -> dict[str, torch.Tensor]:
    """W + (alpha / rank)·B·A for every LoRA pair (``lora`` in ``diffusers_lora_state`` naming; ``base`` plain).

    Computed in float32, stored in the base weight's dtype. Raises ValueError for a LoRA whose module has no
    base weight of matching shape."""
    out = dict(base)
    scale = float(alpha) / float(rank)
    for key_a in sorted(k for k in lora if k.endswith(".lora_A.weight")):
        module = key_a[: -len(".lora_A.weight")]
        a, b = lora[key_a].float(), lora[f"{module}.lora_B.weight"].float()
        w = out.get(f"{module}.weight")
        if w is None or w.shape != (b.shape[0], a.shape[1]):
            raise ValueError(f"LoRA on {module!r} has no base weight of shape {(b.shape[0], a.shape[1])} to merge into")
        out[f"{module}.weight"] = (w.float() + scale * (b @ a)).to(w.dtype)
    return out


def lora_metadata(lora: dict[str, Any]) -> dict:
    """The adapter's peft ``LoraConfig`` as a dict (what diffusers' training scripts store as
    ``transformer_lora_adapter_metadata``): ``load_lora_weights`` rebuilds rank, alpha and targets from it."""
    from peft import LoraConfig

    targets = lora["target_modules"]
    targets = targets if isinstance(targets, str) else sorted(str(t) for t in targets)
    cfg = LoraConfig(r=int(lora["rank"]), lora_alpha=float(lora["alpha"]), target_modules=targets,
                     init_lora_weights=True, bias="none").to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}


def pipeline_class(base_path: str):
    import diffusers

    from verl_diffusion.models.base import pipeline_class_name

    name = pipeline_class_name(base_path)
    cls = getattr(diffusers, name, None)
    if cls is None:
        raise ValueError(f"{base_path}/model_index.json names {name!r}, which diffusers does not export")
    return cls


def _link_or_copy(src: str, dst: str) -> str:
    """A hard link where the file system allows (a pipeline's text encoders are gigabytes), else a copy."""
    try:
        os.link(src, dst)
        return dst
    except OSError:
        return shutil.copy2(src, dst)


def _write_pipeline(base_path: str, transformer_state: dict, out: str, dtype: Optional[torch.dtype]) -> None:
    """``out``: the base pipeline folder with ``transformer/`` replaced by ``transformer_state``."""
    from verl_diffusion.models.base import transformer_class

    cls = transformer_class(base_path, "transformer")
    config = cls.load_config(base_path, subfolder="transformer")
    with torch.device("meta"):
        model = cls.from_config(config)
    model.load_state_dict(transformer_state, strict=True, assign=True)
    if dtype is not None:
        model.to(dtype)
    for name in sorted(os.listdir(base_path)):
        src = os.path.join(base_path, name)
        if name == "transformer" or name in (INFO_NAME, "README.md", "MANIFEST.json"):
            continue
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(out, name), copy_function=_link_or_copy)
        elif name.endswith(".json"):
            shutil.copy2(src, os.path.join(out, name))
    model.save_pretrained(os.path.join(out, "transformer"), safe_serialization=True)


def write_export(state: dict, info: dict, output: str, *, merge: bool = False,
                 dtype: Optional[torch.dtype] = None) -> str:
    """Write ``state`` (the trained transformer's weights, see the module docstring) into ``output``, atomically
    (a finished export replaces the previous one whole). Returns ``output``.

    ``info``: ``base_model`` (the local diffusers folder the run trained), ``lora`` ({rank, alpha, target_modules})
    or None for a full fine-tune, and whatever describes the weights (step, algorithm, reward, weights "ema" or
    "trained", sampling settings); written to ``export_info.json`` with ``kind`` added. ``merge``: fold a LoRA into
    a full pipeline folder. ``dtype``: cast the written transformer (default: as trained)."""
    base = str(info["base_model"])
    lora = info.get("lora")
    kind = "full" if not lora else ("merged" if merge else "lora")
    output = os.path.abspath(output)
    tmp = output + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    if kind == "lora":
        tensors = diffusers_lora_state(state)
        if dtype is not None:
            tensors = {k: v.to(dtype) for k, v in tensors.items()}
        pipeline_class(base).save_lora_weights(tmp, transformer_lora_layers=tensors,
                                               transformer_lora_adapter_metadata=lora_metadata(lora))
    elif kind == "merged":
        from safetensors.torch import load_file

        from verl_diffusion.models.base import transformer_weight_files

        plain: dict = {}
        for f in transformer_weight_files(base):
            plain.update(load_file(f))
        merged = merge_lora(plain, diffusers_lora_state(state), rank=int(lora["rank"]), alpha=float(lora["alpha"]))
        _write_pipeline(base, merged, tmp, dtype)
    else:
        _write_pipeline(base, base_state(state), tmp, dtype)
    full = dict(info, kind=kind)
    with open(os.path.join(tmp, INFO_NAME), "w") as f:
        json.dump(full, f, indent=1, sort_keys=True, default=str)
    with open(os.path.join(tmp, "README.md"), "w") as f:
        f.write(readme_text(full, output))
    old = output + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(output):
        os.replace(output, old)
    os.replace(tmp, output)
    shutil.rmtree(old, ignore_errors=True)
    return output


def pipeline_kwargs(architecture: Optional[str], sampling: dict) -> str:
    """The stock pipeline's keyword arguments for the validation's settings that its defaults do not match
    (", name=value ..."): the CFG scale under the name the pipeline reads it by, and the text-encoder length.
    Each pipeline's own defaults differ from a run's (SD3 samples with CFG 7.0 and 256 T5 tokens; the adapters cap
    the length at the tokenizer's, which changes the images of a model with a short tokenizer). Qwen-Image and
    FLUX.1 take CFG as ``true_cfg_scale`` (their ``guidance_scale`` is the distilled guidance); SD3 and
    FLUX.2-klein as ``guidance_scale``."""
    if architecture is None:
        return ""
    out = ""
    if sampling.get("guidance_scale") is not None:
        g = float(sampling["guidance_scale"])
        name = "true_cfg_scale" if architecture in ("QwenImagePipeline", "FluxPipeline") else "guidance_scale"
        out += f", {name}={g}"
        negative = sampling.get("negative_prompt") or ""
        if g != 1.0 and negative and architecture != "Flux2KleinPipeline":
            out += f", negative_prompt={negative!r}"
    if sampling.get("max_sequence_length") is not None:
        out += f", max_sequence_length={int(sampling['max_sequence_length'])}"
    return out


def readme_text(info: dict, path: str) -> str:
    """What the folder holds and the stock-diffusers lines that load it."""
    s = info.get("sampling") or {}
    size = int(s.get("resolution", 512))
    steps = int(s.get("num_steps", 28))
    call = (f'pipe("a photo of a red circle", height={size}, width={size}, num_inference_steps={steps}'
            f'{pipeline_kwargs(info.get("architecture"), s)})')
    if info["kind"] == "lora":
        load = (f'pipe = DiffusionPipeline.from_pretrained("{info["base_model"]}")\n'
                f'pipe.load_lora_weights("{path}")')
        what = (f"A LoRA adapter (rank {info['lora']['rank']}, alpha {info['lora']['alpha']}) for the base model "
                f"`{info['base_model']}`, in diffusers' format ({LORA_WEIGHT_NAME}).")
    else:
        load = f'pipe = DiffusionPipeline.from_pretrained("{path}")'
        what = ("A complete diffusers pipeline folder" + (" (LoRA merged into the base weights)"
                                                           if info["kind"] == "merged" else "") + ".")
    facts = [f"- {k}: {info[k]}" for k in ("step", "algorithm", "reward", "weights", "validation", "source")
             if info.get(k) not in (None, "", {})]
    return (f"# Trained with verl-diffusion\n\n{what}\n\n" + "\n".join(facts) +
            f"\n\n```python\nfrom diffusers import DiffusionPipeline\n{load}\n{call}.images[0].save(\"sample.png\")\n```\n"
            f"\nSampling settings of the run's validation: {json.dumps(s, sort_keys=True)}\n")
