"""Validation and the run's artifacts (a mixin of ``RayFlowGRPOTrainer``): the ODE validation of fixed prompts and
noise, its per-image scores and composition-weighted metrics, the grids, reward_curve.png and before_after.png."""

from __future__ import annotations

import os

import numpy as np
import torch
from verl import DataProto

from verl_diffusion.trainer.console import validation_line
from verl_diffusion.trainer.dataset import METADATA_KEYS
from verl_diffusion.trainer.run_dir import BASELINE_NAME
from verl_diffusion.trainer.tag_report import composition_key, composition_metrics, tag_of
from verl_diffusion.trainer.validation import (
    caption, log_images, read_validation_scores, save_grid, write_validation_scores)


def row_metadata(non_tensor: dict, n: int) -> list[dict]:
    """Per-row reward metadata (``reward_model`` with the ground truth, ``extra_info``, ``data_source``) of a
    batch's non-tensor columns: what the rewards read, the same for training and validation."""
    return [{k: non_tensor[k][i] for k in METADATA_KEYS if k in non_tensor} for i in range(n)]


class ValidationMixin:
    """``_validate`` (metrics, files, tracker images) and ``refresh_artifacts`` (the curve and the before/after sheet)."""

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
