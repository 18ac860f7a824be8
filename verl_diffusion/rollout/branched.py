"""TempFlow-GRPO branched rollout (docs/algorithms.md §3.3): ODE trunk, K_b stochastic children per branch step.

For each prompt p an ODE trunk x_{t_0} → … → x_{t_N} is sampled (docs/algorithms.md §1.6). At each branch step k
(default: every k < N − 1) K_b children leave the trunk state x_{t_k} with one stochastic step of the
rollout's sampler (Flow-SDE per docs/algorithms.md §3.3; any sampler of ``algos.sde`` with τ_k > 0 works) through
:func:`verl_diffusion.algos.sde.sde_step`, whose log-prob is recorded, and each child is then ODE-completed
to its own image. A child is one row of the output: its trajectory is the trunk up to x_{t_k}, the stochastic
x_{t_{k+1}}, then the ODE; only step k is stochastic and trained (``train_mask`` 1 at k only), so each row
has exactly the keys and layout of :meth:`DiffusersRollout.generate` (docs/data_flow.md) plus
``group_ids`` (one per (prompt, k)), ``prompt_ids`` and ``branch_step``.
The process advantages of docs/algorithms.md §3.3 are then :func:`verl_diffusion.algos.advantages.branched_step_advantages`
of the children's rewards (normalised within (prompt, k) across the K_b children, placed at column k).

Row order: prompt-major, then branch step (in increasing k), then child:
row = (p·S + j)·K_b + c for the j-th branch step, S = len(branch_steps); ``group_ids`` = row // K_b.

Cost per prompt (forwards of the transformer): N for the trunk, then K_b ODE completions per branch step,
the one from step k needing N − k − 1 forwards (the child's stochastic step reuses the trunk's velocity at
x_{t_k}): N + K_b·Σ_k (N − k − 1) = N + K_b·N(N − 1)/2 with all N − 1 branch steps, i.e. about N·K_b/2 full
trajectories instead of G; plus K_b·S VAE decodes. B = P·S·K_b rows.

RNG: one CPU ``torch.Generator`` seeded by ``seed`` draws the trunk noise [P, *] first, then for each
branch step in increasing k the children's z [P, K_b, *]. Everything is drawn before the first forward, so
the result does not depend on the micro-batch size. The rollout's SDE window and ``same_noise_per_group`` do
not apply here. The trainer calls this when ``actor_rollout_ref.rollout.branched.enabled`` (docs/training.md,
"TempFlow branched rollout").
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from verl_diffusion.algos.advantages import branched_step_advantages
from verl_diffusion.algos.sde import sampler_coefficients, sde_step, step_mean
from verl_diffusion.algos.windows import resolve_branch_steps
from verl_diffusion.models.base import Conditioning
from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout, _sync

__all__ = ["BRANCHED_KEYS", "generate_branched", "branched_step_advantages", "resolve_branch_steps"]

# Keys added to ROLLOUT_KEYS by generate_branched (all [B] long).
BRANCHED_KEYS = ("group_ids", "prompt_ids", "branch_step")


def _ode_segment(rollout: DiffusersRollout, cond: Conditioning, x: torch.Tensor, sigmas: torch.Tensor,
                 start: int, latents: torch.Tensor, *, negative_cond: Optional[Conditioning] = None,
                 velocities: Optional[torch.Tensor] = None) -> None:
    """Euler ODE from step ``start`` to N, exactly as :meth:`DiffusersRollout.run_trajectory`'s ODE branch.

    Writes x_{t_{k+1}} into ``latents[:, k + 1]`` (and v at x_{t_k} into ``velocities[:, k]`` when given).
    """
    n = sigmas.shape[1] - 1
    for k in range(start, n):
        v = rollout.adapter.velocity(x, sigmas[:, k], cond, guidance_scale=rollout.cfg.guidance_scale,
                                     negative_cond=negative_cond)
        if velocities is not None:
            velocities[:, k] = v
        x = step_mean(x, v, sampler_coefficients("ode", sigmas, k, noise_level=0.0))
        latents[:, k + 1] = x


@torch.no_grad()
def generate_branched(rollout: DiffusersRollout, prompts: Sequence[str], *, seed: int,
                      branch_steps: Optional[Sequence[int]] = None, num_children: int,
                      store_velocities: Optional[bool] = None) -> dict[str, torch.Tensor]:
    """A branched TempFlow-GRPO rollout batch (docs/algorithms.md §3.3; module docstring for layout, RNG and cost).

    Args: rollout: a :class:`DiffusersRollout`; its ``cfg`` gives N, shift, sampler (not ``ode``), noise
        level, log-prob convention, CFG scale, image size and micro-batch size.
      prompts: P strings, one trunk each (a repeated prompt gets its own trunk and its own groups).
      seed: seeds every draw (same seed → bitwise same batch).
      branch_steps: the steps k to branch at (distinct, each < N − 1); None = all of 0..N−2.
      num_children: K_b ≥ 1 children per (prompt, k).
      store_velocities: overrides ``cfg.store_velocities`` (v_old at x_{t_k} in ``old_velocities``).
    Returns (all on CPU, B = P·S·K_b rows): all_latents [B, N+1, *], sigmas [B, N+1], train_mask [B, N] int32
      (1 at the row's branch step only), rollout_log_probs / sde_cx / sde_cv / sde_std [B, N] (sampler
      coefficients at k, ODE elsewhere), old_velocities [B, N, *] (if stored; zeros off k), prompt_embeds,
      pooled_prompt_embeds, images [B, 3, H, W] uint8, negative_* embeddings with CFG, and group_ids /
      prompt_ids / branch_step [B] long.
    """
    cfg = rollout.cfg
    if cfg.sampler == "ode" or float(cfg.noise_level) == 0.0:
        raise ValueError(f"generate_branched needs a stochastic sampler with noise_level > 0 for the children "
                         f"(got sampler={cfg.sampler!r}, noise_level={cfg.noise_level!r}); docs/algorithms.md §3.3 uses flow_sde")
    if isinstance(num_children, bool) or not isinstance(num_children, int) or num_children < 1:
        raise ValueError(f"num_children={num_children!r} is invalid; pass an int K_b >= 1 (>= 2 for non-zero "
                         f"process advantages)")
    store = cfg.store_velocities if store_velocities is None else store_velocities
    prompts = [str(p) for p in prompts]
    n_prompts, n, kb = len(prompts), cfg.num_steps, num_children
    if n_prompts == 0:
        raise ValueError("generate_branched got no prompts")
    steps = resolve_branch_steps(branch_steps, n)
    n_branch = len(steps)
    device = rollout.device
    _sync(device)
    start = time.perf_counter()

    # --- every random draw, in a fixed order, on a CPU generator
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    shape = rollout._latent_shape()
    trunk_noise = torch.randn((n_prompts, *shape), generator=gen)
    child_noise = {k: torch.randn((n_prompts, kb, *shape), generator=gen) for k in steps}

    grid = rollout.grid(n).to(device)
    cond_p = rollout.encode_prompts(prompts)
    neg_p = rollout._negative(n_prompts)
    mb = cfg.micro_batch_size

    # --- ODE trunks (velocities kept: the children's stochastic step reuses v at x_{t_k})
    trunk = torch.empty((n_prompts, n + 1, *shape), dtype=torch.float32, device=device)
    trunk_v = torch.empty((n_prompts, n, *shape), dtype=torch.float32, device=device)
    for lo in range(0, n_prompts, mb):
        hi = min(lo + mb, n_prompts)
        x0 = trunk_noise[lo:hi].to(device=device, dtype=torch.float32)
        trunk[lo:hi, 0] = x0
        sig = grid.unsqueeze(0).expand(hi - lo, -1).contiguous()
        _ode_segment(rollout, cond_p[lo:hi], x0, sig, 0, trunk[lo:hi],
                     negative_cond=None if neg_p is None else neg_p[lo:hi], velocities=trunk_v[lo:hi])

    # --- children: one block of P·K_b rows per branch step, rows (p, c) p-major
    bsz = n_prompts * n_branch * kb
    latents = torch.empty((bsz, n + 1, *shape), dtype=torch.float32)
    velocities = torch.zeros((bsz, n, *shape), dtype=torch.float32) if store else None
    log_probs, cx, cv, std = (torch.zeros((bsz, n), dtype=torch.float32) for _ in range(4))
    mask = torch.zeros((bsz, n), dtype=torch.int32)
    images = torch.empty((bsz, 3, cfg.height, cfg.width), dtype=torch.uint8)
    p_of_block = torch.arange(n_prompts).repeat_interleave(kb)                       # [P·K_b]
    ode_all = sampler_coefficients("ode", grid, torch.arange(n), noise_level=0.0)   # [N] each
    for j, k in enumerate(steps):
        rows = ((p_of_block * n_branch + j) * kb + torch.arange(kb).repeat(n_prompts))  # output rows of block
        nb = rows.numel()
        z = child_noise[k].reshape(nb, *shape)
        for lo in range(0, nb, mb):
            hi = min(lo + mb, nb)
            p_idx = p_of_block[lo:hi]
            b = hi - lo
            sig = grid.unsqueeze(0).expand(b, -1).contiguous()
            lat = torch.empty((b, n + 1, *shape), dtype=torch.float32, device=device)
            lat[:, :k + 1] = trunk[p_idx.to(device), :k + 1]
            x, v = lat[:, k], trunk_v[p_idx.to(device), k]
            coef = sampler_coefficients(cfg.sampler, sig, k, noise_level=cfg.noise_level)
            out = sde_step(x, v, coef, noise=z[lo:hi].to(device), convention=cfg.log_prob_convention)
            lat[:, k + 1] = out.next_x
            cond = cond_p.index_select(p_idx)
            neg = None if neg_p is None else neg_p.index_select(p_idx)
            _ode_segment(rollout, cond, out.next_x, sig, k + 1, lat, negative_cond=neg)
            r = rows[lo:hi]
            latents[r] = lat.cpu()
            images[r] = rollout.adapter.decode(lat[:, -1]).cpu()
            on = (coef.std > 0).cpu()
            mask[r, k] = on.to(torch.int32)
            lp = out.log_prob.cpu() if out.log_prob is not None else torch.zeros(b)
            log_probs[r, k] = torch.where(on, lp, torch.zeros_like(lp))
            cx[r, k], cv[r, k], std[r, k] = coef.c_x.cpu(), coef.c_v.cpu(), coef.std.cpu()
            if velocities is not None:
                velocities[r, k] = v.cpu()
    # ODE coefficients (c_x = 1, c_v = dt, τ = 0) at every other step, as run_trajectory stores them.
    off = torch.ones((bsz, n), dtype=torch.bool)
    prompt_ids = torch.arange(n_prompts).repeat_interleave(n_branch * kb)
    branch_step = torch.tensor(steps, dtype=torch.long).repeat_interleave(kb).repeat(n_prompts)
    off[torch.arange(bsz), branch_step] = False
    cx = torch.where(off, ode_all.c_x.cpu().expand(bsz, -1), cx)
    cv = torch.where(off, ode_all.c_v.cpu().expand(bsz, -1), cv)
    std = torch.where(off, ode_all.std.cpu().expand(bsz, -1), std)

    out = {"all_latents": latents, "sigmas": grid.cpu().unsqueeze(0).expand(bsz, -1).contiguous(),
           "train_mask": mask, "rollout_log_probs": log_probs, "sde_cx": cx, "sde_cv": cv, "sde_std": std,
           "images": images, "group_ids": torch.arange(bsz) // kb, "prompt_ids": prompt_ids,
           "branch_step": branch_step}
    if velocities is not None:
        out["old_velocities"] = velocities
    out.update({key: t.cpu() for key, t in cond_p.index_select(prompt_ids).as_dict().items()})
    if neg_p is not None:
        out.update({f"negative_{key}": t.cpu() for key, t in neg_p.index_select(prompt_ids).as_dict().items()})
    _sync(device)
    elapsed = time.perf_counter() - start
    rollout.metrics = {
        "perf/rollout_time": elapsed,
        "perf/rollout_time_per_image": elapsed / bsz,
        "rollout/num_branch_steps": float(n_branch),
        "rollout/num_children": float(kb),
    }
    return out
