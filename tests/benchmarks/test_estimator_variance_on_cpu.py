"""benchmarks/estimator_variance.py --model: the model-scale estimators recover ∇V where it is known.

A "model" whose velocity is exact for a Gaussian endpoint law N(m, s²I) and a linear advantage
A(x0) = ⟨a, x0⟩: the value gradient is ∇V(x_t) = (1−t)·s²/((1−t)²s² + t²)·a. The diagnostic's own code
(Flow-SDE rollouts at η = 1 for the posterior draws, the three estimators, their scales) must recover it:
deterministic and stochastic unbiased (up to Monte Carlo and Euler error), KDE with h = 1 close."""

import math

import pytest
import torch


@pytest.fixture(scope="module")
def ev(load_benchmark):
    return load_benchmark("estimator_variance")


def test_model_scale_estimators_recover_the_exact_value_gradient(ev):
    from verl_diffusion.algos import sde

    d, s, n_steps, k = 6, 0.6, 40, 20
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(d, generator=gen, dtype=torch.float64) * 0.5
    a = torch.randn(d, generator=gen, dtype=torch.float64)

    class GaussianWorld(ev.ModelWorld):
        def __init__(self):  # no adapter: exact velocity of the Gaussian endpoint law
            self.gen, self.batch, self.n, self.a = gen, 10**9, n_steps, math.sqrt(2.0)
            self.grid = sde.make_grid(n_steps, 3.0, dtype=torch.float64)

        def velocity(self, x, k):
            t = float(self.grid[k])
            var_x = (1 - t) ** 2 * s * s + t * t
            post_mean = m + (1 - t) * s * s / var_x * (x - (1 - t) * m)
            return (x - post_mean) / t

    w = GaussianWorld()
    t = float(w.grid[k])
    Q, R = 3, 3000
    xq = (1 - t) * (m + s * torch.randn(Q, d, generator=gen, dtype=torch.float64)) \
        + t * torch.randn(Q, d, generator=gen, dtype=torch.float64)
    adv = lambda x0: x0 @ a  # noqa: E731
    truth = (1 - t) * s * s / ((1 - t) ** 2 * s * s + t * t) * a
    pool = m + s * torch.randn(2048, d, generator=gen, dtype=torch.float64)  # endpoint law, exact
    est = ev.cell_estimates(w, xq, k, pool[:64], adv(pool[:64]), adv, R=R, G=4, hs=[1.0])
    err = {n: (e.mean(1) - truth).norm(dim=-1) / truth.norm() for n, e in est.items()}         # [Q]
    se = {n: (e.var(1).sum(-1) / R).sqrt() / truth.norm() for n, e in est.items()}              # Monte Carlo s.e.
    # unbiased up to Monte Carlo error (+ 0.1 for the Euler discretisation of the posterior draws)
    assert (err["deterministic"] < 4 * se["deterministic"] + 0.1).all(), (err, se)
    assert (err["deterministic"] < 0.25).all()   # a wrong scale or sign would show
    assert (err["stochastic"] < 4 * se["stochastic"]).all(), (err, se)
    var = {n: float(e.var(1).mean()) for n, e in est.items()}
    assert var["stochastic"] > 10 * var["deterministic"] > 0     # the paper's ordering (Fig. 1)
    # KDE (exact weights, h = 1): close to ∇V with a large group; its variance below the deterministic one.
    # (A fixed pool's own sampling error biases the mean of every replicate alike, so the pool is large.)
    kde = ev.cell_estimates(w, xq, k, pool, adv(pool), adv, R=100, G=128, hs=[1.0])["kde_h=1"]
    assert ((kde.mean(1) - truth).norm(dim=-1) / truth.norm() < 0.3).all()
    assert float(kde.var(1).mean()) < var["deterministic"]
