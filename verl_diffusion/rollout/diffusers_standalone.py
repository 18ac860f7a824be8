"""The standalone ``diffusers`` replica: our sampler in Ray actors of its own, not colocated with the actor, receiving
the actor's weights through a checkpoint-engine backend each step (docs/replica_modes.md).

Three pieces, in the shape of verl's standalone replicas (``verl/workers/rollout/replica.py``):

* :class:`StandaloneDiffusersAdapter` — verl ``BaseRollout`` in the replica process: the model adapter (VAE, text
  encoders, a transformer of its own built like the actor's, LoRA layers included) and our
  :class:`~verl_diffusion.rollout.diffusers_rollout.DiffusersRollout`. ``update_weights`` copies received tensors
  into the transformer (all of them, or the LoRA adapter only) and records the weights version.
* :class:`DiffusersStandaloneWorker` — verl's ``CheckpointEngineWorker`` (so verl's ``CheckpointEngineManager``
  drives the sync unchanged: ``execute_checkpoint_engine``, ``update_weights``) plus the server methods: ``generate``
  and the control methods (sleep, wake, abort, KV cache: no-ops, a diffusers sampler has no KV cache and a request
  is one batch). One process per replica.
* :class:`DiffusersStandaloneReplica` — verl ``RolloutReplica`` whose ``init_standalone`` places that worker in a
  pool of its own (``rollout.standalone.num_replicas`` replicas, one device each).

Requests and answers are the colocated replica's (rollout/diffusers_replica.py): ``{"prompts": DataProto,
"global_steps": int}`` → DataProto with the rollout tensors, ``meta_info["metrics"]`` and
``meta_info["extra_fields"]["global_steps"]`` (the version of the weights that sampled). Unlike the colocated
replica, the answer carries the heavy tensors (trajectories, text embeddings): the actor that trains on them is
another process.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Optional

import numpy as np
import torch

from verl_diffusion.config.schema import (  # noqa: F401  (the placement checks, re-exported)
    PLACEMENTS, check_placement, num_standalone_replicas, placement)
from verl_diffusion.rollout.checkpoint_engine import BACKEND as DEFAULT_BACKEND
from verl_diffusion.rollout.server_controls import BatchServerControls

__all__ = ["PLACEMENTS", "StandaloneDiffusersAdapter", "DiffusersStandaloneWorker", "DiffusersStandaloneReplica",
           "StandaloneServer", "placement", "num_standalone_replicas", "check_placement", "resolve_standalone_config",
           "launch_standalone_replicas"]


def resolve_standalone_config(arr_cfg) -> Optional[str]:
    """For a standalone placement, the checkpoint-engine backend the sync will use: the configured one, or
    ``diffusion_gloo`` in place of verl's default ``naive`` (which only works in process); None when colocated.
    Edits ``arr_cfg`` in place (before the workers are built: they read the backend from it)."""
    from omegaconf import open_dict

    if check_placement(arr_cfg) != "standalone":
        return None
    rollout = arr_cfg.rollout
    with open_dict(arr_cfg):
        if "checkpoint_engine" not in rollout or rollout.checkpoint_engine is None:
            rollout.checkpoint_engine = {}
        if str(rollout.checkpoint_engine.get("backend", "naive")) == "naive":
            rollout.checkpoint_engine.backend = DEFAULT_BACKEND
    return str(rollout.checkpoint_engine.backend)


# ----------------------------------------------------------------------------------------------------


class StandaloneDiffusersAdapter:
    """The sampler of one standalone replica and the receiving end of weight sync (verl ``BaseRollout`` API).

    Args: config: ``actor_rollout_ref.rollout`` (DictConfig). model_config: ``actor_rollout_ref.model``.
      loss_mode: ``actor.policy_loss.loss_mode`` (whether to store v_old). replica_rank: r.
    """

    def __init__(self, *, config, model_config, loss_mode: str = "flow_grpo", replica_rank: int = 0,
                 device_mesh=None, **_: Any):
        from verl.utils.device import get_device_name

        from verl_diffusion.algos.losses import get_loss_spec
        from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout
        from verl_diffusion.models.lora import inject_lora
        from verl_diffusion.config.schema import ModelSection, RolloutSection

        self.config = config
        self.model_config = model_config
        self.device_mesh = device_mesh
        self.replica_rank = int(replica_rank)
        # verl hands a replica its config nodes; they are typed here once, as the driver typed them.
        self.settings = RolloutSection.from_node(config)
        model = ModelSection.from_node(model_config)
        self.adapter = model.adapter_cls.from_pretrained(model.path, dtype=model.torch_dtype, device=get_device_name(),
                                                         **model.adapter_kwargs)
        module = self.adapter.transformer
        self.lora = model.lora.lora_rank > 0
        if self.lora:
            # The actor's LoRA layers (same targets, rank, alpha, names); their values arrive with the first sync.
            inject_lora(module, model.lora)
        module.requires_grad_(False)
        module.eval()
        self.module = module
        self.rollout = DiffusersRollout(self.adapter, self.settings.sampler)
        self.store_velocities = bool({"old_velocity", "old_mean"} & set(get_loss_spec(loss_mode).batch_keys))
        # Weights version (trainer global step) of the last update_weights; -1 = the model path's own weights.
        self.global_steps = -1
        self.last_sync: dict[str, float] = {}

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps: Optional[int] = None,
                             **_: Any):
        """Copy each received (name, tensor) into the transformer (load_weights_into: every name must exist)."""
        from verl.workers.rollout.utils import ensure_async_iterator

        from verl_diffusion.rollout.checkpoint_engine import load_weights_into

        if wire_format != "named_tensors":
            raise ValueError(f"the standalone diffusers replica takes named tensors, not {wire_format!r}")
        start = time.perf_counter()
        pairs = [pair async for pair in ensure_async_iterator(weights)]
        stats = load_weights_into(self.module, pairs)
        self.last_sync = {"weight_sync/received_bytes": stats["bytes"], "weight_sync/received_tensors":
                          stats["tensors"], "weight_sync/load_seconds": time.perf_counter() - start,
                          "weight_sync/lora_only": float(all("lora_" in n for n, _ in pairs))}
        if global_steps is not None:
            self.global_steps = int(global_steps)

    # Sleep / wake: nothing to free (no KV cache); the weights stay for the next step.
    async def resume(self, tags: list[str]):
        return None

    async def release(self):
        return None

    # ------------------------------------------------------------------ sampling

    def generate(self, prompts) -> "Any":
        """A replica request's DataProto -> the rollout DataProto (validation images when ``meta_info['validate']``)."""
        from verl import DataProto

        meta = prompts.meta_info
        texts = [str(p) for p in prompts.non_tensor_batch["prompt"]]
        if meta.get("validate", False):
            seeds = [int(s) for s in prompts.non_tensor_batch["seed"]]
            images = self.rollout.generate_ode(texts, seeds=seeds, num_steps=meta.get("num_steps", None))
            return DataProto.from_dict(tensors={"images": images}, meta_info=self._meta({}))
        from verl_diffusion.models.base import pad_text_rows as _pad_text

        uids = prompts.non_tensor_batch["uid"]
        _, group_ids = np.unique(np.asarray(uids).astype(str), return_inverse=True)
        seed = int(meta.get("seed", 0)) * 1000 + self.replica_rank
        branched = self.settings.branched
        start = time.perf_counter()
        if branched is None:
            out = self.rollout.generate(texts, torch.as_tensor(group_ids, dtype=torch.long), seed=seed,
                                        iteration=int(meta.get("iteration", 0)), store_velocities=self.store_velocities)
            out["group_ids"] = torch.as_tensor(group_ids, dtype=torch.long)
        else:
            from verl_diffusion.rollout.branched import generate_branched

            out = generate_branched(self.rollout, texts, seed=seed, branch_steps=branched.branch_steps,
                                    num_children=branched.num_children, store_velocities=self.store_velocities)
        metrics = dict(self.rollout.metrics)
        metrics["perf/rollout_time"] = time.perf_counter() - start
        _pad_text(out, int(getattr(self.adapter, "max_sequence_length", 0) or 0))
        return DataProto.from_dict(tensors=out, meta_info=self._meta(metrics))

    def _meta(self, metrics: dict) -> dict:
        return {"metrics": metrics, "extra_fields": {"global_steps": int(self.global_steps)}}


def _worker_base():
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    return CheckpointEngineWorker


class _ServerMethods(BatchServerControls):
    """The server half of :class:`DiffusersStandaloneWorker` (what verl's server manager and our trainer call)."""

    def generate(self, request: dict):
        """``{"prompts": DataProto, "global_steps": int}`` -> DataProto (module docstring)."""
        return self.server_adapter.generate(request["prompts"])

    def get_global_steps(self) -> int:
        return int(self.server_adapter.global_steps)

    def last_sync(self) -> dict:
        return dict(self.server_adapter.last_sync)

    def transformer_state(self) -> dict:
        """The replica's transformer tensors (CPU copies), for tests that compare them with the actor's."""
        return {k: v.detach().cpu().clone() for k, v in self.server_adapter.module.state_dict().items()}

    # Control methods of verl's server API: a diffusers sampler has no KV cache, and a request is one batch with one
    # weights version (a sync waits for the request in flight: the actor's methods run one at a time).
    async def wake_up(self):
        return None

    async def sleep(self):
        return None


def _make_worker_class():
    base = _worker_base()

    class DiffusersStandaloneWorker(_ServerMethods, base):
        """verl ``CheckpointEngineWorker`` around :class:`StandaloneDiffusersAdapter`, plus the server methods."""

        def __init__(self, rollout_config, model_config, loss_mode: str = "flow_grpo", replica_rank: int = 0):
            from verl_diffusion.distributed import init_cpu_process_group

            init_cpu_process_group()   # verl's worker would ask for "cpu:gloo,<device>:<backend>" on its own
            adapter = StandaloneDiffusersAdapter(config=rollout_config, model_config=model_config,
                                                 loss_mode=loss_mode, replica_rank=replica_rank)
            base.__init__(self, rollout_config=rollout_config, model_config=model_config, server_adapter=adapter)

    return DiffusersStandaloneWorker


@functools.cache
def standalone_worker_class() -> type:
    """:class:`DiffusersStandaloneWorker`, built on first use (verl's base class is imported then, not at module
    import: importing verl runs our plugin)."""
    return _make_worker_class()


def __getattr__(name: str):
    if name == "DiffusersStandaloneWorker":
        return standalone_worker_class()
    if name == "DiffusersStandaloneReplica":
        return standalone_replica_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class StandaloneServer:
    """Driver-side handle of one standalone worker with the colocated server's call style: ``generate(request)``
    returns an ``ObjectRef``."""

    def __init__(self, actor):
        self.actor = actor

    def generate(self, request: dict):
        return self.actor.generate.remote(request)

    def get_global_steps(self):
        return self.actor.get_global_steps.remote()


def _make_replica_class():
    from verl.workers.rollout.replica import RolloutMode, RolloutReplica

    class DiffusersStandaloneReplica(RolloutReplica):
        """One standalone diffusers replica: one worker process (rollout tensor/data/pipeline parallel sizes 1)."""

        def __init__(self, replica_rank: int, config, model_config, gpus_per_node: int = 8, loss_mode: str = "flow_grpo",
                     **_: Any) -> None:
            # verl's __init__ would turn ``config`` into its LLM RolloutConfig, which lacks our sampler keys.
            self.replica_rank = int(replica_rank)
            self.config = config
            self.model_config = model_config
            self.loss_mode = str(loss_mode)
            self.world_size = 1
            self.gpus_per_node = int(gpus_per_node)
            self.gpus_per_replica_node = 1
            self.nnodes = 1
            self.is_reward_model = self.is_teacher_model = False
            self.name_suffix = ""
            self.rollout_mode = None
            self.workers: list = []
            self.resource_pool = None
            self.bundle_indices: list[int] = []
            self.servers: list = []
            self._server_address = None
            self._server_handle = None

        async def init_standalone(self):
            """A pool of its own (one bundle: one device, or one CPU) and the worker in it."""
            import ray
            from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
            from verl.utils.device import get_device_name

            self.rollout_mode = RolloutMode.STANDALONE
            self.resource_pool = RayResourcePool(process_on_nodes=[1], use_gpu=True, max_colocate_count=1,
                                                 name_prefix=f"diffusers_standalone_{self.replica_rank}")
            cls = RayClassWithInitArgs(cls=ray.remote(standalone_worker_class()), rollout_config=self.config,
                                       model_config=self.model_config, loss_mode=self.loss_mode,
                                       replica_rank=self.replica_rank)
            group = RayWorkerGroup(resource_pool=self.resource_pool, ray_cls_with_init=cls, bin_pack=False,
                                   name_prefix=f"diffusers_standalone_{self.replica_rank}", device_name=get_device_name())
            self.workers = group.workers
            await self.launch_servers()

        def shutdown(self):
            """Kill this replica's worker and remove its placement group (a Ray session that outlives the run)."""
            import ray
            from ray.util import remove_placement_group

            for worker in self.workers:
                ray.kill(worker)
            for pg in list(getattr(self.resource_pool, "pgs", None) or []):
                remove_placement_group(pg)
            self.workers, self.servers = [], []

        async def launch_servers(self):
            self.servers = list(self.workers)     # the worker is its own server
            self._server_handle = StandaloneServer(self.workers[0])
            self._server_address = f"diffusers://standalone/{self.replica_rank}"

    return DiffusersStandaloneReplica


@functools.cache
def standalone_replica_class() -> type:
    """:class:`DiffusersStandaloneReplica`, built on first use (as :func:`standalone_worker_class`)."""
    return _make_replica_class()


def launch_standalone_replicas(arr_cfg, *, gpus_per_node: int = 1) -> list:
    """``rollout.standalone.num_replicas`` standalone replicas, started (their workers load the model)."""
    import asyncio

    rollout = arr_cfg.rollout
    cls = standalone_replica_class()
    replicas = [cls(replica_rank=r, config=rollout, model_config=arr_cfg.model, gpus_per_node=gpus_per_node,
                    loss_mode=str(arr_cfg.actor.policy_loss.loss_mode)) for r in range(num_standalone_replicas(rollout))]

    async def start():
        await asyncio.gather(*[r.init_standalone() for r in replicas])

    asyncio.run(start())
    return replicas
