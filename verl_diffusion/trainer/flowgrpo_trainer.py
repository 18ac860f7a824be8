"""RayFlowGRPOTrainer: verl's V1 **sync** trainer (``PPOTrainerSync``) with the token-shaped parts replaced for
images (docs/data_flow.md). Registered in verl's V1 trainer registry as ``diffusion_sync`` (``trainer.v1.trainer_mode``).

Reused from verl's V1 trainer: the trainer registry, ``init()`` (setup, then ``on_init_end``: the first weight
sync), the sync hooks (``on_sample_end`` puts the replicas to sleep, ``on_step_end`` syncs the weights through
verl's ``CheckpointEngineManager``, naive backend), the rollout replicas from verl's ``RolloutReplicaRegistry``
(``actor_rollout_ref.rollout.name``, ``diffusers`` by default: rollout/diffusers_replica.py), the checkpoint layout
(``global_step_<k>/actor`` written by the workers, ``data.pt``, the latest-iteration file; verl's loader for
``resume_mode=resume_path``). Saving adds a manifest and an atomic tracker, and ``auto`` resumes from the newest
complete checkpoint; the run directory, the per-step metrics file, reward-failure accounting and the graceful stop
live in small trainer-independent modules (``run_dir``, ``checkpoints``, ``reward_health``, ``signals``).

Replaced, and why:
- ``_setup``: verl's builds an LLM tokenizer, ``ActorRolloutRefWorker`` roles, the reward-loop workers, the agent
  loop and an LLM router actor. Ours builds our worker group, one ``diffusers`` replica per worker and the
  checkpoint-engine manager. Each Ray actor verl would add imports verl (~6 s and 500 MB each on a 2-core host):
  the start-up cost measured in docs/benchmarks.md.
- TransferQueue and the replay buffer are not used in sync mode: the step trains exactly the batch it just
  sampled, and the bulk of a step (trajectories [B, T+1, C, h, w], text embeddings) stays in the worker that
  sampled it (``rollout.keep_trajectories_in_worker``); the driver handles images, masks and log-probs only.
- Rewards: the driver scores images with our reward components (``reward.components``) and keeps the per-component
  failure accounting, ``reward.timeout`` and the failure budget (reward_health.py): verl's reward loop scores
  token responses in its own workers and returns one score per sample, with no per-component failures.
- The dataloader (prompts, no tokenizer), the generation call (replica requests), old log-probs (the rollout's
  on-policy, recomputed otherwise), advantages through verl's ``get_adv_estimator_fn`` on
  ``sample_level_rewards``, the actor update (PPO epochs × mini-batches), metrics and ODE validation, and ``fit``:
  the image loop with its progress line, metrics file, validation artifacts and graceful stop; it calls verl's
  sync hooks at the points verl's ``fit`` does.
"""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import numpy as np
import ray
import torch
from omegaconf import OmegaConf, open_dict

from verl import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.single_controller.ray.base import ResourcePoolManager
from verl.trainer.ppo.core_algos import get_adv_estimator_fn
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl_diffusion.trainer.checkpoints import (
    MANIFEST_NAME, ResumePoint, atomic_write_text, find_resume_checkpoint, list_step_dirs, step_dir, write_manifest,
    write_tracker)
from verl_diffusion.trainer.dataset import METADATA_KEYS, EpochShuffleSampler, PromptDataset, collate_prompts
from verl_diffusion.trainer.metrics import advantage_summary, group_image_std, reduce_worker_metrics, reward_metrics
from verl_diffusion.trainer.reward_health import (
    NoSignalMonitor, RewardBudgetExceeded, RewardFailureBudget, RewardHealth, failure_summary)
from verl_diffusion.trainer.run_dir import (
    BASELINE_NAME, METRICS_NAME, WORKER_LOG_DIR, MetricsLog, RunDirError, as_storage_error, write_run_state)
from verl_diffusion.trainer import signals
from verl_diffusion.trainer.signals import GracefulStop, StopRequested
from verl_diffusion.trainer.tag_report import BY_COMPOSITION, composition_key, composition_metrics, tag_of
from verl_diffusion.trainer.validation import (
    caption, log_images, read_validation_scores, save_grid, write_validation_scores)

MODEL_INFO_NAME = "model_info.json"   # beside a checkpoint's actor/: what python -m verl_diffusion.export reads


def row_metadata(non_tensor: dict, n: int) -> list[dict]:
    """Per-row reward metadata (``reward_model`` with the ground truth, ``extra_info``, ``data_source``) of a
    batch's non-tensor columns: what the rewards read, the same for training and validation."""
    return [{k: non_tensor[k][i] for k in METADATA_KEYS if k in non_tensor} for i in range(n)]


def warn(line: str) -> None:
    """A warning on the progress stream (stdout, flushed), so it sits between the step lines it concerns."""
    print(f"WARNING: {line}", flush=True)


def branched_advantages(rewards: torch.Tensor, prompt_ids: torch.Tensor, branch_step: torch.Tensor,
                        train_mask: torch.Tensor, *, eps: float = 1e-4, clip: Optional[float] = 5.0
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """TempFlow process advantages of a branched batch (docs/algorithms.md §3.3), driver side.

    Args: rewards [B] (one per child image); prompt_ids [B] global prompt index; branch_step [B]; train_mask [B, N].
    Returns (step_advantages [B, N]: the child's advantage, normalised within (prompt, k) across the children, at
    column k; advantages [B, N]: the same values on ``train_mask``, the per-sample fallback that tempflow_grpo reads
    when ``step_advantages`` is absent).
    """
    from verl_diffusion.algos.advantages import branched_step_advantages

    step_adv = branched_step_advantages(rewards.float(), prompt_ids, branch_step, int(train_mask.shape[1]),
                                        eps=eps, clip=clip)
    return step_adv, step_adv * train_mask.to(step_adv.dtype)


class CpuAwareResourcePoolManager(ResourcePoolManager):
    """verl's check counts only GPU/NPU ("Total available GPUs 0"); count the platform's Ray resource."""

    def _check_resource_available(self):
        from verl.utils.device import get_resource_name

        name = get_resource_name()
        avail = sum(info.get(name, 0) for info in ray._private.state.available_resources_per_node().values())
        need = sum(n for nodes in self.resource_pool_spec.values() for n in nodes)
        if avail < need:
            raise ValueError(f"Ray has {avail} {name} available but the trainer asks for {need} workers "
                             f"(trainer.nnodes × trainer.n_gpus_per_node); lower trainer.n_gpus_per_node")


def make_resource_pool_manager(config) -> CpuAwareResourcePoolManager:
    spec = {"global_pool": [int(config.trainer.n_gpus_per_node)] * int(config.trainer.nnodes)}
    return CpuAwareResourcePoolManager(resource_pool_spec=spec, mapping={Role.ActorRollout: "global_pool"},
                                       max_colocate_count=1)


TRAINER_NAME = "diffusion_sync"


@register_trainer(TRAINER_NAME)
class RayFlowGRPOTrainer(PPOTrainerSync):
    """Flow-GRPO family trainer on verl's V1 sync trainer: one actor worker group, one colocated ``diffusers``
    rollout replica per worker (module docstring: what is verl's and what is replaced).

    Args: config: the composed run config (``flowgrpo_trainer.yaml`` on verl's ``ppo_trainer``). reward_fn: the
    driver-side reward (``rewards.build_reward``), ``(images, prompts, metadata) -> RewardResult``. run_dir: where
    metrics, validation images and run state go. progress: print the workers / step / validation lines.
    worker_cls: the actor+rollout worker class (default ``DiffusionActorRolloutRefWorker``).
    ``init()`` (verl's) builds the workers and replicas and syncs the weights; ``fit()`` trains.
    """

    def __init__(self, config, reward_fn, run_dir: Optional[str] = None, progress: bool = True,
                 worker_cls=None):
        self.reward_fn = reward_fn
        self.run_dir = run_dir or os.getcwd()
        self.progress = progress
        self.worker_cls = worker_cls
        self.history: list[dict] = []
        self.val_history: list[dict] = []
        self.val_images: dict[int, torch.Tensor] = {}
        self.metrics_log = MetricsLog(os.path.join(self.run_dir, METRICS_NAME))
        self.resume_point: Optional[ResumePoint] = None   # set by main_flowgrpo's run plan; else found at load
        self.reward_health = RewardHealth(RewardFailureBudget.from_dict(
            config.trainer.get("reward_failure_budget", None)))
        self.no_signal = NoSignalMonitor()
        self._saved_step: Optional[int] = None
        self._exported_step: Optional[int] = None
        self.exported_model: Optional[str] = None
        self.global_steps = 0
        self.rollout_replicas: list = []
        self.curr_step_profile = False
        self.timing_raw: dict = {}
        PPOTrainer.__init__(self, config)

    def _build_replay_buffer(self):
        """None: the sync step trains the batch it just sampled, whose trajectories stay in the workers (module
        docstring); verl's replay buffer indexes TransferQueue rows."""
        return None

    # ------------------------------------------------------------------ data

    def _init_tokenizer(self):
        """Prompts are text for the model adapter's own encoders: no LLM tokenizer or processor."""
        self.tokenizer = None
        self.processor = None

    def _init_dataloader(self):
        """Prompt rows (no tokenizer), an epoch-seeded shuffle (resumes reproduce the order), ``total_training_steps``."""
        from torchdata.stateful_dataloader import StatefulDataLoader

        data = self.config.data
        key = data.get("prompt_key", "prompt")
        self.train_dataset = PromptDataset(list(data.train_files), prompt_key=key,
                                           max_samples=data.get("train_max_samples", -1))
        self.val_dataset = PromptDataset(list(data.val_files), prompt_key=key,
                                         max_samples=data.get("val_max_samples", -1))
        self.train_sampler = EpochShuffleSampler(len(self.train_dataset), seed=int(data.get("seed", 1)),
                                                 shuffle=bool(data.get("shuffle", True)))
        self.train_dataloader = StatefulDataLoader(
            self.train_dataset, batch_size=int(data.train_batch_size), sampler=self.train_sampler,
            drop_last=True, collate_fn=collate_prompts, num_workers=0)
        self.val_dataloader = StatefulDataLoader(self.val_dataset, batch_size=len(self.val_dataset),
                                                 shuffle=False, collate_fn=collate_prompts, num_workers=0)
        if len(self.train_dataloader) < 1:
            raise ValueError(f"data.train_batch_size={data.train_batch_size} is larger than the "
                             f"{len(self.train_dataset)} training prompts")
        self.steps_per_epoch = len(self.train_dataloader)
        total = len(self.train_dataloader) * int(self.config.trainer.total_epochs)
        if self.config.trainer.total_training_steps is not None:
            total = int(self.config.trainer.total_training_steps)
        self.total_training_steps = total
        with open_dict(self.config):
            self.config.actor_rollout_ref.actor.optim.total_training_steps = total

    def _load_checkpoint(self):
        """Resume from the newest complete checkpoint (checkpoints.find_resume_checkpoint; damaged newer ones and
        a bad tracker are named in a warning). verl's loader is not used for ``auto``: it reads the tracker first
        and crashes on an empty one. Existing checkpoints with none complete stop the run instead of training
        from scratch over them. The dataloader state is restored except at an epoch boundary, where it marks the
        epoch exhausted and the sampler's epoch is set from the global step instead (the order of an epoch
        depends only on (seed, epoch)). metrics.jsonl keeps the rows up to the resumed step."""
        trainer_cfg = self.config.trainer
        mode = str(trainer_cfg.get("resume_mode", "auto"))
        out = 0
        if mode == "auto":
            point = self.resume_point or find_resume_checkpoint(self._ckpt_dir())
            if point.warning() and self.resume_point is None:   # the run plan's own line already said it
                warn(point.warning())
            if point.path is None and point.existing:
                raise RunDirError(f"{self._ckpt_dir()} has checkpoints but none is complete ({point.warning()}); "
                                  "pass trainer.overwrite=true to start from scratch over them")
            if point.path is not None:
                self.global_steps = int(point.step)
                self.actor_rollout_wg.load_checkpoint(os.path.join(point.path, "actor"),
                                                      del_local_after_load=bool(trainer_cfg.get(
                                                          "del_local_ckpt_after_load", False)))
                per_epoch = len(self.train_dataloader)
                data = os.path.join(point.path, "data.pt")
                if os.path.exists(data) and not (per_epoch and self.global_steps % per_epoch == 0):
                    self.train_dataloader.load_state_dict(torch.load(data, weights_only=False))
                if self.progress:
                    print(f"resumed from {point.path} (step {self.global_steps})", flush=True)
        elif mode != "disable":
            out = PPOTrainer._load_checkpoint(self)
        per_epoch = len(self.train_dataloader)
        if self.global_steps and per_epoch and self.global_steps % per_epoch == 0:
            self.train_sampler.set_epoch(self.global_steps // per_epoch)
        if os.path.exists(self.metrics_log.path):
            self.metrics_log.keep_until(int(self.global_steps))
        return out

    def _ckpt_dir(self) -> str:
        return os.path.abspath(str(self.config.trainer.default_local_dir))

    def _save_checkpoint(self):
        """:meth:`_write_checkpoint`, and the model export after it. A save that fails for lack of space or write
        permission removes its partial folder (it never had a manifest, so it never counted as complete), writes
        ``run_state.json`` saying why and raises :class:`StorageError` (one line; the run stops, exit 4)."""
        step = int(self.global_steps)
        try:
            self._write_checkpoint()
        except Exception as e:
            err = as_storage_error(e, step_dir(self._ckpt_dir(), step), f"saving the checkpoint of step {step}")
            if err is None:
                raise
            import shutil

            shutil.rmtree(step_dir(self._ckpt_dir(), step), ignore_errors=True)
            self._record_stop(step, str(err))
            raise err from None
        self._export(step)

    def _export(self, step: int) -> None:
        """:meth:`export_model`, with a full or read-only disk handled as in :meth:`_save_checkpoint`."""
        try:
            self.export_model(step)
        except Exception as e:
            err = as_storage_error(e, os.path.join(self.run_dir, "model"), f"exporting the model of step {step}")
            if err is None:
                raise
            self._record_stop(step, str(err))
            raise err from None

    def _record_stop(self, step: int, reason: str) -> None:
        try:
            write_run_state(self.run_dir, "stopped", step, reason=reason)
        except OSError:
            pass   # the same full or read-only disk; the message on the console says it

    def _write_checkpoint(self):
        """verl's layout (``global_step_<k>/actor`` by the workers, ``data.pt``), then ``manifest.json`` listing
        every file with its size, then the tracker, atomically (checkpoints.py): a save cut at any point leaves
        the previous complete checkpoint as the newest complete one. Folders whose ``actor/`` verl pruned
        (``trainer.max_actor_ckpt_to_keep``) go entirely."""
        step = int(self.global_steps)
        if self._saved_step == step:
            return
        ckpt_dir = self._ckpt_dir()
        folder = step_dir(ckpt_dir, step)
        if os.path.exists(os.path.join(folder, MANIFEST_NAME)):   # a stale one must not vouch for this save
            os.remove(os.path.join(folder, MANIFEST_NAME))
        hdfs = self.config.trainer.get("default_hdfs_dir", None)
        remote = None if hdfs is None else os.path.join(str(hdfs), f"global_step_{step}", "actor")
        keep = self.config.trainer.get("max_actor_ckpt_to_keep", None)
        self.actor_rollout_wg.save_checkpoint(os.path.join(folder, "actor"), remote, step, max_ckpt_to_keep=keep)
        os.makedirs(folder, exist_ok=True)
        torch.save(self.train_dataloader.state_dict(), os.path.join(folder, "data.pt"))
        atomic_write_text(os.path.join(folder, MODEL_INFO_NAME), json.dumps(self.model_info(step), indent=1,
                                                                               default=str))
        write_manifest(folder)
        write_tracker(ckpt_dir, step)
        for old in list_step_dirs(ckpt_dir):
            path = step_dir(ckpt_dir, old)
            if old != step and not os.path.exists(os.path.join(path, "actor")):
                import shutil

                shutil.rmtree(path, ignore_errors=True)
        self._saved_step = step
        if self.progress:
            print(f"checkpoint: {folder}", flush=True)

    # ------------------------------------------------------------------ the trained model

    def model_info(self, step: int) -> dict:
        """What a checkpoint (``model_info.json``) and an exported model (``export_info.json``) say about the
        weights: the base model, the LoRA settings, the algorithm and reward, the latest validation, and the
        sampling settings of the validation (what ``python -m verl_diffusion.sample`` reuses)."""
        from verl_diffusion.rollout.settings import lora_settings

        a = self.config.actor_rollout_ref
        lora = None
        if self.worker_info.get("lora"):
            ls = lora_settings(a.model)
            targets = ls.target_modules
            lora = {"rank": int(ls.lora_rank), "alpha": float(ls.lora_alpha),
                    "target_modules": targets if isinstance(targets, str) else [str(t) for t in targets]}
        r = a.rollout
        val = self.val_history[-1] if self.val_history else {}
        export = self.config.trainer.get("export", None) or {}
        return {"base_model": str(a.model.path), "architecture": self.worker_info.get("architecture"),
                "lora": lora, "step": int(step), "experiment": str(self.config.trainer.experiment_name),
                "algorithm": f"{a.actor.policy_loss.loss_mode} ({self.config.algorithm.adv_estimator} advantages)",
                "reward": OmegaConf.to_container(self.config.reward.components, resolve=True),
                "ema": bool((a.actor.get("ema", None) or {}).get("enable", False)),
                "merge_lora": bool(export.get("merge_lora", False)),
                "validation": {k: v for k, v in val.items() if k == "step" or (k.startswith("val/") and isinstance(
                    v, float) and (k == "val/reward_mean" or k.endswith("/strict")))},
                "sampling": {"sampler": "ode", "num_steps": int(r.get("val_num_steps", 40)),
                             "dtype": str(a.model.get("dtype", "fp32")),
                             "resolution": int(r.get("resolution", 512)),
                             "guidance_scale": float(r.get("guidance_scale", 1.0)),
                             "negative_prompt": str(r.get("negative_prompt", "") or ""),
                             "grid": str(r.get("grid", "scheduler")), "shift": float(r.get("shift", 3.0)),
                             "val_files": [str(f) for f in self.config.data.val_files],
                             "num_images": int(self.config.trainer.get("val_num_images", 0) or 0)}}

    def export_model(self, step: int) -> Optional[str]:
        """The weights of ``step`` into ``<run_dir>/model`` in a format stock diffusers loads (workers gather the
        shards, rank 0 writes; export/writer.py), unless ``trainer.export.enable`` is off or it is there already."""
        export = self.config.trainer.get("export", None) or {}
        if not bool(export.get("enable", True)) or self._exported_step == step:
            return self.exported_model
        out = os.path.join(self.run_dir, "model")
        paths = self.actor_rollout_wg.export_model(out, self.model_info(step))
        self.exported_model = next((p for p in (paths if isinstance(paths, list) else [paths]) if p), out)
        self._exported_step = step
        return self.exported_model

    # ------------------------------------------------------------------ workers

    def _init_resource_pool_mgr(self):
        """Our worker for the actor+rollout role, on a pool whose check counts the platform's Ray resource (CPU
        included; verl's counts GPUs/NPUs only)."""
        from verl_diffusion.workers.worker import DiffusionActorRolloutRefWorker

        self.role_worker_mapping = {Role.ActorRollout: ray.remote(self.worker_cls or DiffusionActorRolloutRefWorker)}
        self.resource_pool_manager = make_resource_pool_manager(self.config)

    def _setup(self):
        """Dataloader, the worker group (``init_model`` on every rank), one colocated replica per worker from verl's
        ``RolloutReplicaRegistry``, verl's ``CheckpointEngineManager`` (naive backend, as V1 sync forces), the
        replicas put to sleep, then the checkpoint load. verl's own ``_setup`` is not called (module docstring)."""
        import asyncio

        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.utils.config import omega_conf_to_dataclass
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        from verl_diffusion.rollout.diffusers_standalone import resolve_standalone_config

        # rollout.placement=standalone: the sampler in replicas of its own, weights through a real backend.
        standalone_backend = resolve_standalone_config(self.config.actor_rollout_ref)
        self._init_tokenizer()
        self._init_dataloader()
        self._init_dump_executor()
        self._init_resource_pool_mgr()
        self.resource_pool_manager.create_resource_pool()
        pool = self.resource_pool_manager.get_resource_pool(Role.ActorRollout)
        cls = RayClassWithInitArgs(cls=self.role_worker_mapping[Role.ActorRollout],
                                   config=self.config.actor_rollout_ref, role="actor_rollout",
                                   log_dir=os.path.join(self.run_dir, WORKER_LOG_DIR))
        self.device_name = str(self.config.trainer.device)
        self.actor_rollout_wg = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=cls, device_name=self.device_name)
        self.world_size = self.actor_rollout_wg.world_size
        info = self.actor_rollout_wg.init_model()
        self.worker_infos = list(info) if isinstance(info, list) else [info]
        self.worker_info = self.worker_infos[0]
        self.ref_policy_wg = self.actor_rollout_wg
        self.use_critic = False
        self.use_rm = False

        rollout = self.config.actor_rollout_ref.rollout
        engine_cfg = omega_conf_to_dataclass(rollout.checkpoint_engine)
        if standalone_backend is not None:
            from verl_diffusion.rollout.diffusers_standalone import launch_standalone_replicas

            self.rollout_replicas = launch_standalone_replicas(self.config.actor_rollout_ref)
            engine_cfg.backend = standalone_backend
        else:
            replica_cls = RolloutReplicaRegistry.get(str(rollout.get("name", "diffusers")))
            self.rollout_replicas = [replica_cls(replica_rank=r, config=rollout,
                                                 model_config=self.config.actor_rollout_ref.model,
                                                 gpus_per_node=int(self.config.trainer.n_gpus_per_node))
                                     for r in range(self.world_size)]

            async def launch():
                await asyncio.gather(*[r.init_hybrid(self.actor_rollout_wg) for r in self.rollout_replicas])

            asyncio.run(launch())
            engine_cfg.backend = "naive"
        self.checkpoint_manager = CheckpointEngineManager(config=engine_cfg, actor_wg=self.actor_rollout_wg,
                                                          replicas=self.rollout_replicas)
        self.checkpoint_manager.sleep_replicas()
        self.global_steps = 0
        self._load_checkpoint()
        if self.progress:
            a = self.config.actor_rollout_ref
            print(f"workers: {self.world_size} actor+rollout on {self.device_name} ({a.actor.strategy}) | loss {self.worker_info.get('loss')} | "
                  f"LoRA {'r' + str(a.model.lora_rank) if self.worker_info.get('lora') else 'off'} | "
                  f"reference {self.worker_info.get('reference')} | {self._batch_samples()} images/step, "
                  f"{self.total_training_steps} steps | rollout {len(self.rollout_replicas)} "
                  f"{rollout.get('name', 'diffusers')} replicas, adapter in {self._adapter_workers()}/{self.world_size} "
                  f"workers (V1 {TRAINER_NAME})", flush=True)

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

    # ------------------------------------------------------------------ step helpers

    def _branched(self) -> Optional[dict]:
        """{num_children, branch_steps} of the TempFlow branched rollout when enabled, else None."""
        from verl_diffusion.workers.worker import branched_settings

        return branched_settings(self.config.actor_rollout_ref.rollout)

    def _rows_per_prompt(self) -> int:
        """Rows of a step per prompt: rollout.n, or |branch steps| × num_children for a branched rollout."""
        br = self._branched()
        if br is not None:
            return len(br["branch_steps"]) * int(br["num_children"])
        return int(self.config.actor_rollout_ref.rollout.n)

    def _gen_batch(self, batch_dict: dict, step: int) -> DataProto:
        """Repeat each prompt n times (a group, one ``uid``); deterministic uids so resumed runs match.
        Branched: each prompt once (the worker makes its |branch steps| × num_children rows)."""
        n = 1 if self._branched() is not None else int(self.config.actor_rollout_ref.rollout.n)
        prompts = batch_dict["prompt"]
        rows = {k: np.repeat(v, n, axis=0) for k, v in batch_dict.items()}
        rows["uid"] = np.repeat(np.array([f"s{step}-p{i}" for i in range(len(prompts))], dtype=object), n)
        seed = int(self.config.trainer.get("seed", 0)) + step
        return DataProto.from_dict(non_tensors=rows, meta_info={"seed": seed, "iteration": step - 1})

    def _compute_reward(self, batch: DataProto, images: torch.Tensor, step: int = 0) -> dict[str, float]:
        """Score the step's images; failures per reward are counted, reported in the metrics and the progress
        line, and a warning marks each fault's start and end (reward_health.RewardHealth)."""
        meta = row_metadata(batch.non_tensor_batch, len(batch))
        res = self.reward_fn(images, list(batch.non_tensor_batch["prompt"]), meta)
        batch.batch["sample_level_rewards"] = res.scores.float()
        for name, c in res.components.items():
            batch.batch[f"reward_components/{name}"] = c.float()
        out = reward_metrics(res.scores, batch.non_tensor_batch["uid"], res.components, res.failures,
                             details=res.details)
        # mode collapse / reward hacking shows as groups of near-identical images (benchmarks/compare_algorithms.py)
        out["rollout/group_image_std"] = group_image_std(images, batch.non_tensor_batch["uid"])
        out.update({f"reward/{k}" if not k.startswith("reward/") else k: float(v)
                    for k, v in (res.metrics or {}).items() if isinstance(v, (int, float))})
        health, events = self.reward_health.update(step, res.failures or {}, len(batch),
                                                   getattr(res, "causes", None))
        out.update(health)
        signal_line = self.no_signal.update(step, out)
        for line in events + ([signal_line] if signal_line else []):
            warn(line)
        return out

    def _compute_advantage(self, batch: DataProto) -> dict[str, float]:
        """verl's registered estimator (``algorithm.adv_estimator``) on sample rewards, broadcast to steps."""
        batch.batch["response_mask"] = batch.batch["train_mask"]
        fn = get_adv_estimator_fn(self.config.algorithm.adv_estimator)
        kwargs = dict(sample_level_rewards=batch.batch["sample_level_rewards"],
                      response_mask=batch.batch["response_mask"], index=batch.non_tensor_batch["uid"],
                      config=self.config.algorithm)
        comp = sorted(k for k in batch.batch.keys() if str(k).startswith("reward_components/"))
        if comp and self.config.algorithm.adv_estimator == "flow_grpo_gdpo":
            kwargs["reward_components"] = torch.stack([batch.batch[k] for k in comp], dim=-1)
        adv, returns = fn(**kwargs)
        batch.batch["advantages"] = adv.float()
        batch.batch["returns"] = returns.float()
        return advantage_summary(adv, batch.batch["response_mask"])

    def _expand_branched(self, gen: DataProto, out_batch, step: int) -> dict:
        """Per-row non-tensor data of a branched batch (rows prompt-major, then k, then child, also across workers:
        each worker gets a contiguous block of prompts); uid per (prompt, k); global prompt_ids and group_ids."""
        rpp = self._rows_per_prompt()
        kb = int(self._branched()["num_children"])
        rows = {k: np.repeat(v, rpp, axis=0) for k, v in gen.non_tensor_batch.items()}
        n_prompts = len(gen)
        prompt_ids = torch.arange(n_prompts).repeat_interleave(rpp)
        ks = out_batch["branch_step"].cpu().long()
        rows["uid"] = np.array([f"s{step}-p{int(p)}-k{int(k)}" for p, k in zip(prompt_ids, ks)], dtype=object)
        out_batch["prompt_ids"] = prompt_ids
        out_batch["group_ids"] = torch.arange(len(prompt_ids)) // kb
        return rows

    def _compute_branched_advantage(self, batch: DataProto) -> dict[str, float]:
        """docs/algorithms.md §3.3: ``step_advantages`` within (prompt, k) across children; ``advantages`` = the same values."""
        sub = self.config.algorithm.get("flow_grpo", None) or {}
        clip = sub.get("adv_clip_max", 5.0)
        step_adv, adv = branched_advantages(
            batch.batch["sample_level_rewards"], batch.batch["prompt_ids"], batch.batch["branch_step"],
            batch.batch["train_mask"], eps=float(sub.get("adv_eps", 1e-4)), clip=None if clip is None else float(clip))
        batch.batch["response_mask"] = batch.batch["train_mask"]
        batch.batch["step_advantages"] = step_adv.float()
        batch.batch["advantages"] = adv.float()
        batch.batch["returns"] = adv.float()
        return advantage_summary(adv, batch.batch["response_mask"])

    def _subsample_train_steps(self, batch: DataProto, step: int) -> dict[str, float]:
        """DanceGRPO's per-sample random subset of the window steps (``actor.train_step_fraction``, docs/algorithms.md §3.1),
        drawn from ``trainer.seed`` and the step only, so a resumed run draws the same subsets."""
        from verl_diffusion.trainer.train_masks import subsample_train_steps

        frac = float(self.config.actor_rollout_ref.actor.get("train_step_fraction", 1.0))
        if frac >= 1.0:
            return {}
        seed = (int(self.config.trainer.get("seed", 0)) + int(step)) * 1000 + 7
        gen = torch.Generator().manual_seed(seed)
        mask = batch.batch["train_mask"]
        batch.batch["train_mask"] = subsample_train_steps(mask, frac, gen)
        return {"actor/window_fraction": float(mask.float().mean())}

    def _filter_zero_advantage(self, batch: DataProto) -> dict[str, float]:
        """docs/algorithms.md §2.3: samples with A_i = 0 leave the policy-loss items (``algorithm.flow_grpo.filter_zero_advantage``);
        they stay in the batch, so the worker's prepare hook (KDE pool) still sees whole groups."""
        from verl_diffusion.trainer.train_masks import filter_zero_advantage

        sub = self.config.algorithm.get("flow_grpo", None) or {}
        if not bool(sub.get("filter_zero_advantage", False)):
            return {}
        mask, metrics = filter_zero_advantage(batch.batch["train_mask"], batch.batch["advantages"])
        batch.batch["train_mask"] = mask
        batch.batch["response_mask"] = mask
        batch.batch["advantages"] = batch.batch["advantages"] * mask.to(batch.batch["advantages"].dtype)
        return metrics

    def _on_policy(self) -> bool:
        a = self.config.actor_rollout_ref.actor
        return int(a.ppo_epochs) == 1 and self._mini_batch_size() >= self._batch_samples()

    def _batch_samples(self) -> int:
        return int(self.config.data.train_batch_size) * self._rows_per_prompt()

    def _mini_batch_size(self) -> int:
        return int(self.config.actor_rollout_ref.actor.ppo_mini_batch_size) * self._rows_per_prompt()

    def _compute_old_log_prob(self, batch: DataProto) -> dict[str, float]:
        """On-policy: bypass (the rollout's log-probs); off-policy: recompute with the current weights."""
        if self._on_policy() and not self.config.actor_rollout_ref.rollout.get("recompute_old_log_prob", False):
            batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
            return {}
        out = self.actor_rollout_wg.compute_old_log_prob(batch)
        batch.batch["old_log_probs"] = out.batch["old_log_probs"]
        m = batch.batch["train_mask"].bool()
        diff = (batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"])[m]
        return {"rollout/train_rollout_log_prob_abs_max": float(diff.abs().max()) if diff.numel() else 0.0}

    def _update_actor(self, batch: DataProto, step: int) -> dict[str, float]:
        a = self.config.actor_rollout_ref.actor
        batch.meta_info.update({"mini_batch_size": self._mini_batch_size() // self.world_size * self.world_size,
                                "ppo_epochs": int(a.ppo_epochs), "seed": int(self.config.trainer.get("seed", 0)) + step,
                                "shuffle": bool(a.get("shuffle", False))})
        out = self.actor_rollout_wg.update_actor(batch)
        return reduce_worker_metrics(out.meta_info.get("metrics", {}))

    # ------------------------------------------------------------------ validation

    def _validate(self, merged: bool = False, keep_baseline: bool = True) -> dict[str, float]:
        """ODE images of the validation prompts with fixed seeds, scored with each prompt's own metadata (the
        ground truth, as in training); ``val/reward_mean`` and every reward metric as ``val/<reward>/<detail>``
        (e.g. GenEval's per-tag accuracy). A grid PNG per validation; the first validation's images are kept in
        ``validation/baseline.pt`` so before/after compares with them across resumes."""
        batch = next(iter(self.val_dataloader))
        prompts = list(batch["prompt"])
        meta = row_metadata(batch, len(prompts))
        n_val = int(self.config.trainer.get("val_num_images", len(prompts)) or len(prompts))
        reps = (n_val + len(prompts) - 1) // len(prompts)
        prompts, meta = (prompts * reps)[:n_val], (meta * reps)[:n_val]
        seeds = list(range(len(prompts)))
        pad = (-len(prompts)) % self.world_size
        rows = {"prompt": np.array(prompts + prompts[:pad], dtype=object),
                "seed": np.array(seeds + seeds[:pad], dtype=object)}
        if self.progress:
            print(f"validation step {int(self.global_steps)}: sampling {len(prompts)} images "
                  f"({self.config.actor_rollout_ref.rollout.get('val_num_steps', 40)} ODE steps) ...", flush=True)
        out, _ = self._generate(DataProto.from_dict(non_tensors=rows, meta_info={"validate": True}),
                                int(self.global_steps))
        images = out.batch["images"][: len(prompts)]
        step = int(self.global_steps)
        self.val_images[step] = images
        path = save_grid(images, os.path.join(self.run_dir, "validation", f"step_{step:05d}.png"), scale=2)
        baseline = os.path.join(self.run_dir, BASELINE_NAME)
        if keep_baseline and not os.path.exists(baseline):
            torch.save({"step": step, "images": images.cpu()}, baseline + ".tmp")
            os.replace(baseline + ".tmp", baseline)
        res = self.reward_fn(images, prompts, meta)
        metrics = {"val/reward_mean": float(res.scores.float().mean()), "val/num_images": float(len(prompts))}
        metrics.update({"val/" + k[len("reward/"):]: float(v) for k, v in (res.metrics or {}).items()
                        if k.startswith("reward/") and isinstance(v, (int, float))})
        per_image = {"val/reward_mean": res.scores.float().tolist()}
        per_image.update({"val/" + k: v.float().tolist() for k, v in (res.details or {}).items()
                          if "val/" + k in metrics})   # the overall details (e.g. shapes/strict), not per-tag NaNs
        groups = {"tag": [tag_of(m) for m in meta], "composition": [composition_key(m, p) for m, p in zip(meta, prompts)]}
        metrics.update(composition_metrics(per_image, images, groups))
        scores = write_validation_scores(os.path.join(self.run_dir, "validation", f"step_{step:05d}.jsonl"), prompts,
                                         seeds, res.scores, res.details or {}, columns=groups)
        if getattr(self, "tracker", None) is not None:
            rows = read_validation_scores(scores)
            log_images(self.tracker, "val/images", images, step,
                       captions=[caption(p, r) for p, r in zip(prompts, rows)])
        self.val_history.append({"step": step, **metrics, "grid": path, "per_image": per_image})
        if self.progress:
            print(validation_line(step, metrics), flush=True)
        return metrics

    def refresh_artifacts(self) -> dict[str, str]:
        """reward_curve.png from the whole metrics.jsonl (every segment of a resumed run) and before_after.png
        (the first validation, from disk, vs the latest); called at every validation and at the end."""
        from verl_diffusion.trainer.validation import save_before_after, save_reward_curve

        out = {"metrics": self.metrics_log.path}
        rows = self.metrics_log.rows()
        train = [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r]
        val = [r for r in rows if "val/reward_mean" in r]
        # A reward's overall strict accuracy (e.g. val/shapes/strict), drawn when every validation has it.
        acc = sorted(k for k in (val[0] if val else {}) if k.startswith("val/") and k.endswith("/strict"))
        acc = [k for k in acc if all(k in r for r in val)][:1]
        if train:
            out["reward_curve"] = save_reward_curve(
                [s for s, _ in train], [v for _, v in train], os.path.join(self.run_dir, "reward_curve.png"),
                val_steps=[r["step"] for r in val], val_rewards=[r["val/reward_mean"] for r in val],
                val_accuracy=[r[acc[0]] for r in val] if acc else (),
                accuracy_label=f"held-out {acc[0][len('val/'):]} (ODE)" if acc else "")
        baseline = os.path.join(self.run_dir, BASELINE_NAME)
        if self.val_images and os.path.exists(baseline):
            first = torch.load(baseline, weights_only=True)
            last = max(self.val_images)
            if last != int(first["step"]):
                val = os.path.join(self.run_dir, "validation")
                rows_first = read_validation_scores(os.path.join(val, f"step_{int(first['step']):05d}.jsonl"))
                rows_last = read_validation_scores(os.path.join(val, f"step_{last:05d}.jsonl"))
                out["before_after"] = save_before_after(
                    first["images"], self.val_images[last], os.path.join(self.run_dir, "before_after.png"),
                    prompts=[r["prompt"] for r in rows_last] or [""] * len(first["images"]),
                    before_rows=rows_first, after_rows=rows_last,
                    labels=(f"step {int(first['step'])}", f"step {last}"))
        return out

    # ------------------------------------------------------------------ loop

    def fit(self):
        """The training loop. Each step's metrics row is appended to metrics.jsonl as the step ends. SIGTERM /
        SIGINT finish the step in flight, save a checkpoint and raise :class:`StopRequested`; a reward that
        fails beyond ``trainer.reward_failure_budget`` saves a checkpoint and raises
        :class:`RewardBudgetExceeded`; a finished run writes ``run_state.json`` (status finished)."""
        from verl.utils.tracking import Tracking

        cfg = self.config
        logger = Tracking(project_name=cfg.trainer.project_name, experiment_name=cfg.trainer.experiment_name,
                          default_backend=list(cfg.trainer.logger), config=OmegaConf.to_container(cfg, resolve=True))
        self.tracker = logger
        start_step = self.global_steps   # set by init()'s checkpoint load
        if cfg.trainer.get("val_only", False):
            signals.phase = "the validation (trainer.val_only)"
            metrics = self._validate(keep_baseline=False)
            logger.log(metrics, step=start_step)
            if hasattr(logger, "finish"):
                logger.finish()
            return []
        signals.phase = "the step-0 validation"
        if cfg.trainer.get("val_before_train", True) and start_step == 0 and cfg.trainer.test_freq > 0:
            val0 = self._validate()
            logger.log(val0, step=0)
            self.metrics_log.append({"step": 0, **val0})
        self.global_steps += 1
        done = self.global_steps > self.total_training_steps
        t_start, first_step = time.perf_counter(), int(self.global_steps)
        with GracefulStop() as stop:
            while not done:
                for batch_dict in self.train_dataloader:
                    step = int(self.global_steps)
                    self.timing_raw = {}
                    try:
                        self.on_step_begin()
                        metrics = self.train_step(batch_dict, step)
                    except Exception as e:
                        if stop.requested:      # the signal reached the workers too: the step is lost
                            raise StopRequested(stop.signum, step - 1) from e
                        raise
                    last = step >= self.total_training_steps
                    # verl's sync hook: the new weights to the replicas (naive backend) before validation samples.
                    t_sync = time.perf_counter()
                    self.on_step_end()
                    metrics["timing_s/update_weights"] = time.perf_counter() - t_sync
                    validated = cfg.trainer.test_freq > 0 and (step % cfg.trainer.test_freq == 0 or last)
                    if validated:
                        metrics.update(self._validate())
                    over_budget = self.reward_health.exceeded()
                    if cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or last):
                        self._save_checkpoint()
                    logger.log(metrics, step=step)
                    self.history.append({"step": step, **metrics})
                    self.metrics_log.append({"step": step, **metrics})
                    if validated:
                        self.refresh_artifacts()
                    if self.progress:
                        print(progress_line(step, self.total_training_steps, metrics,
                                            elapsed=time.perf_counter() - t_start, done=step - first_step + 1),
                              flush=True)
                    if stop.requested or over_budget:     # checked last: a signal may come at any point above
                        self._save_checkpoint()             # (a no-op when this step is saved already)
                        self.refresh_artifacts()
                        reason = f"signal {stop.signum}" if stop.requested else over_budget
                        write_run_state(self.run_dir, "stopped", step, reason=reason)
                        if stop.requested:
                            raise StopRequested(stop.signum, step)
                        raise RewardBudgetExceeded(over_budget)
                    self.global_steps += 1
                    if last:
                        done = True
                        break
        final = int(self.history[-1]["step"]) if self.history else start_step
        signals.phase = f"the end of the run (step {final} is saved in metrics.jsonl; the model export)"
        self._export(final)
        failed = self.reward_health.failed_throughout()
        if failed:   # a run shorter than the failure budget's window whose reward never worked: not a success
            self.global_steps = final     # the loop left it one past the last step
            self._save_checkpoint()
            write_run_state(self.run_dir, "stopped", final, reason=failed)
            if hasattr(logger, "finish"):
                logger.finish()
            raise RewardBudgetExceeded(failed)
        if hasattr(logger, "finish"):
            logger.finish()
        write_run_state(self.run_dir, "finished", final)
        return self.history

    def train_step(self, batch_dict: dict, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics: dict[str, float] = {}
        gen = self._gen_batch(batch_dict, step)
        self.on_sample_begin()
        out, gen_metrics = self._generate(gen, step)
        self.on_sample_end()      # verl's sync hook: replicas to sleep during the update
        t_gen = time.perf_counter()
        images = out.batch.pop("images")
        branched = self._branched() is not None
        non_tensor = self._expand_branched(gen, out.batch, step) if branched else gen.non_tensor_batch
        batch = DataProto(batch=out.batch, non_tensor_batch=non_tensor, meta_info=dict(gen.meta_info))
        metrics.update({k: float(np.mean(v)) for k, v in gen_metrics.items()})
        metrics.update(self._compute_reward(batch, images, step))
        t_rew = time.perf_counter()
        from verl_diffusion.algos.advantages import group_ids_from_uids

        batch.batch["group_ids"] = group_ids_from_uids(batch.non_tensor_batch["uid"])   # global, from uid
        metrics.update(self._subsample_train_steps(batch, step))
        if branched:
            metrics.update(self._compute_branched_advantage(batch))
        else:
            metrics.update(self._compute_advantage(batch))
        metrics.update(self._filter_zero_advantage(batch))
        metrics.update(self._compute_old_log_prob(batch))
        metrics.update(self._update_actor(batch, step))
        t_upd = time.perf_counter()
        n_img = len(batch)
        metrics.update({"timing_s/gen": t_gen - t0, "timing_s/reward": t_rew - t_gen, "timing_s/update": t_upd - t_rew,
                        "timing_s/step": t_upd - t0, "perf/time_per_image": (t_upd - t0) / n_img,
                        "perf/throughput_images_per_s": n_img / (t_upd - t0),
                        "training/global_step": float(step),
                        "actor/train_fraction": float(batch.batch["train_mask"].float().mean())})
        return metrics


def validation_line(step: int, m: dict) -> str:
    """One line per validation: mean reward, every strict accuracy a reward reports (val/<reward>/strict), its
    composition-weighted mean over tags (trainer/tag_report.py) and the within-prompt diversity."""
    parts = [f"validation step {step}", f"reward {m['val/reward_mean']:.4f}"]
    for key in sorted(k for k in m if k.startswith("val/") and k.endswith("/strict")):  # per-tag keys end with the tag
        parts.append(f"{key[len('val/'):]} {m[key]:.3f}")
        if key + BY_COMPOSITION in m:
            parts.append(f"by composition {m[key + BY_COMPOSITION]:.3f}")
    if "val/diversity" in m:
        parts.append(f"diversity {m['val/diversity']:.3f}")
    return " | ".join(parts) + f" ({int(m['val/num_images'])} images, ODE)"


def clock(seconds: float) -> str:
    """``1:02:03`` / ``4:05``."""
    seconds = int(round(max(seconds, 0.0)))
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def progress_line(step: int, total: int, m: dict, *, elapsed: Optional[float] = None, done: int = 0) -> str:
    """One line per step; with ``elapsed`` (seconds since this segment's first step) and ``done`` (its steps so
    far) it ends with the elapsed time and an ETA at this segment's mean pace (validations included)."""
    parts = [f"step {step}/{total}", f"reward {m.get('reward/mean', float('nan')):.4f}"
             f"±{m.get('reward/std', float('nan')):.4f}"]
    for key, label in (("loss", "loss"), ("actor/pg_loss", "pg"), ("grad_norm", "gnorm"),
                       ("actor/first_micro_log_ratio_abs_max", "|log ratio0|"), ("val/reward_mean", "val")):
        if key in m:
            parts.append(f"{label} {m[key]:.3g}")
    failed = failure_summary(m)
    if failed:
        parts.append(failed)
    parts.append(f"{m.get('timing_s/step', 0.0):.1f}s")
    if elapsed is not None and done > 0:
        parts.append(f"{clock(elapsed)} elapsed, ETA {clock(elapsed / done * max(total - step, 0))}")
    return " | ".join(parts)
