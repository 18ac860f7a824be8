"""The ``diffusers`` rollout replica in verl's replica registry, colocated with the actor (docs/replica_modes.md).

Three small pieces, the shape of verl's own hybrid replicas (``verl/workers/rollout/replica.py``):

* :class:`DiffusersRolloutAdapter` — the in-worker adapter (verl ``BaseRollout``), found through verl's
  ``_ROLLOUT_REGISTRY[("diffusers", "async")]``. It lives in the actor worker process, around our sampler
  (:class:`~verl_diffusion.rollout.diffusers_rollout.DiffusersRollout` and, for TempFlow, ``rollout/branched.py``)
  whose transformer *is* the actor's FSDP module: weights are shared in process.
* :class:`DiffusersServer` — the server of one replica: ``generate(request)`` and verl's control methods
  (``wake_up``, ``sleep``, ``abort_all_requests``, ...), each returning a Ray ``ObjectRef`` of a call into the
  adapter of its worker (through Ray's ``__ray_call__``; the adapter is found by replica rank in
  :data:`LOCAL_ADAPTERS`).
* :class:`DiffusersReplica` — verl ``RolloutReplica`` (registered as ``diffusers``), hybrid mode only: replica r is
  actor worker r (one process each, rollout tensor/data/pipeline parallel sizes 1).

Interface (what a trainer or another replica type relies on):

* ``request`` = ``{"prompts": DataProto, "global_steps": int}``; the DataProto is the replica's share of the step's
  rows (``prompt``, ``uid`` non-tensors; ``seed``, ``iteration`` in ``meta_info``; in validation also
  ``validate=True`` and a per-row ``seed``).
* the answer is a DataProto: the rollout tensors (``images``, ``train_mask``, ``rollout_log_probs``, ``sigmas``,
  ...) and ``meta_info["metrics"]`` plus ``meta_info["extra_fields"] = {"global_steps": <weights version>}``, the
  version the adapter last received through :meth:`DiffusersRolloutAdapter.update_weights` (verl's naive
  checkpoint-engine path: the worker's ``update_weights`` hands the actor's parameters to the adapter).

Why the server is not a Ray actor of its own, as vLLM's is: a colocated diffusers sampler has no HTTP endpoint,
no KV cache and no request queue; a server process per replica would add a Python process importing verl to
every run's start-up (the V1 start-up cost this project measured, docs/benchmarks.md) and forward every call
anyway. The server is a driver-side forwarder with the same methods. A standalone replica (weights received
through a real checkpoint-engine backend) needs a process of its own and is a different class.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Generator, Optional

import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica
from verl_diffusion.rollout.server_controls import BatchServerControls

__all__ = ["REPLICA_NAME", "ADAPTER_PATH", "LOCAL_ADAPTERS", "DiffusersRolloutAdapter", "DiffusersServer",
           "DiffusersReplica", "load_diffusers_replica"]

REPLICA_NAME = "diffusers"
# verl's _ROLLOUT_REGISTRY value for ("diffusers", "async"): a dotted path, imported on first use.
ADAPTER_PATH = "verl_diffusion.rollout.diffusers_replica.DiffusersRolloutAdapter"

# replica rank -> the adapter living in this process (a worker process holds one).
LOCAL_ADAPTERS: dict[int, "DiffusersRolloutAdapter"] = {}


class DiffusersRolloutAdapter(BaseRollout):
    """In-worker adapter of the colocated diffusers replica (verl ``BaseRollout``).

    Args: config / model_config: the rollout and model DictConfigs (kept as given: verl's ``RolloutConfig`` is the
    LLM one and lacks our sampler keys). generate_fn: the worker's rollout, ``DataProto -> DataProto`` (train or
    validation rows). module: the transformer the sampler runs, the actor's own FSDP module. replica_rank: r.
    """

    def __init__(self, *args: Any, config, model_config, device_mesh=None, replica_rank: int = 0,
                 generate_fn: Optional[Callable] = None, module: Optional[torch.nn.Module] = None, **kwargs: Any):
        self.config = config
        self.model_config = model_config
        self.device_mesh = device_mesh
        self.replica_rank = int(replica_rank)
        self.generate_fn = generate_fn
        self.module = module
        # Weights version (trainer global step) of the last update_weights; -1 before the first.
        self.global_steps = -1
        # Parameters received by the last update_weights that were not the sampler's own tensors (0 colocated).
        self.foreign_tensors = 0
        self.awake = True
        LOCAL_ADAPTERS[self.replica_rank] = self

    def serve(self, request: dict):
        """One replica request: ``{"prompts": DataProto, "global_steps": int}`` -> DataProto (module docstring)."""
        out = self.generate_fn(request["prompts"])
        out.meta_info.setdefault("extra_fields", {})["global_steps"] = int(self.global_steps)
        return out

    async def update_weights(self, weights: Generator, wire_format: str = "named_tensors",
                             global_steps: Optional[int] = None, **kwargs: Any):
        """Naive (colocated) sync: the actor hands its parameters over; they are the sampler's own tensors (the
        sampler runs the actor's module), so nothing is copied. Counts any tensor that is not one of them, which a
        colocated run never has (tests assert 0), and records the weights version."""
        own = {id(p) for p in self.module.parameters()} if self.module is not None else set()
        foreign = 0
        for _, tensor in weights:
            foreign += int(id(tensor) not in own)
        self.foreign_tensors = foreign
        if global_steps is not None:
            self.global_steps = int(global_steps)

    # Sleep / wake: the weights are the actor's and there is no KV cache; nothing to free or restore.
    async def resume(self, tags: list[str]):
        self.awake = True

    async def release(self):
        self.awake = False


def _call_adapter(_actor, *, replica_rank: int, method: str, kwargs: dict):
    adapter = LOCAL_ADAPTERS[replica_rank]
    if method == "serve":
        return adapter.serve(kwargs["request"])
    if method == "global_steps":
        return int(adapter.global_steps)
    if method == "wake_up":
        adapter.awake = True
    elif method == "sleep":
        adapter.awake = False
    return None


class DiffusersServer:
    """Server of one colocated diffusers replica: verl's server methods, each an ``ObjectRef`` of a call into the
    adapter in the replica's worker (module docstring: why this is not a process of its own)."""

    def __init__(self, replica_rank: int, worker):
        self.replica_rank = int(replica_rank)
        self.worker = worker

    def _call(self, method: str, **kwargs):
        return self.worker.__ray_call__.remote(functools.partial(
            _call_adapter, replica_rank=self.replica_rank, method=method, kwargs=kwargs))

    def generate(self, request: dict):
        return self._call("serve", request=request)

    def get_global_steps(self):
        return self._call("global_steps")

    def wake_up(self):
        return self._call("wake_up")

    def sleep(self):
        return self._call("sleep")

    # One request is one batch sampled with one weights version: nothing to abort, no KV cache, no profiler.
    def _noop(self, *args, **kwargs):
        return self._call("noop")

    abort_all_requests = resume_generation = clear_kv_cache = release_kv_cache = resume_kv_cache = _noop
    start_profile = stop_profile = _noop


class DiffusersReplica(BatchServerControls, RolloutReplica):
    """The ``diffusers`` replica: hybrid (colocated) with the actor; replica r = actor worker r."""

    def __init__(self, replica_rank: int, config, model_config, gpus_per_node: int = 8,
                 is_reward_model: bool = False, is_teacher_model: bool = False, name_suffix: str = "") -> None:
        # verl's __init__ would turn ``config`` into its LLM RolloutConfig, which lacks our sampler keys.
        self.replica_rank = int(replica_rank)
        self.config = config
        self.model_config = model_config
        self.world_size = 1
        self.gpus_per_node = int(gpus_per_node)
        self.gpus_per_replica_node = 1
        self.nnodes = 1
        self.is_reward_model = bool(is_reward_model)
        self.is_teacher_model = bool(is_teacher_model)
        self.name_suffix = f"_{name_suffix}" if name_suffix else ""
        self.rollout_mode: Optional[RolloutMode] = None
        self.workers: list = []
        self.resource_pool = None
        self.bundle_indices: list[int] = []
        self.servers: list[DiffusersServer] = []
        self._server_address: Optional[str] = None
        self._server_handle: Optional[DiffusersServer] = None

    def _not_hybrid(self, *args, **kwargs):
        raise NotImplementedError("the colocated diffusers replica runs in the actor workers (hybrid mode); a "
                                  "standalone diffusers replica is a separate class")

    init_hybrid_colocated = init_colocated = init_standalone = _not_hybrid

    async def launch_servers(self):
        self.servers = [DiffusersServer(self.replica_rank, self.workers[0])]
        self._server_handle = self.servers[0]
        self._server_address = f"diffusers://hybrid/{self.replica_rank}"

    async def _all(self, method: str):
        for server in self.servers:
            await getattr(server, method)()

    async def wake_up(self):
        await self._all("wake_up")

    async def sleep(self):
        await self._all("sleep")


def load_diffusers_replica() -> type:
    """Loader for verl's ``RolloutReplicaRegistry.register("diffusers", ...)``."""
    return DiffusersReplica
