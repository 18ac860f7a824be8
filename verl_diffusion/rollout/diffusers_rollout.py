"""In-worker diffusers rollout: our own sampling loop over a model adapter and ``algos.sde`` (docs/data_flow.md).

Every step, stochastic or not, goes through :mod:`verl_diffusion.algos.sde` (``sampler_coefficients``,
``step_mean``, ``sde_step``), the functions the engine calls again in training; the rollout stores exactly
the tensors it used (states, coefficients, velocities), so an on-policy recomputation of the log-prob is
bitwise the rollout's (docs/algorithms.md §1.2, docs/data_flow.md).

RNG: one CPU ``torch.Generator`` seeded by ``seed`` draws, in this order, the window start (``random``
mode), the initial noise (one per sample, or one per group), then z_k [B, *] for each stochastic step k in
increasing k. All draws happen before the first forward, so the result does not depend on the
micro-batch size or the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from verl_diffusion.algos.sde import (StepCoefficients, make_grid,
                                      sampler_coefficients, sde_step, step_mean)
from verl_diffusion.algos.windows import stochastic_steps, window_steps
from verl_diffusion.config.schema import GRIDS, RolloutConfig  # noqa: F401  (the sampler's config, re-exported)
from verl_diffusion.models.base import Conditioning

__all__ = ["RolloutConfig", "DiffusersRollout", "RolloutPlan", "plan_rollout", "trajectory_coefficients",
           "ROLLOUT_KEYS", "GRIDS"]

# Keys of generate()'s output (docs/data_flow.md); ``old_velocities`` only with store_velocities, the
# ``negative_*`` embeddings only with CFG (guidance_scale != 1).
ROLLOUT_KEYS = ("all_latents", "sigmas", "train_mask", "rollout_log_probs", "sde_cx", "sde_cv", "sde_std",
                "prompt_embeds", "pooled_prompt_embeds", "images")


def _as_group_ids(group_ids) -> torch.Tensor:
    """LongTensor [B] on CPU; any other sequence (verl's string ``uid`` array) is numbered by first use."""
    if isinstance(group_ids, torch.Tensor):
        return group_ids.to(device="cpu", dtype=torch.long)
    ids: dict = {}
    return torch.tensor([ids.setdefault(g, len(ids)) for g in list(group_ids)], dtype=torch.long)


@dataclass
class RolloutPlan:
    """Every random draw of one rollout batch, in the RNG order of the module docstring, and its step sets.

    ``stochastic``: steps drawn with the sampler; ``trained``: steps whose log-prob is stored (sorted).
    ``initial_noise`` x_{t_0} [B, *] float32; ``step_noise`` {k: z_k [B, *]} for each stochastic k. All on CPU.
    A rollout backend that is handed a plan (the vllm-omni pipelines) reproduces :meth:`DiffusersRollout.generate`.
    """

    stochastic: list[int]
    trained: list[int]
    initial_noise: torch.Tensor
    step_noise: dict[int, torch.Tensor]


def plan_rollout(cfg: "RolloutConfig", group_ids, latent_shape: Sequence[int], *, seed: int, iteration: int = 0,
                 initial_noise: Optional[torch.Tensor] = None) -> RolloutPlan:
    """Draw a batch's window, initial noise and window noise from one CPU generator seeded by ``seed``.

    Args: cfg: RolloutConfig.  group_ids: [B] group of each sample (LongTensor or B hashables).
      latent_shape: dims ``*`` of one sample.  iteration: training iteration (progressive window).
      initial_noise: x_{t_0} [B, *] to use instead of drawing it.
    """
    group_ids = _as_group_ids(group_ids)
    bsz, shape = group_ids.shape[0], tuple(latent_shape)
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    n = cfg.num_steps
    if cfg.sampler == "ode":
        stochastic, trained = [], []
    elif cfg.window.mode == "none":
        stochastic = stochastic_steps(cfg.window, num_steps=n)
        trained = window_steps(cfg.window, num_steps=n)
    else:
        trained = window_steps(cfg.window, num_steps=n, iteration=iteration, generator=gen)
        stochastic = trained
    if initial_noise is None:
        if cfg.same_noise_per_group:
            _, inverse = torch.unique(group_ids, return_inverse=True)
            per_group = torch.randn((int(inverse.max()) + 1, *shape), generator=gen)
            initial_noise = per_group[inverse]
        else:
            initial_noise = torch.randn((bsz, *shape), generator=gen)
    elif tuple(initial_noise.shape) != (bsz, *shape):
        raise ValueError(f"initial_noise has shape {tuple(initial_noise.shape)}, expected {(bsz, *shape)}")
    step_noise = {k: torch.randn((bsz, *shape), generator=gen) for k in sorted(stochastic)}
    return RolloutPlan(stochastic=sorted(stochastic), trained=sorted(trained), initial_noise=initial_noise,
                       step_noise=step_noise)


def trajectory_coefficients(cfg: "RolloutConfig", sigmas: torch.Tensor,
                            stochastic: Sequence[int]) -> list[StepCoefficients]:
    """Coefficients of every step k < N: ``cfg.sampler`` at ``stochastic`` steps, the Euler ODE elsewhere.

    sigmas [b, N+1]; returns N StepCoefficients of [b] each, on sigmas' device (docs/algorithms.md §1.2).
    """
    stochastic = set(stochastic)
    return [sampler_coefficients(cfg.sampler, sigmas, k, noise_level=cfg.noise_level) if k in stochastic
            else sampler_coefficients("ode", sigmas, k, noise_level=0.0) for k in range(sigmas.shape[1] - 1)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class DiffusersRollout:
    """Generates training rollouts (SDE in the window, ODE elsewhere) and ODE validation images.

    Args: adapter: a ``FlowModelAdapter`` (``velocity``, ``encode_prompt``, ``decode``, ``latent_shape``).
      cfg: :class:`RolloutConfig`.
    After each call, ``self.metrics`` holds ``perf/...`` and ``rollout/...`` floats (generate resets it,
    generate_ode adds ``perf/val_time_per_image``).
    """

    def __init__(self, adapter, cfg: RolloutConfig):
        self.adapter = adapter
        self.cfg = cfg
        self.metrics: dict[str, float] = {}

    # ------------------------------------------------------------------ helpers

    @property
    def device(self) -> torch.device:
        return torch.device(self.adapter.device)

    def encode_prompts(self, prompts: Sequence[str]) -> Conditioning:
        """Encode each distinct prompt once (micro-batched), then index: a group shares one encoding."""
        unique = list(dict.fromkeys(prompts))
        mb = self.cfg.micro_batch_size
        cond = Conditioning.cat([self.adapter.encode_prompt(unique[i:i + mb]) for i in range(0, len(unique), mb)])
        pos = {p: i for i, p in enumerate(unique)}
        return cond.index_select(torch.tensor([pos[p] for p in prompts], device=cond.prompt_embeds.device))

    def _negative(self, n: int) -> Optional[Conditioning]:
        if self.cfg.guidance_scale == 1.0:
            return None
        return self.adapter.encode_prompt([self.cfg.negative_prompt]).index_select(torch.zeros(n, dtype=torch.long))

    def grid(self, num_steps: int, height: Optional[int] = None, width: Optional[int] = None) -> torch.Tensor:
        """t_0 = 1 > … > t_N = 0, float32 [N+1] on CPU: the model's scheduler sigmas or the formula grid (docs/algorithms.md §1.1)."""
        if self.cfg.grid == "scheduler":
            sigmas = self.adapter.sampling_grid(num_steps, height or self.cfg.height, width or self.cfg.width)
            return torch.as_tensor(sigmas, dtype=torch.float32).cpu()
        return make_grid(num_steps, self.cfg.shift, dtype=torch.float32)

    def _latent_shape(self, height: Optional[int] = None, width: Optional[int] = None) -> tuple[int, ...]:
        return tuple(self.adapter.latent_shape(height or self.cfg.height, width or self.cfg.width))

    # ------------------------------------------------------------------ the loop

    @torch.no_grad()
    def run_trajectory(self, cond: Conditioning, x_init: torch.Tensor, *, sigmas: torch.Tensor,
                       stochastic: Sequence[int] = (), trained: Sequence[int] = (),
                       step_noise: Optional[dict[int, torch.Tensor]] = None, store_velocities: bool = False,
                       negative_cond: Optional[Conditioning] = None,
                       coefficients: Optional[Sequence[StepCoefficients]] = None) -> dict[str, torch.Tensor]:
        """One micro-batch through all N steps: ``sampler`` at ``stochastic`` steps, ODE elsewhere.

        Args: cond: Conditioning [b].  x_init: x_{t_0} [b, *] float32 on the device.  sigmas: [b, N+1].
          stochastic: steps drawn with the sampler (need ``step_noise[k]`` [b, *]).  trained: steps whose
          log-prob (and velocity) are stored; τ_k must be > 0 there (else the step is masked out).
          coefficients: the N steps' coefficients ([b] each, on the device) to use instead of computing them
          here (:func:`trajectory_coefficients`); a backend passes the ones it computed on the CPU.
        Returns: all_latents [b, N+1, *], train_mask [b, N] int32, rollout_log_probs, sde_cx, sde_cv,
          sde_std [b, N], and old_velocities [b, N, *] when ``store_velocities``.
        """
        cfg = self.cfg
        b, n = x_init.shape[0], sigmas.shape[1] - 1
        stochastic, trained = set(stochastic), set(trained)
        latents = torch.empty((b, n + 1, *x_init.shape[1:]), dtype=x_init.dtype, device=x_init.device)
        zeros = dict(dtype=sigmas.dtype, device=sigmas.device)
        log_probs, cx, cv, std = (torch.zeros((b, n), **zeros) for _ in range(4))
        mask = torch.zeros((b, n), dtype=torch.int32, device=sigmas.device)
        velocities = torch.zeros_like(latents[:, :n]) if store_velocities else None
        x = x_init
        latents[:, 0] = x
        if coefficients is None:
            coefficients = trajectory_coefficients(cfg, sigmas, stochastic)
        for k in range(n):
            v = self.adapter.velocity(x, sigmas[:, k], cond, guidance_scale=cfg.guidance_scale,
                                      negative_cond=negative_cond)
            coef = coefficients[k]
            if k in stochastic:
                out = sde_step(x, v, coef, noise=step_noise[k], convention=cfg.log_prob_convention)
                x = out.next_x
                if k in trained and out.log_prob is not None:
                    on = coef.std > 0
                    mask[:, k] = on.to(torch.int32)
                    log_probs[:, k] = torch.where(on, out.log_prob, torch.zeros_like(out.log_prob))
                    if velocities is not None:
                        velocities[:, k] = v
            else:
                x = step_mean(x, v, coef)
            cx[:, k], cv[:, k], std[:, k] = coef.c_x, coef.c_v, coef.std
            latents[:, k + 1] = x
        out = {"all_latents": latents, "train_mask": mask, "rollout_log_probs": log_probs,
               "sde_cx": cx, "sde_cv": cv, "sde_std": std}
        if velocities is not None:
            out["old_velocities"] = velocities
        return out

    # ------------------------------------------------------------------ public API

    @torch.no_grad()
    def generate(self, prompts: list[str], group_ids: torch.Tensor, *, seed: int, iteration: int = 0,
                 store_velocities: Optional[bool] = None,
                 initial_noise: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """A training rollout batch (docs/data_flow.md keys).

        Args: prompts: B strings (a group repeats its prompt).  group_ids: LongTensor [B], the group of each
          sample, or any sequence of B hashables (verl's ``uid`` strings).  seed: seeds every draw (same seed → bitwise same batch).  iteration: training
          iteration (progressive window).  store_velocities: overrides ``cfg.store_velocities``.
          initial_noise: x_{t_0} [B, *] to use instead of drawing it (tests, branched rollouts).
        Returns: all_latents [B, N+1, *], sigmas [B, N+1], train_mask [B, N] int32, rollout_log_probs /
          sde_cx / sde_cv / sde_std [B, N], old_velocities [B, N, *] (if stored), prompt_embeds [B, L, D],
          pooled_prompt_embeds [B, D'], images [B, 3, H, W] uint8; plus negative_prompt_embeds /
          negative_pooled_prompt_embeds when guidance_scale != 1. All on CPU.
        """
        cfg = self.cfg
        store = cfg.store_velocities if store_velocities is None else store_velocities
        prompts = [str(p) for p in prompts]
        group_ids = _as_group_ids(group_ids)
        bsz = len(prompts)
        if group_ids.shape != (bsz,):
            raise ValueError(f"group_ids has shape {tuple(group_ids.shape)} but there are {bsz} prompts; "
                             "pass one group id per sample (LongTensor [B])")
        device = self.device
        _sync(device)
        start = time.perf_counter()

        # --- every random draw, in a fixed order, on a CPU generator
        plan = plan_rollout(cfg, group_ids, self._latent_shape(), seed=seed, iteration=iteration,
                            initial_noise=initial_noise)
        stochastic, trained, initial_noise, step_noise = plan.stochastic, plan.trained, plan.initial_noise, \
            plan.step_noise
        n = cfg.num_steps

        sigmas = self.grid(n).to(device).unsqueeze(0).expand(bsz, -1).contiguous()
        cond = self.encode_prompts(prompts)
        negative = self._negative(bsz)

        # --- micro-batches
        parts, images = [], []
        mb = cfg.micro_batch_size
        for lo in range(0, bsz, mb):
            hi = min(lo + mb, bsz)
            neg = None if negative is None else negative[lo:hi]
            part = self.run_trajectory(
                cond[lo:hi], initial_noise[lo:hi].to(device=device, dtype=torch.float32),
                sigmas=sigmas[lo:hi], stochastic=stochastic, trained=trained,
                step_noise={k: z[lo:hi].to(device) for k, z in step_noise.items()},
                store_velocities=store, negative_cond=neg)
            images.append(self.adapter.decode(part["all_latents"][:, -1]).cpu())
            parts.append({k: t.cpu() for k, t in part.items()})
        out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        out["sigmas"] = sigmas.cpu()
        out.update({k: t.cpu() for k, t in cond.as_dict().items()})
        if negative is not None:
            out.update({f"negative_{k}": t.cpu() for k, t in negative.as_dict().items()})
        out["images"] = torch.cat(images)
        _sync(device)
        elapsed = time.perf_counter() - start
        self.metrics = {
            "perf/rollout_time": elapsed,
            "perf/rollout_time_per_image": elapsed / bsz,
            "rollout/window_start": float(min(trained)) if trained else -1.0,
            "rollout/num_trained_steps": float(len(trained)),
        }
        return out

    @torch.no_grad()
    def generate_ode(self, prompts: list[str], *, seeds: list[int], num_steps: Optional[int] = None,
                     height: Optional[int] = None, width: Optional[int] = None) -> torch.Tensor:
        """Validation images by the Euler ODE (docs/algorithms.md §1.6) on fixed prompts and seeds.

        Sample i starts from randn with ``torch.Generator().manual_seed(seeds[i])``, so an image depends on
        its own (prompt, seed) only, not on the batch. Returns uint8 [B, 3, H, W] on CPU.
        """
        if len(seeds) != len(prompts):
            raise ValueError(f"generate_ode got {len(prompts)} prompts but {len(seeds)} seeds; pass one seed "
                             "per prompt")
        cfg = self.cfg
        n = num_steps or cfg.val_num_steps
        device = self.device
        shape = self._latent_shape(height, width)
        _sync(device)
        start = time.perf_counter()
        x_init = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(int(s))) for s in seeds])
        sigmas = self.grid(n, height, width).to(device).unsqueeze(0).expand(len(prompts), -1)
        cond = self.encode_prompts(prompts)
        negative = self._negative(len(prompts))
        images = []
        for lo in range(0, len(prompts), cfg.micro_batch_size):
            hi = min(lo + cfg.micro_batch_size, len(prompts))
            part = self.run_trajectory(cond[lo:hi], x_init[lo:hi].to(device), sigmas=sigmas[lo:hi],
                                       negative_cond=None if negative is None else negative[lo:hi])
            images.append(self.adapter.decode(part["all_latents"][:, -1]).cpu())
        _sync(device)
        self.metrics["perf/val_time_per_image"] = (time.perf_counter() - start) / max(len(prompts), 1)
        return torch.cat(images)
