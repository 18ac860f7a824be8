"""The ``vllm_omni`` rollout replica in verl's replica registry (docs/rollout_replicas.md, docs/vllm_omni.md).

* :class:`VllmOmniReplica` (verl ``RolloutReplica``), standalone placement: one GPU per replica, on its own
  resource pool, where verl's ``CheckpointEngineWorker`` builds our in-worker adapter.
* :class:`VllmOmniServerAdapter` (verl ``BaseRollout``, found through verl's ``_ROLLOUT_REGISTRY``): starts
  vllm-omni's diffusion engine (``AsyncOmni``) with our custom pipeline and worker extension, plans each
  request's randomness on the CPU, submits one engine request per row and collates the trajectories.
  Weight sync from the checkpoint engine: LoRA through the engine's ``add_lora`` / ``remove_lora``, full weights
  through ``collective_rpc("verl_load_weights")``; ``release`` / ``resume`` are the engine's sleep / wake.
* :class:`VllmOmniServer`: the replica's server actor (``generate(request)`` and verl's control methods).

Nothing here imports vllm or vllm-omni at module level (verl's registry loader imports this module): it loads, and
its pure parts are tested, where vllm-omni is absent; the engine needs a CUDA GPU (vllm-omni has no CPU platform).
"""

from __future__ import annotations

import asyncio
import functools
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from verl_diffusion.rollout.diffusers_rollout import RolloutConfig, plan_rollout
from verl_diffusion.rollout.vllm_omni import latent_shape_of
from verl_diffusion.rollout.vllm_omni.protocol import (collate_trajectories, request_extra_args, write_lora_dir)
from verl_diffusion.rollout.server_controls import BatchServerControls

__all__ = ["REPLICA_NAME", "validate_vllm_omni_config", "VllmOmniReplica", "VllmOmniServer", "VllmOmniServerAdapter", "engine_kwargs",
           "build_engine_requests", "trajectory_of", "split_lora_weights", "load_vllm_omni_replica"]

REPLICA_NAME = "vllm_omni"
PIPELINE_MODULE = "verl_diffusion.rollout.vllm_omni.pipelines"
WORKER_EXTENSION = "verl_diffusion.rollout.vllm_omni.worker_extension.VerlDiffusionWorkerExtension"
# Stands for the trainer's sampling rank r in seed·1000 + r (docs/rollout_replicas.md §3): one per replica.
_RANK = 0


def _get(cfg, key, default=None):
    if cfg is None:
        return default
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    getter = getattr(cfg, "get", None)
    return getter(key, default) if callable(getter) else getattr(cfg, key, default)


def _world_size(config) -> int:
    return (int(_get(config, "tensor_model_parallel_size", 1)) * int(_get(config, "data_parallel_size", 1))
            * int(_get(config, "pipeline_model_parallel_size", 1)))


def pipeline_class_for(model_path: str) -> str:
    """Qualified name of our pipeline for the checkpoint at ``model_path`` (its model_index.json class)."""
    import json

    index = Path(model_path) / "model_index.json"
    if not index.is_file():
        raise FileNotFoundError(f"actor_rollout_ref.model.path={model_path!r} has no model_index.json; the vllm_omni "
                                "replica needs a local diffusers directory")
    arch = json.loads(index.read_text()).get("_class_name")
    from verl_diffusion.rollout.vllm_omni import PIPELINE_CLASSES as names

    if arch not in names:
        raise ValueError(f"the vllm_omni replica has no pipeline for {arch!r} (model {model_path!r}); available: "
                         f"{sorted(names)}; or use actor_rollout_ref.rollout.name=diffusers")
    return f"{PIPELINE_MODULE}.{names[arch]}"


def validate_vllm_omni_config(rollout_cfg, model_cfg) -> None:
    """One clear line for a setting the vllm_omni replica cannot run, before any Ray worker or engine starts.

    For the trainer's pre-flight validation (``actor_rollout_ref.rollout`` / ``.model``); raises ValueError.
    """
    import importlib.util

    size = _world_size(rollout_cfg)
    if size != 1:
        raise ValueError(f"actor_rollout_ref.rollout tensor × data × pipeline parallel sizes = {size}; the vllm_omni "
                         "replica runs one GPU per replica: set them to 1 and scale with more replicas")
    placement = str(_get(rollout_cfg, "placement", "standalone"))
    if placement != "standalone":
        raise ValueError(f"actor_rollout_ref.rollout.placement={placement!r}; rollout.name=vllm_omni runs standalone "
                         "(its engine holds its own copy and receives weights through the checkpoint engine)")
    branched = _get(rollout_cfg, "branched", None)
    if branched is not None and bool(_get(branched, "enabled", False)):
        raise ValueError("actor_rollout_ref.rollout.branched.enabled=true is not supported by rollout.name=vllm_omni; "
                         "use rollout.name=diffusers for TempFlow branched rollouts")
    pipeline_class_for(str(_get(model_cfg, "path")))
    if importlib.util.find_spec("vllm_omni") is None:
        raise ValueError("actor_rollout_ref.rollout.name=vllm_omni but vllm-omni is not installed; on a GPU host: "
                         "pip install 'verl-diffusion[vllm-omni]' (docs/vllm_omni.md)")


def engine_kwargs(model_path: str, *, dtype: str = "bfloat16", enable_sleep_mode: bool = True,
                  extra: Optional[dict] = None, adapter_kwargs: Optional[dict] = None) -> dict[str, Any]:
    """Keyword arguments of ``AsyncOmni`` for our pipeline (also valid ``OmniDiffusionConfig`` fields).

    ``extra``: ``actor_rollout_ref.rollout.engine_kwargs.vllm_omni``, passed through last (user overrides).
    ``adapter_kwargs``: ``actor_rollout_ref.model.adapter_kwargs``, handed to the pipeline's model adapter.
    """
    pipeline_args: dict[str, Any] = {"pipeline_class": pipeline_class_for(model_path)}
    if adapter_kwargs:
        pipeline_args["adapter_kwargs"] = dict(adapter_kwargs)
    kwargs = {
        "model": str(model_path),
        "dtype": dtype,
        "custom_pipeline_args": pipeline_args,
        "worker_extension_cls": WORKER_EXTENSION,
        "enable_sleep_mode": bool(enable_sleep_mode),
        # Our pipelines run the diffusers modules eagerly, as the trainer does (compiled kernels would change the
        # round-off and so the log-probs).
        "enforce_eager": True,
    }
    kwargs.update(dict(extra or {}))
    return kwargs


def build_engine_requests(cfg: RolloutConfig, request: dict, latent_shape, *, sampling_params_cls) -> list[dict]:
    """One engine request per row of a generate request: ``{"prompt", "sampling_params", "request_id"}``.

    The plan is the diffusers replica's for one sampling rank (seed·1000 + 0, docs/rollout_replicas.md §3).
    """
    if request.get("branched"):
        raise ValueError("the vllm_omni replica does not run branched (TempFlow) rollouts; use "
                         "actor_rollout_ref.rollout.name=diffusers for rollout.branched.enabled=true")
    group_ids = torch.as_tensor(request["group_ids"], dtype=torch.long)
    plan = plan_rollout(cfg, group_ids, latent_shape, seed=int(request["seed"]) * 1000 + _RANK,
                        iteration=int(request.get("iteration", 0)))
    store = bool(request.get("store_velocities", False))
    rid = str(request.get("request_id") or uuid.uuid4().hex[:8])
    return [{"prompt": str(p), "request_id": f"{rid}-{i}",
             "sampling_params": sampling_params_cls(
                 height=cfg.height, width=cfg.width, num_inference_steps=cfg.num_steps,
                 guidance_scale=cfg.guidance_scale, latents=plan.initial_noise[i:i + 1].clone(),
                 extra_args=request_extra_args(cfg, plan, i, store_velocities=store))}
            for i, p in enumerate(request["prompts"])]


def trajectory_of(output) -> dict[str, torch.Tensor]:
    """The per-sample tensors of one finished engine output (``OmniRequestOutput``), image included."""
    seen = set()
    while output is not None and id(output) not in seen:      # a stage output may wrap the diffusion one
        seen.add(id(output))
        mm = getattr(output, "multimodal_output", None) or {}
        trajectory = mm.get("trajectory") if isinstance(mm, dict) else None
        if isinstance(trajectory, dict):
            images = getattr(output, "images", None) or []
            if len(images) != 1:
                raise ValueError(f"engine output {getattr(output, 'request_id', '?')} has {len(images)} images, "
                                 "expected 1 (one request per sample)")
            image = torch.as_tensor(images[0])
            return {**trajectory, "image": image[0] if image.dim() == 4 else image}
        output = getattr(output, "request_output", None)
    raise ValueError("engine output carries no verl-diffusion trajectory (multimodal_output['trajectory']); was the "
                     "engine started with a verl_diffusion pipeline?")


def split_lora_weights(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[dict, dict]:
    """(LoRA weights in peft's saved names, other weights) from the actor's ``(name, tensor)`` stream.

    The actor sends names as in its module (``…to_q.lora_A.default.weight``, docs/rollout_replicas.md §4);
    peft's saved format drops the adapter name (``…to_q.lora_A.weight``).
    """
    lora, full = {}, {}
    for name, tensor in named:
        if ".lora_A." in name or ".lora_B." in name:
            lora[name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = tensor
        else:
            full[name] = tensor
    return lora, full


class _EngineThread:
    """``AsyncOmni`` on its own event loop in a thread, so sync callers (Ray methods, tests) can drive it."""

    def __init__(self, kwargs: dict):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-omni-engine", daemon=True)
        self.thread.start()
        self.engine = self.call(self._start(kwargs))

    async def _start(self, kwargs):
        from vllm_omni.entrypoints import AsyncOmni

        return AsyncOmni(**kwargs)

    def call(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def shutdown(self) -> None:
        """Stop the engine (its worker processes) and the loop thread."""
        async def stop_engine():           # on the engine's loop: it cancels the engine's output task there
            self.engine.shutdown()

        try:
            self.call(stop_engine(), timeout=120)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=30)

    async def generate_all(self, requests: list[dict]) -> list:
        async def one(r):
            final = None
            async for out in self.engine.generate(r["prompt"], r["sampling_params"], r["request_id"]):
                final = out
            return final
        return await asyncio.gather(*[one(r) for r in requests])


class VllmOmniServerAdapter(BaseRollout):
    """In-worker adapter of a vllm_omni replica (a verl ``BaseRollout``; see the module docstring).

    Built by verl's ``CheckpointEngineWorker`` as ``cls(config=rollout_cfg, model_config=model_cfg,
    device_mesh=None, replica_rank=r)``. ``config`` / ``model_config``: ``actor_rollout_ref.rollout`` / ``.model``,
    kept as given (``BaseRollout.__init__`` would turn them into verl's LLM config dataclasses).
    """

    def __init__(self, *args: Any, config, model_config, device_mesh=None, replica_rank: int = 0,
                 start_engine: bool = True, **kwargs: Any):
        from verl_diffusion.config.schema import ModelSection, RolloutSection

        self.config = config
        self.model_config = model_config
        self.device_mesh = device_mesh
        self.replica_rank = int(replica_rank)
        self.is_leader_rank = True
        self.global_steps = 0
        # verl hands a replica its config nodes; they are typed here once, as the driver typed them. The LoRA
        # layout is the actor's (the injected layers must match the ones whose weights arrive).
        model = ModelSection.from_node(model_config)
        self.cfg: RolloutConfig = RolloutSection.from_node(config).sampler
        self.lora_rank = model.lora.lora_rank
        self.lora_alpha = model.lora.lora_alpha
        self.target_modules = model.lora.target_modules
        self._lora_id = 0
        self._lora_dir = Path(tempfile.mkdtemp(prefix="verl_diffusion_lora_"))
        self.metrics: dict[str, float] = {}
        self._engine: Optional[_EngineThread] = None
        omni = _get(_get(config, "engine_kwargs", None), "vllm_omni", None)
        self.engine_kwargs = engine_kwargs(str(_get(model_config, "path")),
                                           dtype=str(_get(config, "dtype", "bfloat16")),
                                           enable_sleep_mode=bool(_get(config, "enable_sleep_mode", True)),
                                           extra=dict(omni) if omni else None,
                                           adapter_kwargs=model.adapter_kwargs)
        _LOCAL[self.replica_rank] = self
        if start_engine:
            self._engine = _EngineThread(self.engine_kwargs)

    # ------------------------------------------------------------------ generate

    def serve(self, request: dict) -> dict:
        """A generate request → ``{"batch", "metrics", "extra_fields"}`` (docs/rollout_replicas.md §3)."""
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        start = time.perf_counter()
        shape = latent_shape_of(self.engine_kwargs["model"], self.cfg.height, self.cfg.width)
        requests = build_engine_requests(self.cfg, request, shape, sampling_params_cls=OmniDiffusionSamplingParams)
        outputs = self._engine.call(self._engine.generate_all(requests))
        batch = collate_trajectories([trajectory_of(o) for o in outputs])
        batch["group_ids"] = torch.as_tensor(request["group_ids"], dtype=torch.long)
        elapsed = time.perf_counter() - start
        trained = [int(k) for k in torch.nonzero(batch["train_mask"].any(0)).flatten()]
        metrics = {"perf/rollout_time": elapsed, "perf/rollout_time_per_image": elapsed / max(len(requests), 1),
                   "rollout/window_start": float(min(trained)) if trained else -1.0,
                   "rollout/num_trained_steps": float(len(trained))}
        g = int(self.global_steps)
        return {"batch": batch, "metrics": metrics,
                "extra_fields": {"global_steps": g, "min_global_steps": g, "max_global_steps": g}}

    # ------------------------------------------------------------------ verl BaseRollout

    async def update_weights(self, weights, wire_format: str = "named_tensors", global_steps: Optional[int] = None,
                             **kwargs):
        """Weights from the checkpoint engine: LoRA-only → add_lora(new) + remove_lora(old); else full weights."""
        if wire_format != "named_tensors":
            raise ValueError(f"the vllm_omni replica receives wire_format='named_tensors', got {wire_format!r}; use "
                             "a full-tensor checkpoint-engine backend")
        named = []
        if hasattr(weights, "__aiter__"):
            async for item in weights:
                named.append(item)
        else:
            named.extend(weights)
        lora, full = split_lora_weights(named)
        if lora and full:
            raise ValueError(f"a weight update mixes {len(lora)} LoRA and {len(full)} base weights (e.g. "
                             f"{next(iter(full))!r}); with LoRA the actor sends the adapter only")
        if lora:
            self.load_lora(lora)
        elif full:
            self.load_full(full)
        if global_steps is not None:
            self.global_steps = int(global_steps)

    def load_lora(self, state: dict) -> None:
        from vllm_omni.lora.request import LoRARequest

        old, self._lora_id = self._lora_id, self._lora_id + 1
        path = write_lora_dir(self._lora_dir / str(self._lora_id), state,
                              {"r": self.lora_rank, "lora_alpha": self.lora_alpha,
                               "target_modules": self.target_modules})
        engine = self._engine
        if not engine.call(engine.engine.add_lora(LoRARequest(f"verl_{self._lora_id}", self._lora_id, str(path)))):
            raise RuntimeError(f"vllm-omni refused LoRA {path}; is the worker extension {WORKER_EXTENSION} active?")
        if old:
            engine.call(engine.engine.remove_lora(old))

    def load_full(self, state: dict) -> None:
        engine = self._engine
        engine.call(engine.engine.collective_rpc("verl_load_weights", args=(list(state.items()),)))

    def wake_up_engine(self, tags: Optional[list[str]] = None) -> None:
        """Wake the engine (``tags``: vllm's "weights" / "kv_cache"; None = all)."""
        if self._engine is not None and bool(self.engine_kwargs.get("enable_sleep_mode")):
            self._engine.call(self._engine.engine.wake_up(tags=list(tags) if tags else None))

    def sleep_engine(self) -> None:
        """Sleep level 1: weights offloaded to host memory, not discarded (the text encoders and the VAE are not
        part of a weight sync, so level 2 would lose them)."""
        if self._engine is not None and bool(self.engine_kwargs.get("enable_sleep_mode")):
            self._engine.call(self._engine.engine.sleep(level=1))

    def shutdown_engine(self) -> None:
        """Stop this adapter's engine (tests, and a replica that is torn down)."""
        if self._engine is not None:
            engine, self._engine = self._engine, None
            engine.shutdown()

    async def resume(self, tags: list[str]):
        await asyncio.to_thread(self.wake_up_engine, tags)

    async def release(self):
        await asyncio.to_thread(self.sleep_engine)


# replica_rank -> the adapter living in this process (the server reaches it with __ray_call__).
_LOCAL: dict[int, VllmOmniServerAdapter] = {}


def _serve(_actor, *, replica_rank: int, request: dict) -> dict:
    return _LOCAL[replica_rank].serve(request)


def _version(_actor, *, replica_rank: int) -> int:
    return int(_LOCAL[replica_rank].global_steps)


def _control(_actor, *, replica_rank: int, method: str) -> None:
    adapter = _LOCAL[replica_rank]
    adapter.wake_up_engine() if method == "wake_up" else adapter.sleep_engine()


class VllmOmniServer(BatchServerControls):
    """Server actor of one vllm_omni replica: forwards to the adapter in the replica's GPU worker."""

    def __init__(self, replica_rank: int, workers: list):
        self.replica_rank = int(replica_rank)
        self.workers = list(workers)

    async def generate(self, request: dict) -> dict:
        return await self.workers[0].__ray_call__.remote(
            functools.partial(_serve, replica_rank=self.replica_rank, request=request))

    async def get_global_steps(self) -> int:
        return int(await self.workers[0].__ray_call__.remote(functools.partial(_version,
                                                                                 replica_rank=self.replica_rank)))

    async def wake_up(self) -> None:
        await self.workers[0].__ray_call__.remote(functools.partial(_control, replica_rank=self.replica_rank,
                                                                    method="wake_up"))

    async def sleep(self) -> None:
        await self.workers[0].__ray_call__.remote(functools.partial(_control, replica_rank=self.replica_rank,
                                                                    method="sleep"))


class VllmOmniReplica(RolloutReplica):
    """A vllm-omni replica: one GPU, standalone (its own pool; weights through verl's checkpoint engine)."""

    def __init__(self, replica_rank: int, config, model_config, gpus_per_node: int = 8,
                 is_reward_model: bool = False, is_teacher_model: bool = False, name_suffix: str = "") -> None:
        # verl's __init__ would turn ``config`` into its LLM RolloutConfig, which lacks our sampler keys.
        self.replica_rank = int(replica_rank)
        self.config = config
        self.model_config = model_config
        self.world_size = _world_size(config)
        if self.world_size != 1:
            raise ValueError(f"the vllm_omni replica runs one GPU per replica, but rollout tensor × data × pipeline "
                             f"parallel sizes = {self.world_size}; set them to 1 and scale with more replicas")
        self.gpus_per_node = int(gpus_per_node)
        self.gpus_per_replica_node = 1
        self.nnodes = 1
        self.is_reward_model = bool(is_reward_model)
        self.is_teacher_model = bool(is_teacher_model)
        self.name_suffix = f"_{name_suffix}" if name_suffix else ""
        self.rollout_mode = None
        self.workers: list = []
        self.resource_pool = None
        self.bundle_indices: list[int] = []
        self.servers: list = []
        self._server_address: Optional[str] = None
        self._server_handle = None

    def _colocated(self, *args, **kwargs):
        raise NotImplementedError(
            "the vllm_omni replica runs standalone (actor_rollout_ref.rollout.placement=standalone): its engine has "
            "its own copy of the pipeline and receives weights through the checkpoint engine")

    init_hybrid = init_hybrid_colocated = init_colocated = _colocated

    async def init_standalone(self):
        from verl.single_controller.ray import RayWorkerGroup, ResourcePoolManager

        self.rollout_mode = RolloutMode.STANDALONE
        name = f"vllm_omni_rollout_pool_{self.replica_rank}{self.name_suffix}"
        manager = ResourcePoolManager(resource_pool_spec={name: [1]}, mapping=None, max_colocate_count=1)
        manager.create_resource_pool()
        self.resource_pool = manager.resource_pool_dict[name]
        group = RayWorkerGroup(resource_pool=self.resource_pool, ray_cls_with_init=self.get_ray_class_with_init_args(),
                               bin_pack=False, name_prefix=f"vllm_omni_rollout_{self.replica_rank}{self.name_suffix}",
                               use_gpu=True, device_name="cuda")
        self.workers = group.workers
        await self.launch_servers()

    def get_ray_class_with_init_args(self):
        import ray
        from verl.checkpoint_engine.base import CheckpointEngineWorker
        from verl.single_controller.ray import RayClassWithInitArgs

        return RayClassWithInitArgs(cls=ray.remote(CheckpointEngineWorker), rollout_config=self.config,
                                    model_config=self.model_config, replica_rank=self.replica_rank)

    async def launch_servers(self):
        import ray

        server = ray.remote(VllmOmniServer).options(
            name=f"vllm_omni_server_{self.replica_rank}{self.name_suffix}_{uuid.uuid4().hex[:6]}",
            num_cpus=0, max_concurrency=64).remote(replica_rank=self.replica_rank, workers=self.workers)
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"vllm_omni://standalone/{self.replica_rank}"


def load_vllm_omni_replica() -> type:
    return VllmOmniReplica
