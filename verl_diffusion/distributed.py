"""Process-group set-up that the actor workers and the standalone rollout replicas share."""

from __future__ import annotations

import os

import torch
import torch.distributed
from verl.utils.device import get_device_name


def init_cpu_process_group() -> None:
    """On the CPU platform, open the gloo group before verl does: verl builds the backend string
    ``"cpu:gloo,cpu:gloo"``, which torch rejects. Ray already set RANK / WORLD_SIZE /
    MASTER_*; verl skips an initialised group."""
    if get_device_name() != "cpu" or torch.distributed.is_initialized():
        return
    torch.distributed.init_process_group(
        backend="gloo", rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)))
