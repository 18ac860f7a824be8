"""A checkpoint's per-rank FSDP shards gathered into one state dict, on the CPU, for any world size.

A checkpoint's ``actor/`` folder holds ``model_world_size_{W}_rank_{r}.pt`` for r = 0..W-1 (workers/engine.py's
``DiffusionCheckpointManager``): each rank's ``state_dict()`` of the FSDP2 module, whose parameters are DTensors
sharded on one dimension (``Shard(d)``: rank r holds the r-th ``torch.chunk`` of that dimension) and whose buffers
are plain tensors, the same on every rank. LoRA runs save only the trainable weights. ``extra_*`` holds the
evaluation EMA, when one is kept, as a list of shards in the order of the trainable parameters.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from typing import Optional

import torch

_SHARD_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")


def shard_files(actor_dir: str, kind: str = "model") -> list[str]:
    """The ``{kind}_world_size_W_rank_r.pt`` files of ``actor_dir`` in rank order; raises ValueError when ranks
    are missing or two world sizes are mixed."""
    found: dict[int, set[int]] = {}
    for name in os.listdir(actor_dir):
        m = _SHARD_RE.match(name)
        if m:
            found.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if not found:
        raise ValueError(f"{actor_dir} holds no model_world_size_<W>_rank_<r>.pt shard files")
    if len(found) > 1:
        raise ValueError(f"{actor_dir} mixes shards of world sizes {sorted(found)}")
    (world, ranks), = found.items()
    missing = sorted(set(range(world)) - ranks)
    if missing:
        raise ValueError(f"{actor_dir}: world size {world} but the shards of ranks {missing} are missing")
    return [os.path.join(actor_dir, f"{kind}_world_size_{world}_rank_{r}.pt") for r in range(world)]


def _load(path: str):
    # Unpickling a DTensor's DeviceMesh outside a process group warns (torch's logger); harmless when reading.
    mesh_log = logging.getLogger("torch.distributed.device_mesh")
    level = mesh_log.level
    mesh_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(path, map_location="cpu", weights_only=False)
    finally:
        mesh_log.setLevel(level)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def gather_tensor(parts: list) -> torch.Tensor:
    """One tensor from its per-rank values: DTensors sharded on dim d are concatenated along d in rank order;
    replicated DTensors and plain tensors are rank 0's."""
    first = parts[0]
    placements = getattr(first, "placements", None)
    if placements:
        dims = [p.dim for p in placements if hasattr(p, "dim")]
        if len(dims) > 1:
            raise ValueError(f"a tensor sharded on several mesh dimensions ({placements}) is not supported")
        if dims:
            full = torch.cat([_local(p).detach().cpu() for p in parts], dim=dims[0])
            if tuple(full.shape) != tuple(first.shape):
                raise ValueError(f"gathered shards have shape {tuple(full.shape)}, expected {tuple(first.shape)}")
            return full
    return _local(first).detach().cpu().clone()


def gather_state_dict(actor_dir: str) -> dict[str, torch.Tensor]:
    """The full state dict of a checkpoint's ``actor/`` folder (see the module docstring)."""
    ranks = [_load(f) for f in shard_files(actor_dir)]
    keys = list(ranks[0])
    for r, sd in enumerate(ranks[1:], start=1):
        if list(sd) != keys:
            raise ValueError(f"{actor_dir}: rank {r}'s shard has other keys than rank 0's")
    return {k: gather_tensor([sd[k] for sd in ranks]) for k in keys}


def gather_ema(actor_dir: str) -> Optional[list[torch.Tensor]]:
    """The evaluation EMA's full tensors (order of the trainable parameters), or None when none was kept."""
    files = [f.replace("model_world_size", "extra_world_size") for f in shard_files(actor_dir)]
    if not all(os.path.exists(f) for f in files):
        return None
    states = [(_load(f).get("user") or {}).get("ema") for f in files]
    if any(s is None for s in states):
        return None
    shadows = [s["shadow"] for s in states]
    return [gather_tensor([sh[i] for sh in shadows]) for i in range(len(shadows[0]))]
