"""RayFlowGRPOTrainer: verl's V1 **sync** trainer (``PPOTrainerSync``) with the token-shaped parts replaced for
images (docs/data_flow.md), registered as ``diffusion_sync`` (``trainer.v1.trainer_mode``). This module holds verl's
hooks and the loop; checkpointing, validation and artifacts, replica generation, the branched rollout, the
train-mask edits and the step's scoring and advantages are mixins in their own modules (checkpointing.py,
artifacts.py, generation.py, branched.py, train_masks.py, scoring.py), the console lines in console.py. Our settings
come typed (``run_config``, config/schema.py); verl's parts read the DictConfig ``config``.

Reused from verl: the trainer registry, ``init()`` (setup, then the first weight sync), the sync hooks
(``on_sample_end`` puts the replicas to sleep, ``on_step_end`` syncs the weights through ``CheckpointEngineManager``),
the replicas of ``RolloutReplicaRegistry``, the checkpoint layout and verl's loader for ``resume_mode=resume_path``.
Replaced, and why: ``_setup`` builds our worker group, replicas and checkpoint-engine manager instead of an LLM
tokenizer, reward-loop workers, agent loop and router (each extra Ray actor costs seconds and hundreds of MB on a
small host); no TransferQueue or replay buffer (the sync step trains the batch it just sampled, whose trajectories
stay in the workers that sampled them); rewards are scored on the driver by our components with per-component
failure accounting (reward_health.py); the dataloader (prompts, no tokenizer), old log-probs (the rollout's
on-policy), advantages through verl's ``get_adv_estimator_fn`` on ``sample_level_rewards``, the actor update and
``fit`` (the image loop, calling verl's sync hooks where verl's ``fit`` does).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import numpy as np
import ray
import torch
from omegaconf import OmegaConf, open_dict

from verl import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.trainer.ppo.utils import Role
from verl.trainer.ppo.v1.trainer_base import PPOTrainer, register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from verl_diffusion.config.schema import RunConfig
from verl_diffusion.trainer import signals
from verl_diffusion.trainer.artifacts import ValidationMixin
from verl_diffusion.trainer.branched import BranchedMixin
from verl_diffusion.trainer.checkpointing import CheckpointingMixin
from verl_diffusion.trainer.checkpoints import ResumePoint
from verl_diffusion.trainer.console import progress_line
from verl_diffusion.trainer.dataset import build_dataloaders
from verl_diffusion.trainer.generation import GenerationMixin
from verl_diffusion.trainer.metrics import reduce_worker_metrics
from verl_diffusion.trainer.resources import make_resource_pool_manager
from verl_diffusion.trainer.reward_health import NoSignalMonitor, RewardBudgetExceeded, RewardHealth
from verl_diffusion.trainer.run_dir import METRICS_NAME, WORKER_LOG_DIR, MetricsLog, write_run_state
from verl_diffusion.trainer.scoring import ScoringMixin
from verl_diffusion.trainer.signals import GracefulStop, StopRequested
from verl_diffusion.trainer.train_masks import TrainMaskMixin


TRAINER_NAME = "diffusion_sync"


@register_trainer(TRAINER_NAME)
class RayFlowGRPOTrainer(CheckpointingMixin, ValidationMixin, GenerationMixin, BranchedMixin, TrainMaskMixin,
                         ScoringMixin, PPOTrainerSync):
    """Flow-GRPO family trainer on verl's V1 sync trainer: one actor worker group, one colocated ``diffusers``
    rollout replica per worker (module docstring: what is verl's and what is replaced).

    Args: config: the composed run config (``flowgrpo_trainer.yaml`` on verl's ``ppo_trainer``), which verl's parts
    read. run_config: the same config typed (``config.schema.RunConfig``), which ours read; built from ``config``
    when not given. reward_fn: the
    driver-side reward (``rewards.build_reward``), ``(images, prompts, metadata) -> RewardResult``. run_dir: where
    metrics, validation images and run state go. progress: print the workers / step / validation lines.
    worker_cls: the actor+rollout worker class (default ``DiffusionActorRolloutRefWorker``).
    ``init()`` (verl's) builds the workers and replicas and syncs the weights; ``fit()`` trains.
    """

    samples_ahead = False   # the next batch is sampled after this one's update (async_trainer.py samples ahead)

    def __init__(self, config, reward_fn, run_dir: Optional[str] = None, progress: bool = True,
                 worker_cls=None, run_config: Optional[RunConfig] = None):
        self._run_config = run_config
        self.reward_fn = reward_fn
        self.run_dir = run_dir or os.getcwd()
        self.progress = progress
        self.worker_cls = worker_cls
        self.history: list[dict] = []
        self.val_history: list[dict] = []
        self.val_images: dict[int, torch.Tensor] = {}
        self.metrics_log = MetricsLog(os.path.join(self.run_dir, METRICS_NAME))
        self.resume_point: Optional[ResumePoint] = None   # set by main_flowgrpo's run plan; else found at load
        self.reward_health: Optional[RewardHealth] = None    # at _setup, from the typed trainer section
        self.no_signal = NoSignalMonitor()
        self._saved_step: Optional[int] = None
        self._exported_step: Optional[int] = None
        self.exported_model: Optional[str] = None
        self.global_steps = 0
        self.rollout_replicas: list = []
        self.curr_step_profile = False
        self.timing_raw: dict = {}
        PPOTrainer.__init__(self, config)

    @property
    def run_config(self) -> RunConfig:
        """The typed config (config/schema.py) main_flowgrpo built, or typed here from ``config`` on first use."""
        if self._run_config is None:
            self._run_config = RunConfig.from_omegaconf(self.config)
        return self._run_config

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
        loaders = build_dataloaders(self.config)
        (self.train_dataset, self.val_dataset, self.train_sampler, self.train_dataloader,
         self.val_dataloader) = loaders
        self.steps_per_epoch = len(self.train_dataloader)
        total = len(self.train_dataloader) * int(self.config.trainer.total_epochs)
        if self.config.trainer.total_training_steps is not None:
            total = int(self.config.trainer.total_training_steps)
        self.total_training_steps = total
        with open_dict(self.config):
            self.config.actor_rollout_ref.actor.optim.total_training_steps = total

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
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.utils.config import omega_conf_to_dataclass

        from verl_diffusion.rollout.diffusers_standalone import resolve_standalone_config

        # rollout.placement=standalone: the sampler in replicas of its own, weights through a real backend.
        standalone_backend = resolve_standalone_config(self.config.actor_rollout_ref)
        self.reward_health = RewardHealth(self.run_config.trainer.reward_failure_budget)
        self._init_tokenizer()
        self._init_dataloader()
        self._init_dump_executor()
        self._init_resource_pool_mgr()
        self.resource_pool_manager.create_resource_pool()
        pool = self.resource_pool_manager.get_resource_pool(Role.ActorRollout)
        cls = RayClassWithInitArgs(cls=self.role_worker_mapping[Role.ActorRollout],
                                   config=self.config.actor_rollout_ref, settings=self.run_config.actor_rollout_ref,
                                   role="actor_rollout",
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
        engine_cfg.backend = self._launch_replicas(standalone_backend)
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

    # ------------------------------------------------------------------ step helpers

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
