"""Bias/variance of the path-space value-gradient estimators (P-S Fig. 1(b,c); docs/algorithms.md §7).

Problem with a known ∇V: endpoint law = Gaussian mixture in d dims (K components, means μ_k, isotropic
std s), linear advantage A(x0) = ⟨a, x0⟩ (sum). For x_t = (1−t)x0 + tε everything is closed form:
responsibilities r_k(x_t), component posteriors N(μ_pk, σ_p² I), E[x0|x_t], the exact v_old = E[v|x_t],
V_t = ⟨a, E[x0|x_t]⟩ and ∇V_t = ((1−t)/t²)·Cov[x0|x_t]·a.

Sampler: Flow-SDE with η = 1 (a = √2, exact time reversal), 40-step shifted grid (S = 3), so rollout
states at t_k are exactly forward-marginal draws. At each step k = 1..39 we draw Q query states x_t and,
per query, R independent replicates of each estimator (the library functions of
verl_diffusion.algos.path_space, scaled by s(t) so that they estimate ∇V):
  stochastic: one Flow-SDE step x' = μ_old + τz, anchor x0 ~ q(x0 | x', t_{k+1}), A(x0)·z/τ;
  deterministic: anchor x0 ~ q(x0 | x_t), −((1−t)/t)·A(x0)·(v − v_old);
  KDE: anchor from the posterior + G−1 = 23 group members from the endpoint law, bandwidth h (sum).
Variance = mean over queries of the per-element-mean trace of the replicate covariance; bias² = mean of
‖mean_R − ∇V‖²_e minus the finite-R correction var/R; MSE = variance + bias².

Run:  python benchmarks/estimator_variance.py            (≈30 s on one core; --dims 16 256)

Model scale (``--model DIR``): the same three estimators on a real flow model, the pretrained shapes
model by default use, with the ``shapes`` reward. ∇V has no closed form there, so (as the paper did with a
128-trajectory reference) the reference is the mean of the deterministic replicates. Per prompt: M rollouts
of the model's Flow-SDE from noise give the endpoint pool, its rewards fix the advantage A(x0) = (r − mean)/std
(the group normalisation of training) and the KDE members; Q of their states at each step k are the queries;
per query, R replicates of
  stochastic: one SDE step x' = μ_old + τz, completed to x0 by the model's SDE, (1/τ)·A(x0)·z;
  deterministic: x0 from the model's SDE completed from x_t (a posterior draw), ((1−t)/t)·ĝ_det;
  KDE: that x0 as the anchor + G−1 members drawn from the pool (other trajectories), ((1−t)/t)·ĝ_kde.
Variance as above; bias² of the others = ‖mean − deterministic mean‖² (per element) minus both finite-R terms.
The SDE runs at η = 1 (a = √2) by default: the exact time reversal, so its posterior draws are the
forward-noising posterior the deterministic and KDE estimators assume. The pool is fixed per prompt, so the
KDE mean also carries the pool's own sampling error (smaller with a larger --pool).
tests/benchmarks/test_estimator_variance_on_cpu.py checks this code on a Gaussian endpoint law with an
exact velocity, where ∇V is known.

Run:  python benchmarks/estimator_variance.py --model verl_diffusion/assets/shapes_sd3 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from verl_diffusion.algos import path_space as ps
from verl_diffusion.algos import sde

PAPER = {"sto_over_det": 13.8, "kde_h1_reduction": 67.5, "bias_pct_max": 2.0}


class GMM:
    def __init__(self, d, K, sep, s, gen):
        self.d, self.K, self.s = d, K, s
        self.mu = sep * torch.randn(K, d, generator=gen, dtype=torch.float64)
        self.a = torch.randn(d, generator=gen, dtype=torch.float64) / math.sqrt(d)

    def sample(self, n, gen):
        k = torch.randint(self.K, (n,), generator=gen)
        return self.mu[k] + self.s * torch.randn(n, self.d, generator=gen, dtype=torch.float64)

    def posterior(self, x, t):
        """x [n, d], t float -> responsibilities [n, K], component means [n, K, d], σ_p²."""
        var_x = (1 - t) ** 2 * self.s**2 + t**2
        d2 = ((x[:, None, :] - (1 - t) * self.mu[None]) ** 2).sum(-1)
        r = torch.softmax(-d2 / (2 * var_x), dim=1)
        sp2 = 1.0 / (1.0 / self.s**2 + (1 - t) ** 2 / t**2)
        mp = sp2 * (self.mu[None] / self.s**2 + (1 - t) * x[:, None, :] / t**2)
        return r, mp, sp2

    def sample_posterior(self, x, t, gen):
        if t <= 0:
            return x.clone()                                        # x_{t=0} is the endpoint
        r, mp, sp2 = self.posterior(x, t)
        k = torch.multinomial(r, 1, generator=gen).squeeze(1)
        return mp[torch.arange(x.shape[0]), k] + math.sqrt(sp2) * torch.randn(x.shape, generator=gen, dtype=x.dtype)

    def mean_and_grad_v(self, x, t):
        r, mp, sp2 = self.posterior(x, t)
        m = (r[..., None] * mp).sum(1)
        pa = mp @ self.a                                            # [n, K]
        cov_a = sp2 * self.a + (r * pa)[..., None].mul(mp).sum(1) - m * (m @ self.a)[:, None]
        return m, (1 - t) / t**2 * cov_a

    def adv(self, x0):
        return x0 @ self.a


def stats(est, truth):
    """est [Q, R, d], truth [Q, d] -> (variance, bias²) per-element-mean, averaged over queries."""
    R = est.shape[1]
    mean = est.mean(1)
    var = est.var(1).mean(-1)                                       # [Q]
    b2 = ((mean - truth) ** 2).mean(-1) - var / R
    return float(var.mean()), float(b2.mean())


def run(args):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(args.seed)
    gmm = GMM(args.dim, args.components, args.sep, args.comp_std, gen)
    grid = sde.make_grid(args.steps, args.shift, dtype=torch.float64)
    a_noise = math.sqrt(2.0)                                        # η = a²/2 = 1
    Q, R, G, d = args.queries, args.reps, args.group, args.dim
    h_train = d / 2000.0
    hs = sorted({1.0, h_train, *args.bandwidths})
    names = ["stochastic", "deterministic"] + [f"kde_h={h:g}" for h in hs]
    acc = {name: [0.0, 0.0] for name in names}
    per_step = {name: [] for name in names}                         # (t, variance, bias²) per step
    for k in range(1, args.steps):
        t, t_next = float(grid[k]), float(grid[k + 1])
        x = (1 - t) * gmm.sample(Q, gen) + t * torch.randn(Q, d, generator=gen, dtype=torch.float64)
        m, grad_v = gmm.mean_and_grad_v(x, t)
        v_old = (x - m) / t
        xr = x[:, None].expand(Q, R, d).reshape(Q * R, d)
        vr = v_old[:, None].expand(Q, R, d).reshape(Q * R, d)
        tt = torch.full((Q * R,), t, dtype=torch.float64)
        # stochastic (Brownian) one-sample estimator
        coef = sde.sampler_coefficients("flow_sde", grid, k, noise_level=a_noise)
        z = torch.randn(Q * R, d, generator=gen, dtype=torch.float64)
        x_next = sde.step_mean(xr, vr, coef) + coef.std * z
        x0_next = gmm.sample_posterior(x_next, t_next, gen)
        est = ps.estimator_scale("stochastic", tt, std=coef.std.expand(Q * R))[:, None] \
            * ps.stochastic_direction(gmm.adv(x0_next), z)
        _acc(acc["stochastic"], stats(est.view(Q, R, d), grad_v))
        # deterministic one-sample estimator
        x0 = gmm.sample_posterior(xr, t, gen)
        s_t = ps.estimator_scale("deterministic", tt)[:, None]
        est = s_t * ps.deterministic_direction(xr, tt, x0, vr, gmm.adv(x0))
        _acc(acc["deterministic"], stats(est.view(Q, R, d), grad_v))
        # KDE: anchor (slot 0) from the posterior, G−1 members from the endpoint law
        members = torch.cat([x0[:, None], gmm.sample(Q * R * (G - 1), gen).view(Q * R, G - 1, d)], 1).reshape(-1, d)
        xg = xr[:, None].expand(Q * R, G, d).reshape(-1, d)
        vg = vr[:, None].expand(Q * R, G, d).reshape(-1, d)
        tg = torch.full((Q * R * G,), t, dtype=torch.float64)
        gid = torch.arange(Q * R).repeat_interleave(G)
        A = gmm.adv(members)
        for h in hs:
            g = ps.kde_value_gradient(xg.float(), tg.float(), members.float(), vg.float(), A.float(), gid,
                                      bandwidth=h).double().view(Q * R, G, d)[:, 0]
            _acc(acc[f"kde_h={h:g}"], stats((s_t * g).view(Q, R, d), grad_v))
    ts = [float(grid[k]) for k in range(1, args.steps)]
    return acc, h_train, ts


def _acc(slot, vb):
    slot[0] += vb[0]
    slot[1] += vb[1]
    slot.append(vb)


# ---------------------------------------------------------------------------------------------------
# model scale (--model)
# ---------------------------------------------------------------------------------------------------
def _batched(fn, x, batch):
    return torch.cat([fn(x[i:i + batch], i) for i in range(0, x.shape[0], batch)]) if x.shape[0] else x


class ModelWorld:
    """The model's Flow-SDE for one prompt and the shapes reward of its metadata (no grad, fp32)."""

    def __init__(self, adapter, prompt, meta, *, size, num_steps, noise_level, batch, gen):
        self.adapter, self.meta, self.size, self.batch, self.gen = adapter, meta, size, batch, gen
        self.cond = adapter.encode_prompt([prompt])
        self.grid = adapter.sampling_grid(num_steps, size, size).double()
        self.n = num_steps
        self.a = noise_level
        self.shape = adapter.latent_shape(size, size)

    def velocity(self, x, k):
        t = float(self.grid[k])

        def fn(xb, _):
            cond = self.cond.repeat(xb.shape[0])
            return self.adapter.velocity(xb.float(), torch.full((xb.shape[0],), t), cond).double()
        with torch.no_grad():
            return _batched(fn, x, self.batch)

    def coef(self, k):
        return sde.sampler_coefficients("flow_sde", self.grid, k, noise_level=self.a)

    def noise(self, x):
        return torch.randn(x.shape, generator=self.gen, dtype=torch.float64)

    def run(self, x, k0, keep=()):
        """SDE from step k0 to t = 0; returns (x0, {k: x_k for k in keep})."""
        states = {}
        for k in range(k0, self.n):
            if k in keep:
                states[k] = x.clone()
            c = self.coef(k)
            x = sde.step_mean(x, self.velocity(x, k), c).double() + float(c.std) * self.noise(x)
        return x, states

    def rewards(self, x0):
        from verl_diffusion.shapes.detect import score

        imgs = _batched(lambda xb, _: self.adapter.decode(xb.float()), x0, self.batch)
        arr = imgs.permute(0, 2, 3, 1).numpy()
        return torch.tensor([score(im, self.meta).reward for im in arr], dtype=torch.float64)


def cell_estimates(w, xq, k, x0_pool, A_pool, adv, *, R, G, hs):
    """R replicates of each estimator of ∇V at each query state xq [Q, *] of step k: {name: [Q, R, d]}.

    w: the world (velocity, coef, noise, run); x0_pool [M, *] and A_pool [M] the endpoint pool (query i is
    pool trajectory i, so its own endpoint is never a KDE member); adv(x0) the advantage of fresh endpoints.
    """
    Q, M, gen = xq.shape[0], x0_pool.shape[0], w.gen
    d = xq[0].numel()
    t = float(w.grid[k])
    v_old = w.velocity(xq, k)
    xr = xq.repeat_interleave(R, 0)
    vr = v_old.repeat_interleave(R, 0)
    tt = torch.full((Q * R,), t, dtype=torch.float64)
    c = w.coef(k)
    z = w.noise(xr)
    x_next = sde.step_mean(xr, vr, c).double() + float(c.std) * z
    x0s, _ = w.run(x_next, k + 1)
    est = {"stochastic": (1.0 / float(c.std)) * ps.stochastic_direction(adv(x0s), z).reshape(Q * R, -1)}
    x0d, _ = w.run(xr, k)
    ad = adv(x0d)
    s_t = ((1 - tt) / tt)[:, None]
    est["deterministic"] = s_t * ps.deterministic_direction(xr, tt, x0d, vr, ad).reshape(Q * R, -1)
    # KDE: anchor = the posterior draw, G−1 members from the pool, never the query's own trajectory
    idx = torch.stack([torch.randperm(M - 1, generator=gen)[: G - 1] for _ in range(Q * R)])
    own = torch.arange(Q).repeat_interleave(R)[:, None]
    idx = idx + (idx >= own).long()
    members = torch.cat([x0d.reshape(Q * R, 1, d), x0_pool.reshape(M, d)[idx]], 1).reshape(Q * R * G, d)
    A = torch.cat([ad[:, None], A_pool[idx]], 1).reshape(-1)
    xg = xr.reshape(Q * R, 1, d).expand(Q * R, G, d).reshape(-1, d)
    vg = vr.reshape(Q * R, 1, d).expand(Q * R, G, d).reshape(-1, d)
    gid = torch.arange(Q * R).repeat_interleave(G)
    for h in hs:
        g = ps.kde_value_gradient(xg, torch.full((Q * R * G,), t, dtype=torch.float64), members, vg, A, gid,
                                  bandwidth=h).view(Q * R, G, d)[:, 0]
        est[f"kde_h={h:g}"] = s_t * g
    return {n: e.reshape(Q, R, d) for n, e in est.items()}


def model_scale(args):
    """Estimator variance / bias on a flow model; returns rows of per-(prompt, step) stats."""
    import numpy as np

    from verl_diffusion.models import architecture_of, get_adapter_cls
    from verl_diffusion.main_flowgrpo import resolve_path
    from verl_diffusion.shapes.world import sample_prompt

    torch.set_num_threads(args.threads)
    path = resolve_path(args.model)
    adapter = get_adapter_cls(architecture_of(path)).from_pretrained(path)
    gen = torch.Generator().manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    steps = [k for k in args.model_steps if 1 <= k < args.num_steps - 1]
    Q, R, G, M = args.queries, args.reps, args.group, args.pool
    out, skipped = [], 0
    for _ in range(args.prompts):
        prompt, meta = sample_prompt(rng, args.split)
        w = ModelWorld(adapter, prompt, meta, size=args.size, num_steps=args.num_steps,
                       noise_level=args.noise_level, batch=args.batch, gen=gen)
        x0_pool, states = w.run(torch.randn((M, *w.shape), generator=gen, dtype=torch.float64), 0, keep=set(steps))
        r = w.rewards(x0_pool)
        if float(r.std()) < 1e-6:
            skipped += 1  # every endpoint scored the same: zero advantages, no gradient to estimate
            continue
        mu, sd = r.mean(), r.std()
        adv = lambda x0: (w.rewards(x0) - mu) / (sd + 1e-4)  # noqa: E731  (the pool's normalisation, fixed)
        d = x0_pool[0].numel()
        hs = sorted({1.0, d / 2000.0})
        for k in steps:
            t = float(w.grid[k])
            est = cell_estimates(w, states[k][:Q], k, x0_pool, (r - mu) / (sd + 1e-4), adv, R=R, G=G, hs=hs)
            ref = est["deterministic"].mean(1)
            var_ref = est["deterministic"].var(1).mean(-1)
            row = {"prompt": prompt, "tag": meta["tag"], "k": k, "t": t, "d": d, "h_train": d / 2000.0,
                   "reward_mean": float(mu), "reward_std": float(sd)}
            for n, e in est.items():
                var = e.var(1).mean(-1)                                             # [Q]
                mean = e.mean(1)
                if n == "deterministic":
                    b2 = torch.zeros(Q, dtype=torch.float64)
                else:
                    b2 = ((mean - ref) ** 2).mean(-1) - var / R - var_ref / R
                cos = torch.nn.functional.cosine_similarity(mean, ref, dim=-1)
                row[n] = {"var": float(var.mean()), "bias2": float(b2.mean()), "cos_to_det": float(cos.mean())}
            out.append(row)
            print(f"  {prompt!r} k={k} t={t:.3f}: " + ", ".join(f"{n} var {row[n]['var']:.3g}" for n in est), flush=True)
    return out, skipped


def report_model(args):
    import math as _m

    t0 = time.time()
    rows, skipped = model_scale(args)
    lines = [f"## Estimator bias/variance at model scale: {args.model}",
             "",
             f"Command: `python benchmarks/estimator_variance.py --model {args.model} --prompts {args.prompts} "
             f"--queries {args.queries} --reps {args.reps} --group {args.group} --pool {args.pool} "
             f"--num-steps {args.num_steps} --model-steps {' '.join(map(str, args.model_steps))} "
             f"--noise-level {args.noise_level} --size {args.size} --seed {args.seed}`",
             "",
             f"{len(rows)} (prompt, step) cells from {args.prompts} {args.split} prompts ({skipped} prompts skipped: "
             f"all {args.pool} endpoints scored alike); Flow-SDE a = {args.noise_level:.4g}; reference = mean of the "
             f"deterministic replicates; d = {rows[0]['d'] if rows else '?'} latent elements; KDE members drawn "
             f"from a fixed pool of {args.pool} endpoints per prompt (its sampling error shows as KDE bias).",
             ""]
    if not rows:
        lines.append("No cell: every prompt's endpoints scored alike (an untrained model?).")
        return "\n".join(lines), rows
    names = [n for n in rows[0] if isinstance(rows[0][n], dict)]
    lines += ["| estimator | variance (mean over cells) | variance / deterministic (geo. mean over cells) | "
              "bias² vs det. mean, % of MSE | cosine to det. mean |", "|---|---|---|---|---|"]
    for n in names:
        v = sum(r[n]["var"] for r in rows) / len(rows)
        ratio = _m.exp(sum(_m.log(r[n]["var"] / r["deterministic"]["var"]) for r in rows) / len(rows))
        b2 = sum(max(r[n]["bias2"], 0.0) for r in rows) / len(rows)
        cos = sum(r[n]["cos_to_det"] for r in rows) / len(rows)
        label = n + (" (d/2000)" if n == f"kde_h={rows[0]['h_train']:g}" and n != "kde_h=1" else "")
        lines.append(f"| {label} | {v:.4g} | {ratio:.3f}× | {'—' if n == 'deterministic' else f'{100 * b2 / (v + b2):.2f}%'} "
                     f"| {cos:.3f} |")
    sto = _m.exp(sum(_m.log(r["stochastic"]["var"] / r["deterministic"]["var"]) for r in rows) / len(rows))
    kde1 = _m.exp(sum(_m.log(r["kde_h=1"]["var"] / r["deterministic"]["var"]) for r in rows) / len(rows))
    lines += ["", "| quantity | paper (SD3.5, PickScore) | ours (per cell, geometric mean) |", "|---|---|---|",
              f"| Var(stochastic) / Var(deterministic) | {PAPER['sto_over_det']}× | {sto:.1f}× |",
              f"| KDE (h = 1) variance reduction vs deterministic | {PAPER['kde_h1_reduction']}% | {100 * (1 - kde1):.1f}% |",
              ""]
    # per step: the ratio moves with t (the deterministic/KDE scale (1−t)/t grows as t → 0)
    ks = sorted({r["k"] for r in rows})
    lines += ["Variance / deterministic per step (geometric mean over prompts):", "",
              "| estimator | " + " | ".join(f"k = {k} (t = {next(r['t'] for r in rows if r['k'] == k):.2f})" for k in ks) + " |",
              "|---|" + "---|" * len(ks)]
    for n in names:
        cells = []
        for k in ks:
            rk = [r for r in rows if r["k"] == k]
            cells.append(f"{_m.exp(sum(_m.log(r[n]['var'] / r['deterministic']['var']) for r in rk) / len(rk)):.3f}×")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    lines += ["", f"wall time {time.time() - t0:.0f} s"]
    return "\n".join(lines), rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[16, 256], help="latent sizes d (one table each)")
    p.add_argument("--components", type=int, default=8)
    p.add_argument("--sep", type=float, default=0.5, help="per-element std of the component means")
    p.add_argument("--comp-std", type=float, default=0.5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--shift", type=float, default=3.0)
    p.add_argument("--group", type=int, default=24)
    p.add_argument("--queries", type=int, default=8, help="query states per step")
    p.add_argument("--reps", type=int, default=128, help="estimator replicates per query")
    p.add_argument("--bandwidths", type=float, nargs="*", default=[0.25, 4.0, 32.768, 65.536])
    p.add_argument("--seed", type=int, default=0)
    m = p.add_argument_group("model scale (--model)")
    m.add_argument("--model", help="diffusers model directory (pkg:// allowed): run the model-scale diagnostic")
    m.add_argument("--prompts", type=int, default=6, help="shapes prompts (default: %(default)s)")
    m.add_argument("--split", default="train", choices=["train", "heldout"])
    m.add_argument("--pool", type=int, default=96, help="endpoint rollouts per prompt (default: %(default)s)")
    m.add_argument("--num-steps", type=int, default=10, help="SDE steps (default: %(default)s)")
    m.add_argument("--model-steps", type=int, nargs="+", default=[2, 5, 8], help="steps k of the query states")
    m.add_argument("--noise-level", type=float, default=math.sqrt(2.0),
                   help="Flow-SDE a (default √2: η = 1, the exact time reversal, so SDE posterior draws are the "
                        "forward-noising posterior the deterministic and KDE estimators assume)")
    m.add_argument("--size", type=int, default=32, help="image side (default: %(default)s)")
    m.add_argument("--batch", type=int, default=256, help="samples per model forward (default: %(default)s)")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--out", help="also write the model-scale table to this markdown file")
    args = p.parse_args()
    if args.model:
        if args.group > args.pool:
            p.error(f"--group {args.group} must be <= --pool {args.pool}")
        args.queries = min(args.queries, args.pool)
        text, rows = report_model(args)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
            with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
                json.dump(rows, f, indent=1)
        return
    t_start = time.time()
    for d in args.dims:
        args.dim = d
        report(args)
        print()
    print(f"total wall time {time.time() - t_start:.1f} s")


def report(args):
    t0 = time.time()
    acc, h_train, ts = run(args)
    var_det = acc["deterministic"][0]
    print(f"## Estimator bias/variance: GMM d={args.dim}, K={args.components}, η=1, {args.steps} steps (k=1..{args.steps - 1}), "
          f"G={args.group}, {args.queries} queries/step × {args.reps} replicates; training bandwidth d/2000 = {h_train:g}")
    print()
    print("| estimator | variance (Σ over states) | bias² | bias² % of MSE | variance / deterministic | paper |")
    print("|---|---|---|---|---|---|")
    for name, (v, b2, *_) in acc.items():
        b2c = max(b2, 0.0)
        paper = {"stochastic": f"{PAPER['sto_over_det']}× det", "kde_h=1": "−67.5% vs det (0.325×)"}.get(name, "")
        if name == f"kde_h={h_train:g}" and name != "kde_h=1":
            name += " (d/2000)"
        print(f"| {name} | {v:.4g} | {b2c:.3g} | {100 * b2c / (v + b2c):.2f}% | {v / var_det:.3f}× | {paper} |")
    sto = acc["stochastic"][0] / var_det
    red = 100 * (1 - acc["kde_h=1"][0] / var_det)
    bias_max = max(100 * max(b, 0) / (v + max(b, 0)) for v, b, *_ in acc.values())
    print()
    det = [vb[0] for vb in acc["deterministic"][2:]]
    gm = {n: math.exp(sum(math.log(vb[0] / dv) for vb, dv in zip(slot[2:], det)) / len(det)) for n, slot in acc.items()}
    bias_h1 = 100 * max(acc["kde_h=1"][1], 0) / (acc["kde_h=1"][0] + max(acc["kde_h=1"][1], 0))
    print(f"| quantity | paper (SD3.5, PickScore) | ours, summed over states (d={args.dim}) | ours, per-state geometric mean |")
    print("|---|---|---|---|")
    print(f"| Var(stochastic) / Var(deterministic) | {PAPER['sto_over_det']}× | {sto:.1f}× | {gm['stochastic']:.1f}× |")
    print(f"| KDE (h = 1) variance reduction vs deterministic | {PAPER['kde_h1_reduction']}% | {red:.1f}% | "
          f"{100 * (1 - gm['kde_h=1']):.1f}% |")
    print(f"| bias² % of MSE, h = 1 / worst estimator | < {PAPER['bias_pct_max']}% | {bias_h1:.2f}% / {bias_max:.2f}% | — |")
    # per-state view: each state weighted equally (ratio of variances at the same state), by time bin
    print()
    print("Per-state variance ratio vs deterministic (geometric mean over states in each bin):")
    print()
    bins = [(0.7, 1.01, "t > 0.7"), (0.3, 0.7, "0.3 < t ≤ 0.7"), (0.0, 0.3, "t ≤ 0.3"), (0.0, 1.01, "all")]
    print("| estimator | " + " | ".join(b[2] for b in bins) + " |")
    print("|---|" + "---|" * len(bins))
    det = [vb[0] for vb in acc["deterministic"][2:]]
    for name, slot in acc.items():
        row = []
        for lo, hi, _ in bins:
            r = [vb[0] / dv for vb, dv, t in zip(slot[2:], det, ts) if lo < t <= hi]
            row.append(f"{math.exp(sum(math.log(x) for x in r) / len(r)):.3f}×" if r else "—")
        print(f"| {name} | " + " | ".join(row) + " |")
    print(f"\nwall time {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
