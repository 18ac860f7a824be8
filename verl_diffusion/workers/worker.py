"""Our actor-rollout(-ref) worker: verl's ``TrainingWorker`` for the actor (and the reference when not LoRA)
plus the in-process diffusers rollout sharing the actor's FSDP module: the colocated replica samples with the
actor's own parameters (verl's "naive" weight sync hands them over and checks they are the same tensors).

verl's ``ActorRolloutRefWorker.init_model`` is LLM-specific (HF config, token rollout registry, checkpoint
engine); like it, we compose ``TrainingWorker`` instances, and we do not bend it.

RPCs (all ``DP_COMPUTE_PROTO`` over samples unless noted): ``init_model`` (all), ``generate_sequences``,
``compute_old_log_prob``, ``update_actor``, ``generate_validation``, ``save_checkpoint`` /
``load_checkpoint`` (all).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Optional

import numpy as np
import torch
import torch.distributed
from omegaconf import DictConfig, OmegaConf

from verl import DataProto
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.device import get_device_id, get_device_name

from verl_diffusion.distributed import init_cpu_process_group
from verl_diffusion.models.base import pad_text_rows as _pad_text
from verl_diffusion.config.schema import ActorRolloutRefSection, ModelSection
from verl_diffusion.workers.resharding import reshard as _reshard, resharded_swap as _resharded_swap
from verl_diffusion.workers.step_loss import DiffusionStepLoss, prepare_steps, step_loss_for
from verl_diffusion.workers.weight_sync import WeightSyncSender

# Rollout keys that travel to the engine (images and strings stay behind).
_TRAIN_KEYS = ("all_latents", "sigmas", "train_mask", "rollout_log_probs", "sde_cx", "sde_cv", "sde_std",
               "old_velocities", "prompt_embeds", "pooled_prompt_embeds", "prompt_mask", "negative_prompt_embeds",
               "negative_pooled_prompt_embeds", "negative_prompt_mask", "old_log_probs", "advantages", "group_ids",
               "step_advantages")


# Rollout outputs that can stay in the worker between rollout and update (the bulk of a step's bytes).
_HEAVY_KEYS = ("all_latents", "old_velocities", "prompt_embeds", "pooled_prompt_embeds", "prompt_mask",
               "negative_prompt_embeds", "negative_pooled_prompt_embeds", "negative_prompt_mask")


def _negative_cond(rows):
    """The unconditional (CFG) conditioning stored by a guided rollout, or None."""
    from verl_diffusion.models.base import Conditioning

    if "negative_prompt_embeds" not in rows.keys():
        return None
    return Conditioning.from_dict({k[len("negative_"):]: rows[k] for k in rows.keys() if k.startswith("negative_")})


def diffusion_model_config(m: ModelSection, *, lora: bool):
    """The engine's DiffusionModelConfig from the typed ``actor_rollout_ref.model`` (no LoRA layers with lora False:
    the frozen reference)."""
    from verl_diffusion.workers.engine import DiffusionModelConfig

    ls = m.lora
    return DiffusionModelConfig(
        path=m.path, transformer_subfolder=m.transformer_subfolder,
        lora_rank=ls.lora_rank if lora else 0, lora_alpha=ls.lora_alpha, target_modules=ls.target_modules,
        init_lora_weights=ls.init_lora_weights, lora_adapter_path=ls.lora_adapter_path,
        enable_gradient_checkpointing=m.enable_gradient_checkpointing)


class DiffusionActorRolloutRefWorker(WeightSyncSender, Worker):
    """Actor (verl TrainingWorker + our engine) + in-process diffusers rollout (+ frozen reference)."""

    def __init__(self, config: DictConfig, role: str = "actor_rollout", log_dir: Optional[str] = None,
                 settings: Optional[ActorRolloutRefSection] = None):
        if log_dir:   # this worker's output into the run directory (logs/worker_<rank>.log), not the console
            from verl_diffusion.process_log import redirect_process_output

            redirect_process_output(os.path.join(log_dir, f"worker_{os.environ.get('RANK', '0')}.log"))
        init_cpu_process_group()
        Worker.__init__(self)
        # verl's engine, optimizer and checkpoint configs are built from the DictConfig; our own settings are the
        # typed section the driver built (or, for a worker built alone, typed here from the same node).
        self.config = config
        self.settings = settings if settings is not None else ActorRolloutRefSection.from_node(config)
        self.role = role
        self.actor = None
        self.ref = None
        self.adapter = None
        self.rollout = None
        self.ema = None
        # Soft old-policy copy θ_old (docs/algorithms.md §8.2; actor.old_policy), None with schedule none.
        self.old_policy = None
        self.step_loss: Optional[DiffusionStepLoss] = None
        self._cache: Optional[dict] = None
        self._update_count = 0

    # ------------------------------------------------------------------ build

    def _training_worker_config(self, model_config, *, forward_only: bool):
        from verl.trainer.config import CheckpointConfig
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.config import TrainingWorkerConfig

        actor = self.config.actor
        node = OmegaConf.create(OmegaConf.to_container(actor.fsdp_config, resolve=True))
        node.strategy = str(actor.strategy)
        node.forward_only = bool(forward_only)
        engine_config = omega_conf_to_dataclass(node)
        engine_config.use_dynamic_bsz = False
        engine_config.micro_batch_size_per_gpu = int(actor.ppo_micro_batch_size_per_gpu)
        engine_config.infer_micro_batch_size_per_gpu = int(
            self.config.rollout.get("log_prob_micro_batch_size_per_gpu") or actor.ppo_micro_batch_size_per_gpu)
        optim = None if forward_only else omega_conf_to_dataclass(actor.optim)
        ckpt = omega_conf_to_dataclass(actor.checkpoint, dataclass_type=CheckpointConfig)
        return TrainingWorkerConfig(model_type="diffusion_model", model_config=model_config,
                                    engine_config=engine_config, optimizer_config=optim, checkpoint_config=ckpt)

    def _model_config(self, *, lora: bool):
        return diffusion_model_config(self.settings.model, lora=lora)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        from verl.workers.engine_workers import TrainingWorker

        from verl_diffusion.models.base import Conditioning
        from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout
        from verl_diffusion.workers.platform_cpu import skip_gpu_numa_affinity

        torch.manual_seed(int(self.config.actor.fsdp_config.get("seed", 42)))
        s = self.settings
        self.step_loss = step_loss_for(s)

        skip_gpu_numa_affinity()  # CPU platform: no GPU to pin CPUs to (and no libnuma line per worker)
        # 1. actor: verl's TrainingWorker around our engine (model_type diffusion_model).
        self.actor = TrainingWorker(config=self._training_worker_config(self._model_config(lora=True),
                                                                        forward_only=False))
        self.actor.reset()
        self.actor.set_loss_fn(self.step_loss)
        engine = self.actor.engine

        # 2. rollout: the model adapter (VAE, text encoders) whose transformer is the actor's FSDP module.
        self.adapter = s.model.adapter_cls.from_pretrained(s.model.path, dtype=s.model.torch_dtype,
                                                           device=get_device_name(), **s.model.adapter_kwargs)
        self.adapter.transformer = engine.module
        # Drop the pipeline's own transformer copy (the engine built the trained one): one copy per process.
        self.adapter.pipe.transformer = engine.module
        adapter = self.adapter
        rollout_cfg = s.rollout.sampler
        guidance = float(rollout_cfg.guidance_scale)

        def velocity_factory(module):
            # The trained velocity is the sampler's: guided (one batched [negative; conditional] forward, as in
            # the rollout) when rollout.guidance_scale != 1, so training scores exactly what was sampled.
            def velocity(x_t, t, rows):
                return adapter.velocity(x_t, t, Conditioning.from_dict(rows), guidance_scale=guidance,
                                        negative_cond=_negative_cond(rows) if guidance != 1.0 else None)
            return velocity

        engine.velocity_fn_factory = velocity_factory
        self.rollout = DiffusersRollout(self.adapter, rollout_cfg)
        # The colocated replica's in-worker adapter, found the way verl finds its own (``_ROLLOUT_REGISTRY``);
        # replica r is worker r, so the driver-side replica server reaches it by this worker's rank.
        from verl.workers.rollout.base import _ROLLOUT_REGISTRY, get_rollout_class

        name = s.rollout.name
        self.rollout_adapter = get_rollout_class(name, "async")(
            config=self.config.rollout, model_config=self.config.model, replica_rank=self.rank,
            generate_fn=self._serve_rollout, module=engine.module)

        # 3. reference: LoRA -> the adapter disabled (engine default); full fine-tune + KL -> frozen copy.
        if self.step_loss.needs_reference() and not engine._is_lora:
            self.ref = TrainingWorker(config=self._training_worker_config(self._model_config(lora=False),
                                                                          forward_only=True))
            self.ref.reset()
            ref_module = self.ref.engine.module

            def ref_velocity(x_t, t, rows):
                saved = adapter.transformer
                adapter.transformer = ref_module
                try:
                    with torch.no_grad():
                        return velocity_factory(ref_module)(x_t, t, rows)
                finally:
                    adapter.transformer = saved

            engine.ref_velocity_fn = ref_velocity

        # 4. evaluation EMA of the trainable parameters (saved with checkpoints).
        if s.actor.ema.enable:
            from verl_diffusion.algos.ema import ParamEMA

            self.ema = ParamEMA([p for p in engine.module.parameters() if p.requires_grad],
                                decay_max=s.actor.ema.decay_max, interval=s.actor.ema.interval)
        # 5. soft old-policy copy θ_old of the trainable parameters (docs/algorithms.md §8.2), saved with checkpoints.
        from verl_diffusion.workers.old_policy import OldPolicy

        old_cfg = s.actor.old_policy
        if old_cfg.enabled:
            self.old_policy = OldPolicy([p for p in engine.module.parameters() if p.requires_grad], old_cfg)

        def extra_state():
            state = {"ema": self.ema.state_dict() if self.ema else None, "update_count": self._update_count}
            if self.old_policy is not None:
                state["old_policy"] = self.old_policy.state_dict()
                state["optimizer_steps"] = int(engine.optimizer_steps)
            return state

        engine.extra_state_fn = extra_state

        def load_extra(state):
            if state.get("ema") is not None and self.ema is not None:
                self.ema.load_state_dict(state["ema"])
            self._update_count = int(state.get("update_count", 0))
            if self.old_policy is not None:
                if state.get("old_policy") is not None:
                    self.old_policy.load_state_dict(state["old_policy"])
                else:   # checkpoint written without θ_old: start it from the loaded weights
                    self.old_policy.reset()
            if "optimizer_steps" in state:
                engine.optimizer_steps = int(state["optimizer_steps"])

        engine.load_extra_state_fn = load_extra
        return {"lora": bool(engine._is_lora), "reference": "adapter_disabled" if engine._is_lora else (
            "frozen_copy" if self.ref is not None else "none"), "loss": self.step_loss.name,
            "architecture": self.adapter.architecture, "grid": rollout_cfg.grid,
            "max_sequence_length": getattr(self.adapter, "max_sequence_length", None),
            # The plugin's entry in verl's rollout dict, as this worker process sees it (tests read it per worker).
            "rollout_adapter": _ROLLOUT_REGISTRY.get((name, "async"), ""),
            "replica_rank": int(self.rollout_adapter.replica_rank)}

    # ------------------------------------------------------------------ rollout

    def _serve_rollout(self, prompts: DataProto) -> DataProto:
        """What the replica's adapter runs for a request: validation images (``meta_info['validate']``) or a
        training rollout of this rank's rows."""
        if prompts.meta_info.get("validate", False):
            return self._generate_validation(prompts)
        return self._generate_sequences(prompts)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    def update_weights(self, global_steps: Optional[int] = None, mode: str = "naive"):
        """verl's checkpoint-engine weight sync. ``naive`` (V1 sync, colocated): hand the actor's parameters to the
        in-worker rollout adapter; they are the sampler's own tensors, the adapter checks that and records the
        version. Any other backend (standalone / async replicas): send the weights through it (weight_sync.py)."""
        import asyncio

        if mode != "naive":
            return self.send_weights(global_steps=global_steps, backend=mode)
        params = ((n, p) for n, p in self.actor.engine.module.named_parameters())
        asyncio.run(self.rollout_adapter.update_weights(params, global_steps=global_steps))
        return {"rollout/foreign_tensors": float(self.rollout_adapter.foreign_tensors)}

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Rollout of this rank's samples (the same as a replica request; kept for direct worker tests)."""
        return self._generate_sequences(prompts)

    def _generate_sequences(self, prompts: DataProto) -> DataProto:
        """Rollout of this rank's samples (prompts already repeated n times, ``uid`` per group)."""
        meta = prompts.meta_info
        texts = [str(p) for p in prompts.non_tensor_batch["prompt"]]
        uids = prompts.non_tensor_batch["uid"]
        _, group_ids = np.unique(np.asarray(uids).astype(str), return_inverse=True)
        seed = int(meta.get("seed", 0)) * 1000 + self.rank
        store = bool({"old_velocity", "old_mean"} & set(self.step_loss.spec.batch_keys))
        engine = self.actor.engine
        branched = self.settings.rollout.branched
        start = time.perf_counter()
        with engine.eval_mode(), self._old_policy_swap(rollout=True):
            if branched is None:
                out = self.rollout.generate(texts, torch.as_tensor(group_ids, dtype=torch.long), seed=seed,
                                            iteration=int(meta.get("iteration", 0)), store_velocities=store)
            else:
                # TempFlow (docs/algorithms.md §3.3): one prompt per row in, one row per (prompt, k, child) out, prompt-major;
                # group_ids / prompt_ids are local here, the driver makes them global.
                from verl_diffusion.rollout.branched import generate_branched

                out = generate_branched(self.rollout, texts, seed=seed, branch_steps=branched.branch_steps,
                                        num_children=branched.num_children, store_velocities=store)
        elapsed = time.perf_counter() - start
        metrics = dict(self.rollout.metrics)
        metrics["perf/rollout_time"] = elapsed
        if branched is None:
            out["group_ids"] = torch.as_tensor(group_ids, dtype=torch.long)
        # Heavy per-sample tensors (trajectories, text embeddings) stay in this worker until the update: the
        # driver needs only images, masks and log-probs, and the next calls get the same rows (same dispatch).
        self._cache = None
        if self.settings.rollout.keep_trajectories_in_worker:
            self._cache = {"seed": int(meta.get("seed", 0)), "rows": int(out["train_mask"].shape[0]),
                           "tensors": {k: out.pop(k) for k in _HEAVY_KEYS if k in out}}
        else:
            _pad_text(out, int(getattr(self.adapter, "max_sequence_length", 0) or 0))
        return DataProto.from_dict(tensors=out, meta_info={"metrics": metrics})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_validation(self, data: DataProto) -> DataProto:
        """ODE images of fixed prompts and seeds (the same as a validation replica request)."""
        return self._generate_validation(data)

    def _generate_validation(self, data: DataProto) -> DataProto:
        """ODE images of fixed prompts and seeds (EMA weights when an EMA is kept)."""
        texts = [str(p) for p in data.non_tensor_batch["prompt"]]
        seeds = [int(s) for s in data.non_tensor_batch["seed"]]
        num_steps = data.meta_info.get("num_steps", None)
        engine = self.actor.engine
        _reshard(engine)   # EMA swaps the sharded parameters: drop unsharded copies kept after a forward
        ctx = self.ema.swap_in() if self.ema is not None else _null()
        with engine.eval_mode(), ctx:
            images = self.rollout.generate_ode(texts, seeds=seeds, num_steps=num_steps)
            _reshard(engine)
        return DataProto.from_dict(tensors={"images": images})

    def _old_policy_swap(self, *, rollout: bool = False):
        """θ_old in the parameters (no grad, θ restored bitwise on exit) when a soft copy is kept; for the rollout
        only with ``old_policy.use_for_rollout``. Otherwise a no-op (θ_old = the current, pre-update weights)."""
        if self.old_policy is None or (rollout and not self.old_policy.cfg.use_for_rollout):
            return contextlib.nullcontext()
        return _resharded_swap(self.actor.engine, self.old_policy)

    # ------------------------------------------------------------------ training

    def _rows(self, data: DataProto):
        """This rank's rows: the tensors sent by the driver plus the ones kept here since the rollout."""
        from tensordict import TensorDict

        tensors = {k: data.batch[k] for k in _TRAIN_KEYS if k in data.batch.keys()}
        cache = getattr(self, "_cache", None)
        if cache is not None and "all_latents" not in tensors:
            seed = int(data.meta_info.get("seed", cache["seed"]))
            if cache["rows"] != len(data) or cache["seed"] != seed:
                raise RuntimeError(
                    f"worker {self.rank}: the batch ({len(data)} rows, seed {seed}) is not the one this worker rolled "
                    f"out ({cache['rows']} rows, seed {cache['seed']}); keep the batch order between "
                    "generate_sequences and update_actor or set rollout.keep_trajectories_in_worker=false")
            tensors.update({k: v for k, v in cache["tensors"].items() if k in _TRAIN_KEYS})
        return TensorDict(tensors, batch_size=[len(data)])

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_old_log_prob(self, data: DataProto) -> DataProto:
        """Off-policy: ℓ_θ [B, N] at the trained steps with the current weights (same kernel as the rollout)."""
        from verl.utils import tensordict_utils as tu

        td = self._rows(data)
        tu.assign_non_tensor(td, compute_loss=True, global_token_num=None)
        out = self.actor.infer_batch(td)
        return DataProto.from_dict(tensors={"old_log_probs": out["log_probs"]})

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs × mini-batches over this rank's samples; returns the metrics (lists per micro-step)."""
        from verl.utils import tensordict_utils as tu

        meta = data.meta_info
        engine = self.actor.engine
        td = self._rows(data)
        start = time.perf_counter()
        # θ-independent per-step pre-processing over whole groups, before mini-batching.
        gen = torch.Generator().manual_seed(int(meta.get("seed", 0)) * 1000 + 500 + self.rank)
        with engine.eval_mode(), self._old_policy_swap():
            # OLD_VELOCITY_FRESH: θ_old swapped in when a soft copy is kept, else the pre-update weights.
            prep = prepare_steps(self.step_loss, dict(td.items()), velocity_fn=engine.velocity_fn(), generator=gen)
        for k, v in prep.items():
            td[k] = v
        mini = int(meta["mini_batch_size"])
        tu.assign_non_tensor(td, mini_batch_size=mini, epochs=int(meta.get("ppo_epochs", 1)),
                             seed=int(meta.get("seed", 0)),
                             dataloader_kwargs={"shuffle": bool(meta.get("shuffle", False))})
        engine.consistency_probe = True
        before = self._trainable_snapshot() if self.settings.actor.log_update_size else None
        out = self.actor.train_mini_batch(td)
        self._cache = None
        metrics = dict(tu.get(out, "metrics")) if out is not None else {}
        if self.ema is not None:
            self.ema.step(self._update_count)
        self._update_count += 1
        if self.old_policy is not None:
            # docs/algorithms.md §8.2: after this batch's training, n = optimizer steps so far.
            _reshard(engine)
            metrics["actor/old_policy_decay"] = self.old_policy.update(int(engine.optimizer_steps))
        if before is not None:
            metrics.update(self._update_size(before))
        metrics["perf/update_time"] = time.perf_counter() - start
        metrics["perf/worker_max_rss_gb"] = _max_rss_gb()
        return DataProto(meta_info={"metrics": metrics})

    def _trainable_snapshot(self) -> list[torch.Tensor]:
        """A copy of this rank's shards of the trainable parameters (for the update's size). Resharded first: after
        a forward with ``reshard_after_forward: false`` the module holds the gathered parameters, and after the update
        the shards; both sides must be shards to be compared."""
        _reshard(self.actor.engine)
        return [_local(p).detach().clone() for p in self.actor.engine.module.parameters() if p.requires_grad]

    def _update_size(self, before: list[torch.Tensor]) -> dict[str, float]:
        """|Δθ| and |Δθ| / |θ| of this step's update over all ranks' shards of the trainable parameters."""
        _reshard(self.actor.engine)
        after = [_local(p).detach() for p in self.actor.engine.module.parameters() if p.requires_grad]
        sums = torch.zeros(2, dtype=torch.float64)
        for b, a in zip(before, after):
            sums[0] += (a.double() - b.double()).pow(2).sum().cpu()
            sums[1] += b.double().pow(2).sum().cpu()
        if torch.distributed.is_initialized():
            sums = sums.to(get_device_id())
            torch.distributed.all_reduce(sums)
            sums = sums.cpu()
        norm = float(sums[0].sqrt())
        return {"actor/update_norm": norm, "actor/update_rel_norm": norm / max(float(sums[1].sqrt()), 1e-30)}

    # ------------------------------------------------------------------ checkpoints

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None):
        _reshard(self.actor.engine)
        self.actor.save_checkpoint(local_path, hdfs_path, global_step, max_ckpt_to_keep)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False):
        _reshard(self.actor.engine)
        self.actor.load_checkpoint(local_path, hdfs_path, del_local_after_load)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def export_model(self, output: str, info: dict) -> Optional[str]:
        """The trained transformer (the evaluation EMA when one is kept, as validation samples) written by rank 0
        to ``output`` in a format stock diffusers loads (export/writer.py; ``info`` describes the run). Every rank
        takes part in gathering the shards. Returns the path on rank 0, None elsewhere."""
        from verl_diffusion.export.writer import write_export

        engine = self.actor.engine
        _reshard(engine)
        with (self.ema.swap_in() if self.ema is not None else _null()):
            state = full_state_dict(engine.module, trainable_only=bool(engine._is_lora), keep=self.rank == 0)
            _reshard(engine)
        if self.rank != 0:
            return None
        info = dict(info, weights="ema" if self.ema is not None else "trained")
        return write_export(state, info, output, merge=bool(info.get("merge_lora", False)))


def full_state_dict(module: torch.nn.Module, *, trainable_only: bool, keep: bool) -> dict:
    """Whole tensors of an FSDP2 module's state dict, gathered one by one (a collective: every rank calls it, in
    the same order); only the trainable weights with ``trainable_only``. ``keep``: return them (rank 0) or not."""
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    out = {}
    for key, value in module.state_dict().items():
        if trainable_only and key not in trainable:
            continue
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        if keep:
            out[key] = full.detach().to("cpu", copy=True)
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) parameter; a plain tensor as it is."""
    return p.to_local() if hasattr(p, "to_local") else p


def _max_rss_gb() -> float:
    """Peak resident memory of this worker process (Linux ru_maxrss is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
