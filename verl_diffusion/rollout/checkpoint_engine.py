"""Weight sync from the training workers to standalone rollout replicas: a checkpoint-engine backend in verl's
``CheckpointEngineRegistry`` (docs/replica_modes.md).

``diffusion_gloo`` broadcasts bucketed weights from actor rank 0 to every rollout worker over a gloo process
group of its own (a ``TCPStore`` + ``ProcessGroupGloo``, separate from the training group). Gloo moves CPU
tensors, so the same backend serves CPU hosts and GPU hosts (tensors are staged through host memory: slower
than NCCL, but it needs neither cupy nor a GPU on the receiving side). verl's ``CheckpointEngineManager``
drives it unchanged: ``prepare`` → ``build_topology`` → ``init_process_group`` → ``send_weights`` /
``receive_weights`` → ``finalize``, once per sync.

Wire format, per bucket: an int64 header length, a pickled header ``{"tensors": [(name, shape, dtype, offset,
nbytes)], "length": int, "last": bool}``, then ``length`` payload bytes. A tensor larger than the bucket goes in
a bucket of its own. What crosses is what the sender's generator yields: the whole state dict (full fine-tune)
or only the LoRA adapter tensors (:func:`actor_weights`), so a LoRA sync moves ``lora_rank``-sized tensors only.
"""

from __future__ import annotations

import datetime
import pickle
import time
from typing import Any, AsyncIterator, Iterable, Iterator, Optional

import torch
import torch.distributed as dist

__all__ = ["BACKEND", "GlooCheckpointEngine", "engine_class", "actor_weights", "is_lora_name", "load_weights_into"]

# The name users set in ``actor_rollout_ref.rollout.checkpoint_engine.backend``.
BACKEND = "diffusion_gloo"

_DTYPES = {str(d): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
                               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


def is_lora_name(name: str) -> bool:
    """A peft adapter tensor (``...lora_A.default.weight``, ``lora_B``, ``lora_embedding_*``, ``lora_magnitude``)."""
    return "lora_" in name


def actor_weights(module: torch.nn.Module, *, lora_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) of the actor's transformer, in state-dict order: every tensor, or the LoRA adapter only.

    FSDP2 shards are gathered (``DTensor.full_tensor()``, a collective over the actor group): every actor rank
    must walk this generator, the ones outside the broadcast included (``send_weights`` does).
    """
    from torch.distributed.tensor import DTensor

    for name, tensor in module.state_dict().items():
        if lora_only and not is_lora_name(name):
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


@torch.no_grad()
def load_weights_into(module: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
    """Copy received (name, tensor) pairs into ``module``'s parameters / buffers in place (their dtype and device).

    Every name must exist with the same shape: a silent partial load would leave the replica sampling with stale
    weights. Returns {"tensors", "bytes"} of what was loaded.
    """
    targets = dict(module.named_parameters())
    targets.update(dict(module.named_buffers()))
    count, nbytes = 0, 0
    for name, tensor in weights:
        target = targets.get(name)
        if target is None:
            near = sorted(targets)[:5]
            raise KeyError(f"weight sync sent {name!r}, which the replica's model does not have (e.g. {near}); "
                           "the replica must build the same architecture and LoRA config as the actor")
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"weight sync sent {name!r} with shape {tuple(tensor.shape)}, the replica's is "
                             f"{tuple(target.shape)}")
        target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        count += 1
        nbytes += tensor.numel() * tensor.element_size()
    return {"tensors": float(count), "bytes": float(nbytes)}


class GlooBroadcast:
    """Bucketed gloo broadcast from actor rank 0 (group rank 0) to the rollout workers (group ranks 1..R).

    Args: bucket_size: bytes per broadcast (verl passes ``update_weights_bucket_megabytes`` << 20).
      is_master: actor rank 0 (hosts the group's TCPStore). timeout_s: gloo / store timeout.
    After a ``send_weights``, ``last_metrics`` holds ``weight_sync/{bytes,tensors,buckets,seconds}``.
    The registered class is :func:`engine_class` (this plus verl's ``CheckpointEngine`` ABC).
    """

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0, **_: Any) -> None:
        if int(bucket_size) < 1:
            raise ValueError(f"checkpoint_engine.update_weights_bucket_megabytes gives bucket_size={bucket_size}; "
                             "pass a positive size")
        self.bucket_size = int(bucket_size)
        self.is_master = bool(is_master)
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        self.rank: Optional[int] = None
        self.world_size: Optional[int] = None
        self._store = None
        self._group = None
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ topology

    def prepare(self) -> dict[str, Any]:
        """The master opens a fresh TCPStore on a free port and reports its address; the others report nothing."""
        if not self.is_master:
            return {"master": None}
        import ray

        host = ray.util.get_node_ip_address().strip("[]") if ray.is_initialized() else "127.0.0.1"
        self._store = dist.TCPStore(host, 0, None, True, timeout=self.timeout, wait_for_workers=False)
        return {"master": (host, int(self._store.port))}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]):
        """Actor rank 0 is group rank 0; other actor ranks sit out (rank −1); rollout worker i is rank 1 + i."""
        master = metadata[0].get("master") if metadata else None
        if master is None:
            raise RuntimeError("diffusion_gloo: actor rank 0 did not open the weight-sync store (is_master unset?)")
        world = 1 + int(rollout_world_size)
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"rank": list(range(1, world)), "world_size": [world] * rollout_world_size,
                   "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: tuple[str, int]) -> None:
        self.rank, self.world_size = int(rank), int(world_size)
        if self.rank < 0:
            return
        if self.rank == 0:
            store = self._store
        else:
            store = dist.TCPStore(master[0], int(master[1]), None, False, timeout=self.timeout)
        self._group = dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)

    def finalize(self) -> None:
        """Drop the group and the store (a new pair is built at the next sync)."""
        self._group = None
        self._store = None
        self.rank = None

    # ------------------------------------------------------------------ transfer

    def _broadcast(self, tensor: torch.Tensor) -> None:
        self._group.broadcast(tensor, 0).wait()

    def _send_bucket(self, entries: list, payload: torch.Tensor, last: bool) -> None:
        header = pickle.dumps({"tensors": entries, "length": int(payload.numel()), "last": last})
        self._broadcast(torch.tensor([len(header)], dtype=torch.int64))
        self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        if payload.numel():
            self._broadcast(payload)

    @torch.no_grad()
    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]], global_steps: Optional[int] = None):
        """Broadcast every (name, tensor) of ``weights``; ranks outside the group only walk the generator.

        Returns ``weight_sync/{bytes,tensors,buckets,seconds}`` (verl's manager merges the senders' dicts).
        """
        if self.rank is None:
            raise RuntimeError("diffusion_gloo: send_weights before init_process_group")
        if self.rank < 0:
            for _ in weights:   # gathering a sharded tensor is collective over the actor group
                pass
            return {}
        start = time.perf_counter()
        bucket = torch.empty(self.bucket_size, dtype=torch.uint8)
        entries, offset, total, count, buckets = [], 0, 0, 0, 0
        for name, tensor in weights:
            flat = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
            nbytes = flat.numel()
            if offset and offset + nbytes > self.bucket_size:
                self._send_bucket(entries, bucket[:offset], last=False)
                entries, offset, buckets = [], 0, buckets + 1
            meta = (name, tuple(tensor.shape), str(tensor.dtype), offset, nbytes)
            if nbytes > self.bucket_size:   # alone in a bucket of its own size
                self._send_bucket([(name, meta[1], meta[2], 0, nbytes)], flat, last=False)
                buckets += 1
            else:
                bucket[offset:offset + nbytes] = flat
                entries.append(meta)
                offset += nbytes
            total += nbytes
            count += 1
        self._send_bucket(entries, bucket[:offset], last=True)
        self.last_metrics = {"weight_sync/bytes": float(total), "weight_sync/tensors": float(count),
                             "weight_sync/buckets": float(buckets + 1),
                             "weight_sync/seconds": time.perf_counter() - start}
        return dict(self.last_metrics)

    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) on CPU, in the sender's order, until the last bucket."""
        if self.rank is None or self.rank < 1:
            raise RuntimeError(f"diffusion_gloo: receive_weights on group rank {self.rank}; only rollout workers "
                               "(rank >= 1) receive")
        while True:
            size = torch.zeros(1, dtype=torch.int64)
            self._broadcast(size)
            raw = torch.empty(int(size.item()), dtype=torch.uint8)
            self._broadcast(raw)
            header = pickle.loads(raw.numpy().tobytes())
            payload = torch.empty(int(header["length"]), dtype=torch.uint8)
            if payload.numel():
                self._broadcast(payload)
            for name, shape, dtype, offset, nbytes in header["tensors"]:
                chunk = payload[offset:offset + nbytes]
                yield name, chunk.clone().view(_DTYPES[dtype]).reshape(shape)
            if header["last"]:
                return


_ENGINE_CLASS = None


def engine_class() -> type:
    """``GlooCheckpointEngine``: :class:`GlooBroadcast` on verl's ``CheckpointEngine`` ABC, built on first use.

    verl's base class is imported here, not at module import: importing verl runs our plugin, which registers
    this class, so a module-level ``import verl`` would make "import this module first" a circular import that
    leaves the plugin half-registered.
    """
    global _ENGINE_CLASS
    if _ENGINE_CLASS is None:
        from verl.checkpoint_engine.base import CheckpointEngine

    if _ENGINE_CLASS is None:   # importing verl may have run the plugin, which calls this function too
        _ENGINE_CLASS = type("GlooCheckpointEngine", (GlooBroadcast, CheckpointEngine),
                             {"__module__": __name__, "__doc__": GlooBroadcast.__doc__})
    return _ENGINE_CLASS


def __getattr__(name: str):
    if name == "GlooCheckpointEngine":
        return engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
