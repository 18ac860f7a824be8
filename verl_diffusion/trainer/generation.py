"""Sampling through the rollout replicas (a mixin of ``RayFlowGRPOTrainer``): the step's prompt rows, one request per
replica with its contiguous share of the rows, the answers gathered in replica order."""

from __future__ import annotations

from typing import Optional

import numpy as np
import ray
from verl import DataProto


class GenerationMixin:
    """The rollout replicas, and the generation requests of a step and of a validation."""

    def _launch_replicas(self, standalone_backend: Optional[str]) -> str:
        """The rollout replicas: standalone ones with their own processes and ``standalone_backend`` for the
        weights (rollout.placement=standalone), else one colocated replica per worker from verl's
        ``RolloutReplicaRegistry`` (``rollout.name``) inside the worker group, synced by the naive backend.
        Returns the checkpoint-engine backend."""
        import asyncio

        from verl.workers.rollout.replica import RolloutReplicaRegistry

        rollout = self.config.actor_rollout_ref.rollout
        if standalone_backend is not None:
            from verl_diffusion.rollout.diffusers_standalone import launch_standalone_replicas

            self.rollout_replicas = launch_standalone_replicas(self.config.actor_rollout_ref)
            return standalone_backend
        replica_cls = RolloutReplicaRegistry.get(str(rollout.get("name", "diffusers")))
        self.rollout_replicas = [replica_cls(replica_rank=r, config=rollout,
                                             model_config=self.config.actor_rollout_ref.model,
                                             gpus_per_node=int(self.config.trainer.n_gpus_per_node))
                                 for r in range(self.world_size)]

        async def launch():
            await asyncio.gather(*[r.init_hybrid(self.actor_rollout_wg) for r in self.rollout_replicas])

        asyncio.run(launch())
        return "naive"

    def _adapter_workers(self) -> int:
        """Workers whose process found the replica's in-worker adapter in verl's rollout dict under its own rank."""
        return sum(1 for r, i in enumerate(self.worker_infos)
                   if i.get("rollout_adapter") and int(i.get("replica_rank", -1)) == r)

    def _generate(self, batch: DataProto, step: int) -> tuple[DataProto, dict]:
        """One request per replica with its contiguous share of the rows (replica r = worker r, the rows the
        worker's update later trains); the answers concatenated in replica order. Returns (batch, metrics as
        per-replica lists, plus ``rollout/weights_version``: the version the replicas sampled with)."""
        return self._collect_generation(self._submit_generation(batch, step))

    def _submit_generation(self, batch: DataProto, step: int) -> list:
        """The replica requests of ``_generate``, sent; returns their ObjectRefs (or answers) in replica order."""
        replicas = self.rollout_replicas
        shards = batch.chunk(len(replicas)) if len(replicas) > 1 else [batch]
        return [rep.server_handle.generate({"prompts": shard, "global_steps": step})
                for rep, shard in zip(replicas, shards)]

    def _collect_generation(self, refs: list) -> tuple[DataProto, dict]:
        """The answers of ``_submit_generation`` as ``_generate`` returns them."""
        outs = [ray.get(r) if isinstance(r, ray.ObjectRef) else r for r in refs]
        metrics: dict = {}
        versions = []
        for o in outs:
            for k, v in (o.meta_info.pop("metrics", None) or {}).items():
                metrics.setdefault(k, []).append(v)
            versions.append(int((o.meta_info.pop("extra_fields", None) or {}).get("global_steps", -1)))
        out = DataProto.concat(outs) if len(outs) > 1 else outs[0]
        if versions:
            metrics["rollout/weights_version"] = [min(versions)]
        return out, metrics

    def _gen_batch(self, batch_dict: dict, step: int) -> DataProto:
        """Repeat each prompt n times (a group, one ``uid``); deterministic uids so resumed runs match.
        Branched: each prompt once (the worker makes its |branch steps| × num_children rows)."""
        n = 1 if self._branched() is not None else int(self.config.actor_rollout_ref.rollout.n)
        prompts = batch_dict["prompt"]
        rows = {k: np.repeat(v, n, axis=0) for k, v in batch_dict.items()}
        rows["uid"] = np.repeat(np.array([f"s{step}-p{i}" for i in range(len(prompts))], dtype=object), n)
        seed = int(self.config.trainer.get("seed", 0)) + step
        return DataProto.from_dict(non_tensors=rows, meta_info={"seed": seed, "iteration": step - 1})
