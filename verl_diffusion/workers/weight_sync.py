"""The actor side of weight sync: what verl's ``CheckpointEngineManager`` needs from the actor
worker group besides its ``update_weights(global_steps, mode)`` RPC (the worker's, which calls :meth:`send_weights`
for every backend but ``naive``): ``execute_checkpoint_engine(method, ...)`` and the engine itself.

Backend ``naive`` (colocated replica): the rollout samples with the actor's own module, nothing moves. Any other
backend (``diffusion_gloo``, or one a user registers): the actor's transformer weights go through the backend's
``send_weights``; a LoRA actor sends only its adapter tensors (the replica loads the same base model and injects
the same LoRA layers, so the base never needs to cross).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Optional

from verl.single_controller.base.decorator import Dispatch, register

__all__ = ["WeightSyncSender", "checkpoint_engine_settings", "run_coroutine"]


def checkpoint_engine_settings(rollout_cfg) -> dict[str, Any]:
    """{backend, bucket_size (bytes), engine_kwargs, custom_backend_module} of ``rollout.checkpoint_engine``.

    Defaults (no node): backend ``naive`` (colocated), 256 MB buckets.
    """
    node = rollout_cfg.get("checkpoint_engine", None) if rollout_cfg is not None else None
    node = node or {}
    backend = str(node.get("backend", "naive") or "naive")
    mb = int(node.get("update_weights_bucket_megabytes", 256) or 256)
    kwargs = node.get("engine_kwargs", None) or {}
    kwargs = dict(kwargs.get(backend, None) or {})
    return {"backend": backend, "bucket_size": mb << 20, "engine_kwargs": kwargs,
            "custom_backend_module": node.get("custom_backend_module", None)}


def run_coroutine(coro):
    """Run ``coro`` to completion from synchronous code, also when this thread already runs an event loop
    (a Ray async actor): then in a helper thread with its own loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


class WeightSyncSender:
    """Mixin for the actor worker: builds the checkpoint engine lazily from ``self.config.rollout`` and sends the
    engine's module (``self.actor.engine.module``). Needs ``self.config``, ``self.actor`` and ``self.rank``."""

    _weight_sync_engine = None

    def _checkpoint_engine(self):
        if self._weight_sync_engine is None:
            from verl.checkpoint_engine import CheckpointEngineRegistry
            from verl.utils.import_utils import import_external_libs

            s = checkpoint_engine_settings(self.config.rollout)
            import_external_libs(s["custom_backend_module"] or None)
            self._weight_sync_engine = CheckpointEngineRegistry.new(
                s["backend"], is_master=(int(self.rank) == 0), bucket_size=s["bucket_size"], **s["engine_kwargs"])
        return self._weight_sync_engine

    def weight_sync_backend(self) -> str:
        return checkpoint_engine_settings(self.config.rollout)["backend"]

    def send_weights(self, global_steps: Optional[int] = None, backend: Optional[str] = None) -> dict:
        """Send the actor's transformer through the checkpoint engine (the worker's ``update_weights`` calls this for
        every backend but ``naive``). Every actor rank walks the weights: gathering a shard is collective. A LoRA
        actor sends its adapter tensors only. Returns the engine's ``weight_sync/...`` metrics (rank 0)."""
        from verl_diffusion.rollout.checkpoint_engine import actor_weights
        from verl_diffusion.workers.resharding import reshard as _reshard

        backend = backend or self.weight_sync_backend()
        if backend != self.weight_sync_backend():
            raise ValueError(f"update_weights(mode={backend!r}) but actor_rollout_ref.rollout.checkpoint_engine."
                             f"backend={self.weight_sync_backend()!r}; the engine is built from the config")
        engine = self.actor.engine
        _reshard(engine)
        weights = actor_weights(engine.module, lora_only=bool(getattr(engine, "_is_lora", False)))
        metrics = run_coroutine(self._checkpoint_engine().send_weights(weights, global_steps=global_steps))
        return metrics or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        """verl's manager calls prepare / init_process_group / finalize through this on every actor rank."""
        return getattr(self._checkpoint_engine(), method)(*args, **kwargs)
