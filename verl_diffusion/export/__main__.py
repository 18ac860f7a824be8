"""``python -m verl_diffusion.export PATH --output DIR [--merge-lora] [--weights ema|trained] [--dtype ...]``

Converts a checkpoint of any world size into a folder that stock diffusers loads (export/writer.py), on the CPU:
PATH is a run directory (its newest complete checkpoint under ``checkpoints/``), a checkpoints folder, or one
``global_step_<k>`` folder. The checkpoint's ``model_info.json`` (written with every save) names the base model, the
LoRA settings and what the run trained; ``--base-model`` replaces the base model's path (a checkpoint moved to
another machine). Exit codes: 0, 2 (a path or checkpoint problem, said in one line).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional

MODEL_INFO_NAME = "model_info.json"


class ExportError(ValueError):
    """A path or checkpoint that cannot be exported; the message says which and why."""


def resolve_checkpoint(path: str) -> str:
    """The ``global_step_<k>`` folder PATH names (see the module docstring)."""
    from verl_diffusion.trainer.checkpoints import check_checkpoint, find_resume_checkpoint

    path = os.path.abspath(os.path.expanduser(path))
    if os.path.basename(path) == "actor":
        path = os.path.dirname(path)
    if os.path.isdir(os.path.join(path, "actor")):
        problem = check_checkpoint(path)
        if problem:
            raise ExportError(f"{path} is not a complete checkpoint: {problem}")
        return path
    for ckpt_dir in (os.path.join(path, "checkpoints"), path):
        if os.path.isdir(ckpt_dir):
            point = find_resume_checkpoint(ckpt_dir)
            if point.path is not None:
                return point.path
    raise ExportError(f"{path} holds no complete checkpoint (a run directory, its checkpoints/ folder or a "
                      "global_step_<k> folder; runs save with trainer.save_freq > 0)")


def trainable_names(state: dict, info: dict) -> list[str]:
    """The parameter names the evaluation EMA tracks, in its order: the LoRA matrices of a LoRA run, every
    parameter (not the buffers) of a full fine-tune."""
    import torch

    from verl_diffusion.export.writer import lora_keys
    from verl_diffusion.models.base import transformer_class

    if info.get("lora"):
        return lora_keys(state)
    cls = transformer_class(info["base_model"])
    with torch.device("meta"):
        model = cls.from_config(cls.load_config(info["base_model"], subfolder="transformer"))
    params = {n for n, _ in model.named_parameters()}
    return [k for k in state if k.replace(".base_layer.", ".") in params]


def export_checkpoint(path: str, output: str, *, merge: bool = False, weights: str = "auto",
                      dtype: Optional[str] = None, base_model: Optional[str] = None) -> str:
    """Export the checkpoint at ``path`` (see :func:`resolve_checkpoint`) into ``output``; returns ``output``.

    ``weights``: ``ema`` (the evaluation EMA; an error when the run kept none), ``trained`` (the optimised
    weights), ``auto`` (EMA when kept, as the run's validation sampled)."""
    import torch

    from verl_diffusion.export.shards import gather_ema, gather_state_dict
    from verl_diffusion.export.writer import write_export

    folder = resolve_checkpoint(path)
    info_file = os.path.join(folder, MODEL_INFO_NAME)
    if not os.path.exists(info_file):
        raise ExportError(f"{folder} has no {MODEL_INFO_NAME} (written by every save of this version); it cannot "
                          "tell the base model and LoRA settings")
    with open(info_file) as f:
        info = json.load(f)
    if base_model:
        info["base_model"] = os.path.abspath(os.path.expanduser(base_model))
    if not os.path.isfile(os.path.join(str(info["base_model"]), "model_index.json")):
        raise ExportError(f"the base model {info['base_model']} is not a diffusers folder here; pass --base-model DIR")
    state = gather_state_dict(os.path.join(folder, "actor"))
    if info.get("lora"):
        from verl_diffusion.export.writer import lora_keys

        state = {k: state[k] for k in lora_keys(state)}
    ema = gather_ema(os.path.join(folder, "actor")) if weights in ("auto", "ema") else None
    if weights == "ema" and ema is None:
        raise ExportError(f"{folder} holds no evaluation EMA (actor.ema.enable was off); use --weights trained")
    if ema is not None:
        names = trainable_names(state, info)
        if len(names) != len(ema):
            raise ExportError(f"the EMA tracks {len(ema)} tensors but the checkpoint has {len(names)} trainable ones")
        state.update(dict(zip(names, ema)))
    info.update(weights="ema" if ema is not None else "trained", source=folder)
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    return write_export(state, info, output, merge=merge, dtype=dtypes[dtype] if dtype else None)


def main(argv: Optional[list] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m verl_diffusion.export",
                                description="A checkpoint of a verl-diffusion run -> a folder stock diffusers loads.")
    p.add_argument("path", help="run directory, its checkpoints/ folder, or a global_step_<k> folder")
    p.add_argument("--output", required=True, help="the folder to write (replaced whole if it exists)")
    p.add_argument("--merge-lora", action="store_true",
                   help="LoRA runs: write a full pipeline folder with the LoRA merged into the base weights")
    p.add_argument("--weights", choices=("auto", "ema", "trained"), default="auto",
                   help="auto (default): the evaluation EMA when the run kept one, else the trained weights")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="cast the written transformer (default: as trained)")
    p.add_argument("--base-model", default=None, help="the base model's folder, when it moved since training")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.path, args.output, merge=args.merge_lora, weights=args.weights,
                                dtype=args.dtype, base_model=args.base_model)
    except (ExportError, ValueError, FileNotFoundError) as e:
        print(f"export error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"exported: {out}")


if __name__ == "__main__":
    main()
