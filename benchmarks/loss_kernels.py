"""Forward+backward cost of every registered per-timestep loss kernel, and of the path-space ĝ precompute.

Paper scale: one group G = 24 items, latent 16×64×64 (d = 65,536), fp32, Flow-SDE a = 0.7 at step 3 of a
10-step grid. No network: the trainable velocity is a leaf tensor, derived quantities (μ_θ, ℓ_θ) are
computed from it inside the timed region exactly as workers/step_loss.py does, every loss runs with its
default config (``path_space`` once per preset). The direction ĝ is precomputed outside the loss timing
(θ-independent, once per rollout step) and timed separately: KDE vs deterministic vs stochastic.

Run:  python benchmarks/loss_kernels.py            (one thread; ≈1 min)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verl_diffusion.algos import path_space as ps
from verl_diffusion.algos import sde
from verl_diffusion.algos.losses import LOSSES, load_builtin_losses
from verl_diffusion.algos.types import StepBatch, StepNeeds, StepQuantities


def timeit(fn, reps, warmup=2):
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def timeit_pair(fa, fb, reps, warmup=2):
    """Median times of two functions measured alternately (shared, noisy CPUs hit both alike)."""
    for _ in range(warmup):
        fa()
        fb()
    ta, tb = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fa()
        t1 = time.perf_counter()
        fb()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return statistics.median(ta), statistics.median(tb), statistics.median([b / a for a, b in zip(ta, tb)])


def make_batch(G, shape, gen):
    grid = sde.make_grid(10, 3.0)
    k = 3
    coef = sde.sampler_coefficients("flow_sde", grid, k, noise_level=0.7)
    c_x, c_v, std = (c.expand(G).clone() for c in (coef.c_x, coef.c_v, coef.std))
    coefs = sde.StepCoefficients(c_x, c_v, std)
    x_t, v_old, x0, noise, z = (torch.randn(G, *shape, generator=gen) for _ in range(5))
    old_mean = sde.step_mean(x_t, v_old, coefs)
    x_next = old_mean + std[:, None, None, None] * z
    batch = StepBatch(advantages=torch.randn(G, generator=gen), x_t=x_t, t=grid[k].expand(G).clone(),
                      x_next=x_next, t_next=grid[k + 1].expand(G).clone(), c_x=c_x, c_v=c_v, std=std,
                      old_log_prob=sde.gaussian_log_prob(x_next, old_mean, std), old_mean=old_mean,
                      old_velocity=v_old, x0=x0, noise=noise, group_ids=torch.zeros(G, dtype=torch.long),
                      step_advantages=torch.randn(G, generator=gen))
    return batch, coefs


def kernel_cases():
    load_builtin_losses()
    for name, spec in LOSSES.items():
        if name == "path_space":
            for preset in ps.PATH_SPACE_PRESETS:
                yield f"path_space[{preset}]", spec, ps.PathSpaceConfig(preset=preset)
        else:
            yield name, spec, spec.config()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--group", type=int, default=24)
    p.add_argument("--shape", type=int, nargs=3, default=[16, 64, 64])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    G, shape = args.group, tuple(args.shape)
    d = shape[0] * shape[1] * shape[2]
    batch, coefs = make_batch(G, shape, gen)
    v_ref = batch.old_velocity + 0.01 * torch.randn(batch.old_velocity.shape, generator=gen)
    v_fresh = batch.old_velocity + 0.01 * torch.randn(batch.old_velocity.shape, generator=gen)
    v_init = batch.old_velocity + 0.01 * torch.randn(batch.old_velocity.shape, generator=gen)

    print(f"## Loss kernels: G = {G}, latent {'×'.join(map(str, shape))} (d = {d:,}), fp32, "
          f"{args.threads} thread(s), median of {args.reps}")
    print()
    # --- direction precompute (θ-independent, once per trained step) -----------------------------
    z = ps.step_noise(batch.x_t, batch.x_next, batch.old_velocity, batch.c_x, batch.c_v, batch.std)
    det = lambda b: ps.deterministic_direction(b.x_t, b.t, b.x0, b.old_velocity, b.advantages)  # noqa: E731
    kde = lambda b: ps.kde_value_gradient(b.x_t, b.t, b.x0, b.old_velocity, b.advantages, b.group_ids)  # noqa: E731
    sto = lambda b: ps.stochastic_direction(b.advantages, ps.step_noise(  # noqa: E731
        b.x_t, b.x_next, b.old_velocity, b.c_x, b.c_v, b.std))
    t_det, t_kde, r_kde = timeit_pair(lambda: det(batch), lambda: kde(batch), args.reps)
    _, t_sto, r_sto = timeit_pair(lambda: det(batch), lambda: sto(batch), args.reps)
    # several groups at once (P = 4 prompts × G, contiguous) and a shuffled layout (padded path)
    big = StepBatch(**{k: (torch.cat([v] * 4) if isinstance(v, torch.Tensor) else v)
                       for k, v in batch.__dict__.items()})
    big.group_ids = torch.arange(4).repeat_interleave(G)
    t_det4, t_kde4, r_kde4 = timeit_pair(lambda: det(big), lambda: kde(big), max(3, args.reps // 2))
    perm = torch.randperm(4 * G, generator=gen)
    shuf = StepBatch(**{k: (v[perm] if isinstance(v, torch.Tensor) else v) for k, v in big.__dict__.items()})
    _, t_kdes, r_kdes = timeit_pair(lambda: det(shuf), lambda: kde(shuf), max(3, args.reps // 2))
    print("| direction ĝ (one trained step) | time (ms) | ratio to deterministic (median of paired runs) |")
    print("|---|---|---|")
    print(f"| deterministic, 1 group × {G} | {1e3 * t_det:.2f} | 1.00× |")
    print(f"| stochastic (z from stored x_next), 1 group | {1e3 * t_sto:.2f} | {r_sto:.2f}× |")
    print(f"| KDE (h = d/2000), 1 group × {G} | {1e3 * t_kde:.2f} | **{r_kde:.2f}×** (target ≤ 3×) |")
    print(f"| deterministic, 4 groups × {G} | {1e3 * t_det4:.2f} | 1.00× |")
    print(f"| KDE, 4 groups × {G}, contiguous | {1e3 * t_kde4:.2f} | **{r_kde4:.2f}×** |")
    print(f"| KDE, 4 groups × {G}, shuffled (padded path) | {1e3 * t_kdes:.2f} | {r_kdes:.2f}× |")
    print()

    # --- loss kernels: forward + backward to the leaf velocity --------------------------------------
    print("| loss (default config) | needs | forward+backward (ms) | per item (ms) | ratio to path_space[ps_kde] |")
    print("|---|---|---|---|---|")
    rows = []
    for label, spec, cfg in kernel_cases():
        needs = spec.needs_for(cfg)
        b = batch
        if spec.prepare is not None:
            b = spec.prepare(batch, cfg)

        def step(spec=spec, cfg=cfg, needs=needs, b=b):
            v = v_init.clone().requires_grad_(True)
            q = StepQuantities(velocity=v)
            if needs & (StepNeeds.MEAN | StepNeeds.LOG_PROB):
                q.mean = sde.step_mean(b.x_t, v, coefs)
            if needs & StepNeeds.LOG_PROB:
                q.log_prob = sde.gaussian_log_prob(b.x_next, q.mean, b.std)
            if needs & StepNeeds.REF_VELOCITY:
                q.ref_velocity = v_ref
            if needs & StepNeeds.OLD_VELOCITY_FRESH:
                q.old_velocity = v_fresh
            out = spec.fn(q, b, cfg)
            out.loss.backward()
            return v.grad

        ms = 1e3 * timeit(step, args.reps)
        names = "|".join(n.name for n in StepNeeds if n.name != "NONE" and n in needs)
        rows.append((label, names, ms))
    base = dict((r[0], r[2]) for r in rows)["path_space[ps_kde]"]
    for label, names, ms in rows:
        print(f"| {label} | {names} | {ms:.2f} | {ms / G:.3f} | {ms / base:.2f}× |")


if __name__ == "__main__":
    main()
