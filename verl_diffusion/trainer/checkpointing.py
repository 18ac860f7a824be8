"""Saving, resuming and exporting for the trainer (a mixin of ``RayFlowGRPOTrainer``): verl's checkpoint layout with a
manifest and an atomic tracker (checkpoints.py), resume from the newest complete checkpoint, storage errors that stop
the run cleanly, ``model_info.json`` beside every checkpoint and the diffusers export of the trained model."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.v1.trainer_base import PPOTrainer

from verl_diffusion.trainer.checkpoints import (
    MANIFEST_NAME, atomic_write_text, find_resume_checkpoint, list_step_dirs, step_dir, write_manifest, write_tracker)
from verl_diffusion.trainer.console import warn
from verl_diffusion.trainer.run_dir import RunDirError, as_storage_error, write_run_state

MODEL_INFO_NAME = "model_info.json"   # beside a checkpoint's actor/: what python -m verl_diffusion.export reads


class CheckpointingMixin:
    """Checkpoint save / load and model export; expects the trainer's config, run_dir, worker group and dataloader."""

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

    def model_info(self, step: int) -> dict:
        """What a checkpoint (``model_info.json``) and an exported model (``export_info.json``) say about the
        weights: the base model, the LoRA settings, the algorithm and reward, the latest validation, and the
        sampling settings of the validation (what ``python -m verl_diffusion.sample`` reuses)."""
        a = self.config.actor_rollout_ref
        lora = None
        if self.worker_info.get("lora"):
            ls = self.run_config.actor_rollout_ref.model.lora
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
                             "max_sequence_length": self.worker_info.get("max_sequence_length"),
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
