"""SPEC §7 checks 1–8 for verl_diffusion/algos/path_space.py (toy model T, fp64, vectorised Monte Carlo)."""

import math

import pytest
import torch

from verl_diffusion.algos import path_space as ps
from verl_diffusion.algos import sde
from verl_diffusion.algos.losses import get_loss_spec
from verl_diffusion.algos.types import StateSource, StepBatch, StepNeeds, StepQuantities

F64 = torch.float64
M = 100_000          # Monte Carlo repetitions (SPEC §7 "≥ 10⁵")
D = 3                # toy latent size
MEAN0, S0 = 0.4, 0.8  # endpoint law N(m·1, s0²·I)
A_COEF = torch.tensor([0.7, -1.2, 0.5], dtype=F64)
B_COEF = 0.3


# ---------------------------------------------------------------- toy model T (SPEC §7 "Checks")
def posterior(x_t, t):
    """σ_p², μ_p of x0 | x_t for the Gaussian endpoint law; x_t [.., D], t float."""
    var = 1.0 / (1.0 / S0**2 + (1 - t) ** 2 / t**2)
    mu = var * (MEAN0 / S0**2 + (1 - t) * x_t / t**2)
    return var, mu


def advantage(x0):
    return x0 @ A_COEF + B_COEF


def true_grad_v(t):
    var, _ = posterior(torch.zeros(D, dtype=F64), t)
    return A_COEF * (1 - t) * var / t**2


def mc_check(samples, target, n_se=5.0):
    mean = samples.mean(0)
    se = samples.std(0) / math.sqrt(samples.shape[0])
    assert torch.all((mean - target).abs() <= n_se * se + 1e-12), (mean, target, se)


# ---------------------------------------------------------------- check 1: deterministic unbiased
def test_deterministic_estimator_unbiased_on_toy_posterior():
    g = torch.Generator().manual_seed(0)
    t = 0.6
    xs = torch.tensor([0.3, -0.5, 1.1], dtype=F64)
    var, mu = posterior(xs, t)
    x0 = mu + math.sqrt(var) * torch.randn(M, D, generator=g, dtype=F64)
    x_t = xs.expand(M, D)
    tt = torch.full((M,), t, dtype=F64)
    v_old = ((xs - mu) / t).expand(M, D)
    ghat = ps.deterministic_direction(x_t, tt, x0, v_old, advantage(x0))
    est = ps.estimator_scale("deterministic", tt)[:, None] * ghat
    mc_check(est, true_grad_v(t))


# ---------------------------------------------------------------- check 2: KDE unbiased, lower covariance
def _kde_rollouts(t, G, gen):
    xs = torch.tensor([0.3, -0.5, 1.1], dtype=F64)
    var, mu = posterior(xs, t)
    anchor = mu + math.sqrt(var) * torch.randn(M, 1, D, generator=gen, dtype=F64)
    others = MEAN0 + S0 * torch.randn(M, G - 1, D, generator=gen, dtype=F64)
    x0 = torch.cat([anchor, others], 1).reshape(M * G, D)
    x_t = xs.expand(M * G, D)
    tt = torch.full((M * G,), t, dtype=F64)
    v_old = ((xs - mu) / t).expand(M * G, D)
    gid = torch.arange(M).repeat_interleave(G)
    return x_t, tt, x0, v_old, gid


def test_kde_unbiased_at_h1_and_lower_variance_than_deterministic():
    gen = torch.Generator().manual_seed(1)
    t, G = 0.5, 6
    x_t, tt, x0, v_old, gid = _kde_rollouts(t, G, gen)
    A = advantage(x0)
    kde = ps.kde_value_gradient(x_t, tt, x0, v_old, A, gid, bandwidth=1.0).reshape(M, G, D)[:, 0]
    det = ps.deterministic_direction(x_t, tt, x0, v_old, A).reshape(M, G, D)[:, 0]
    s = (1 - t) / t
    mc_check(s * kde, true_grad_v(t))
    mc_check(s * det, true_grad_v(t))
    tr_kde = torch.var(s * kde, 0).sum()
    tr_det = torch.var(s * det, 0).sum()
    assert tr_kde < tr_det, (tr_kde, tr_det)


# ---------------------------------------------------------------- check 3: stochastic unbiased
@pytest.mark.parametrize("tau,t_next", [(0.35, 0.75), (0.05, 0.3)])
def test_stochastic_estimator_unbiased_for_any_step(tau, t_next):
    gen = torch.Generator().manual_seed(2)
    mu_step = torch.tensor([0.2, -0.1, 0.4], dtype=F64)
    z = torch.randn(M, D, generator=gen, dtype=F64)
    x_next = mu_step + tau * z
    var, mu = posterior(x_next, t_next)
    x0 = mu + math.sqrt(var) * torch.randn(M, D, generator=gen, dtype=F64)
    ghat = ps.stochastic_direction(advantage(x0), z)
    est = ps.estimator_scale("stochastic", torch.full((M,), 0.9, dtype=F64),
                             std=torch.full((M,), tau, dtype=F64))[:, None] * ghat
    mc_check(est, true_grad_v(t_next))


def test_step_noise_recovers_z_and_skips_zero_std():
    gen = torch.Generator().manual_seed(3)
    x, v, z = (torch.randn(3, 2, 4, generator=gen, dtype=F64) for _ in range(3))
    c_x = torch.tensor([0.9, 1.0, 0.8], dtype=F64)
    c_v = torch.tensor([-0.1, -0.2, -0.3], dtype=F64)
    std = torch.tensor([0.3, 0.0, 0.5], dtype=F64)
    x_next = c_x[:, None, None] * x + c_v[:, None, None] * v + std[:, None, None] * z
    out = ps.step_noise(x, x_next, v, c_x, c_v, std)
    torch.testing.assert_close(out[[0, 2]], z[[0, 2]])
    assert torch.all(out[1] == 0)


# ---------------------------------------------------------------- check 4: KDE limits + worked example
def test_kde_worked_example():
    x_t = torch.zeros(2, 1, dtype=F64)
    t = torch.full((2,), 0.5, dtype=F64)
    x0 = torch.tensor([[0.0], [2.0]], dtype=F64)
    A = torch.tensor([1.0, -1.0], dtype=F64)
    v_old = torch.full((2, 1), 0.3, dtype=F64)
    gid = torch.tensor([7, 7])
    w, mask = ps.kde_weights(x_t, t, x0, gid, bandwidth=1.0)
    torch.testing.assert_close(w[0], torch.tensor([0.880797, 0.119203], dtype=F64), atol=1e-6, rtol=0)
    g = ps.kde_value_gradient(x_t, t, x0, v_old, A, gid, bandwidth=1.0)
    assert abs(float(g[0, 0]) - (-0.248333)) < 1e-6
    assert abs(float(ps.deterministic_direction(x_t, t, x0, v_old, A)[0, 0]) - 0.3) < 1e-12


def _random_groups(gen, sizes, d=5):
    B = sum(sizes)
    gid = torch.cat([torch.full((n,), 10 * i + 3) for i, n in enumerate(sizes)])
    perm = torch.randperm(B, generator=gen)
    gid = gid[perm]
    x0 = torch.randn(B, 1, d, generator=gen, dtype=F64)
    t = torch.rand(B, generator=gen, dtype=F64) * 0.8 + 0.1
    x_t = (1 - t)[:, None, None] * x0 + t[:, None, None] * torch.randn(B, 1, d, generator=gen, dtype=F64)
    v_old = torch.randn(B, 1, d, generator=gen, dtype=F64)
    A = torch.randn(B, generator=gen, dtype=F64)
    return x_t, t, x0, v_old, A, gid


def test_kde_small_bandwidth_equals_deterministic_when_anchor_nearest():
    gen = torch.Generator().manual_seed(4)
    d, G = 4, 5
    x0 = 3.0 * torch.randn(G, d, generator=gen, dtype=F64)   # well separated endpoints
    t = torch.full((G,), 0.4, dtype=F64)
    x_t = (1 - t)[:, None] * x0 + 1e-3 * torch.randn(G, d, generator=gen, dtype=F64)
    v_old = torch.randn(G, d, generator=gen, dtype=F64)
    A = torch.randn(G, generator=gen, dtype=F64)
    gid = torch.zeros(G, dtype=torch.long)
    g = ps.kde_value_gradient(x_t, t, x0, v_old, A, gid, bandwidth=1e-12 * d)
    torch.testing.assert_close(g, ps.deterministic_direction(x_t, t, x0, v_old, A), rtol=1e-12, atol=1e-12)


def test_kde_large_bandwidth_equals_uniform_formula():
    gen = torch.Generator().manual_seed(5)
    x_t, t, x0, v_old, A, gid = _random_groups(gen, [4, 3, 6])
    d = x_t[0].numel()
    g = ps.kde_value_gradient(x_t, t, x0, v_old, A, gid, bandwidth=1e12 * d)
    for i in range(len(A)):
        j = gid == gid[i]
        v = (x_t[i] - x0[j]) / t[i]
        expect = -(A[j][:, None, None] * (v - v_old[i])).mean(0)
        torch.testing.assert_close(g[i], expect, rtol=1e-9, atol=1e-9)
    # Σ_j A_j = 0 → ĝ = (1/(t·G))·Σ_j A_j·x0_j
    A0 = A.clone()
    for k in gid.unique():
        A0[gid == k] -= A[gid == k].mean()
    g0 = ps.kde_value_gradient(x_t, t, x0, v_old, A0, gid, bandwidth=1e12 * d)
    for i in range(len(A)):
        j = gid == gid[i]
        torch.testing.assert_close(g0[i], (A0[j][:, None, None] * x0[j]).sum(0) / (t[i] * j.sum()),
                                   rtol=1e-8, atol=1e-9)


def naive_kde(x_t, t, x0, v_old, A, gid, h):
    out = torch.zeros_like(x_t)
    for i in range(len(A)):
        members = [j for j in range(len(A)) if gid[j] == gid[i]]
        logits = torch.stack([-((x_t[i] - (1 - t[i]) * x0[j]) ** 2).sum() / (2 * h * t[i] ** 2) for j in members])
        w = torch.softmax(logits, 0)
        for wj, j in zip(w, members):
            out[i] -= wj * A[j] * ((x_t[i] - x0[j]) / t[i] - v_old[i])
    return out


@pytest.mark.parametrize("h", [1.0, 0.05, None])
@pytest.mark.parametrize("layout", ["unequal_shuffled", "equal_shuffled", "equal_contiguous"])
def test_kde_batched_equals_naive_pair_loop(h, layout):
    gen = torch.Generator().manual_seed(6)
    sizes = [4, 1, 6, 3] if layout == "unequal_shuffled" else [4, 4, 4]
    x_t, t, x0, v_old, A, gid = _random_groups(gen, sizes)
    if layout == "equal_contiguous":
        gid = torch.arange(12) // 4
    d = x_t[0].numel()
    got = ps.kde_value_gradient(x_t, t, x0, v_old, A, gid, bandwidth=h)
    torch.testing.assert_close(got, naive_kde(x_t, t, x0, v_old, A, gid, d / 2000 if h is None else h))


def test_kde_low_precision_inputs_computed_in_fp32():
    gen = torch.Generator().manual_seed(7)
    x_t, t, x0, v_old, A, gid = _random_groups(gen, [3, 3])
    g = ps.kde_value_gradient(x_t.bfloat16(), t.bfloat16(), x0.bfloat16(), v_old.bfloat16(), A.bfloat16(), gid)
    assert g.dtype == torch.float32 and torch.isfinite(g).all()


# ---------------------------------------------------------------- check 5: presets
def _trajectory_batch(gen, sampler, k, noise_level, B=6, d=8, grid=None):
    sig = sde.make_grid(10, 3.0, dtype=F64) if grid is None else grid
    coef = sde.sampler_coefficients(sampler, sig, k, noise_level=noise_level)
    c_x, c_v, std = (c.expand(B).clone() for c in (coef.c_x, coef.c_v, coef.std))
    x = torch.randn(B, 2, d // 2, generator=gen, dtype=F64)
    v_old = torch.randn(B, 2, d // 2, generator=gen, dtype=F64)
    z = torch.randn(B, 2, d // 2, generator=gen, dtype=F64)
    mean_old = sde.step_mean(x, v_old, coef)
    x_next = mean_old + std[:, None, None] * z
    A = torch.randn(B, generator=gen, dtype=F64)
    batch = StepBatch(advantages=A, x_t=x, t=sig[k].expand(B).clone(), x_next=x_next,
                      t_next=sig[k + 1].expand(B).clone(), c_x=c_x, c_v=c_v, std=std, old_velocity=v_old,
                      x0=torch.randn(B, 2, d // 2, generator=gen, dtype=F64), group_ids=torch.arange(B) // 3,
                      step_advantages=torch.randn(B, generator=gen, dtype=F64))
    return batch, coef, mean_old


def _items(batch, cfg, velocity):
    b = ps.prepare_path_space(batch, cfg)
    a = ps._anchor_advantages(b, cfg)
    w1, w2 = ps.preset_weights(cfg.weight_rule, advantages=a, c_v=b.c_v, std=b.std, dt=b.t - b.t_next,
                               tempflow_c=cfg.tempflow_c, nft_beta=cfg.nft_beta)
    return ps.path_space_item_loss(velocity, b.old_velocity, b.value_direction, w1, w2), b


@pytest.mark.parametrize("sampler,noise", [("flow_sde", 0.7), ("cps", 0.8), ("dance", 0.3), ("flow_sde", 1.4)])
@pytest.mark.parametrize("k", [0, 4, 8])
def test_flow_grpo_preset_value_identity(sampler, noise, k):
    gen = torch.Generator().manual_seed(10 + k)
    batch, coef, mean_old = _trajectory_batch(gen, sampler, k, noise)
    v = batch.old_velocity + 0.3 * torch.randn(batch.old_velocity.shape, generator=gen, dtype=F64)
    cfg = ps.PathSpaceConfig(preset="flow_grpo", kl_coef=0.0)
    item, _ = _items(batch, cfg, v)
    lp = sde.gaussian_log_prob(batch.x_next, sde.step_mean(batch.x_t, v, coef), batch.std)
    lp_old = sde.gaussian_log_prob(batch.x_next, mean_old, batch.std)
    torch.testing.assert_close(item, -batch.advantages * (lp - lp_old), rtol=1e-10, atol=1e-12)
    # registered entry: mean over items
    b = ps.prepare_path_space(batch, cfg)
    out = get_loss_spec("path_space").fn(StepQuantities(velocity=v), b, cfg)
    torch.testing.assert_close(out.loss, item.mean())


def test_tempflow_preset_value_identity():
    gen = torch.Generator().manual_seed(20)
    batch, coef, mean_old = _trajectory_batch(gen, "flow_sde", 3, 0.7)
    v = batch.old_velocity + 0.3 * torch.randn(batch.old_velocity.shape, generator=gen, dtype=F64)
    cfg = ps.PathSpaceConfig(preset="tempflow", kl_coef=0.0, tempflow_c=2.25)
    item, _ = _items(batch, cfg, v)
    lr = (sde.gaussian_log_prob(batch.x_next, sde.step_mean(batch.x_t, v, coef), batch.std)
          - sde.gaussian_log_prob(batch.x_next, mean_old, batch.std))
    torch.testing.assert_close(item, 2.25 * batch.std * (-batch.step_advantages * lr))


def test_grpo_guard_preset_gradient_equals_on_policy_guard_gradient():
    gen = torch.Generator().manual_seed(21)
    batch, coef, mean_old = _trajectory_batch(gen, "flow_sde", 5, 0.7)
    cfg = ps.PathSpaceConfig(preset="grpo_guard", kl_coef=0.0)
    v = batch.old_velocity.clone().requires_grad_(True)
    item, b = _items(batch, cfg, v)
    (g_preset,) = torch.autograd.grad(item.sum(), v)
    v2 = batch.old_velocity.clone().requires_grad_(True)
    z = (batch.x_next - mean_old) / batch.std[:, None, None]
    log_rho = ps._mean_e(batch.c_v[:, None, None] * (v2 - batch.old_velocity) * z)
    dt = batch.t - batch.t_next
    loss_g = (-batch.advantages * torch.exp(log_rho) / dt).sum()
    (g_guard,) = torch.autograd.grad(loss_g, v2)
    torch.testing.assert_close(g_preset, g_guard)


def _forward_batch(gen, B=6, d=8):
    x0 = torch.randn(B, d, generator=gen, dtype=F64)
    eps = torch.randn(B, d, generator=gen, dtype=F64)
    t = torch.rand(B, generator=gen, dtype=F64) * 0.8 + 0.1
    A = 3 * torch.randn(B, generator=gen, dtype=F64)
    return StepBatch(advantages=A, x0=x0, noise=eps, t=t, group_ids=torch.arange(B) // 3)


def test_awm_preset_value_identity_and_gradient_independent_of_v_old():
    gen = torch.Generator().manual_seed(22)
    b = _forward_batch(gen)
    cfg = ps.PathSpaceConfig(preset="awm", kl_coef=0.0)
    v_theta = torch.randn(b.x0.shape, generator=gen, dtype=F64)
    v = b.noise - b.x0
    a2 = b.advantages.clamp(-5, 5) / 5
    grads = []
    for seed in (0, 1):
        v_old = torch.randn(b.x0.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
        vt = v_theta.clone().requires_grad_(True)
        g = ps.compute_value_direction(b, cfg, old_velocity=v_old)
        w1, w2 = ps.preset_weights("awm", advantages=a2)
        item = ps.path_space_item_loss(vt, v_old, g, w1, w2)
        torch.testing.assert_close(item, a2 * ps._mean_e((v_theta - v) ** 2) - a2 * ps._mean_e((v - v_old) ** 2))
        grads.append(torch.autograd.grad(item.sum(), vt)[0])
        # autograd vs central finite difference on one element
        e = torch.zeros_like(v_theta)
        e[1, 2] = 1e-6
        fd = (ps.path_space_item_loss(v_theta + e, v_old, g, w1, w2).sum()
              - ps.path_space_item_loss(v_theta - e, v_old, g, w1, w2).sum()) / 2e-6
        assert abs(float(fd) - float(grads[-1][1, 2])) < 1e-7
    torch.testing.assert_close(grads[0], grads[1])


def test_nft_preset_value_identity():
    from verl_diffusion.algos.matching_losses import nft_paper_loss

    gen = torch.Generator().manual_seed(23)
    b = _forward_batch(gen)
    for beta in (1.0, 0.1):
        cfg = ps.PathSpaceConfig(preset="nft", kl_coef=0.0, nft_beta=beta)
        v_old = torch.randn(b.x0.shape, generator=gen, dtype=F64)
        v_theta = torch.randn(b.x0.shape, generator=gen, dtype=F64)
        a1 = b.advantages.clamp(-5, 5) / 5
        g = ps.compute_value_direction(b, cfg, old_velocity=v_old)
        w1, w2 = ps.preset_weights("nft", advantages=a1, nft_beta=beta)
        item = ps.path_space_item_loss(v_theta, v_old, g, w1, w2)
        v = b.noise - b.x0
        lhs = nft_paper_loss(v_theta, v_old, v, a1, beta=beta)
        torch.testing.assert_close(lhs, beta**2 * item + ps._mean_e((v - v_old) ** 2))


def test_forward_presets_run_through_registered_entry():
    gen = torch.Generator().manual_seed(24)
    b = _forward_batch(gen)
    v_old = torch.randn(b.x0.shape, generator=gen, dtype=F64)
    v_theta = torch.randn(b.x0.shape, generator=gen, dtype=F64, requires_grad=True)
    cfg = ps.PathSpaceConfig(preset="awm", kl_coef=0.0)
    out = get_loss_spec("path_space").fn(StepQuantities(velocity=v_theta, old_velocity=v_old), b, cfg)
    a2 = b.advantages.clamp(-5, 5) / 5
    v = b.noise - b.x0
    torch.testing.assert_close(out.loss, (a2 * (ps._mean_e((v_theta - v) ** 2) - ps._mean_e((v - v_old) ** 2))).mean())
    # KDE in forward mode via prepare (needs old_velocity over the whole batch)
    cfg_k = ps.PathSpaceConfig(preset="ps_kde", xt_source="forward_noising", kl_coef=0.0)
    pb = ps.prepare_path_space(StepBatch(**{**b.__dict__, "old_velocity": v_old}), cfg_k)
    x_t = (1 - b.t)[:, None] * b.x0 + b.t[:, None] * b.noise
    expect = ps.kde_value_gradient(x_t, b.t, b.x0, v_old, b.advantages, b.group_ids)
    torch.testing.assert_close(pb.value_direction, expect)


# ---------------------------------------------------------------- check 6: signs
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sign_deterministic_step_moves_toward_or_away_from_conditional_velocity(sign):
    gen = torch.Generator().manual_seed(30)
    B, d = 4, 6
    x0, x_t, v_old = (torch.randn(B, d, generator=gen, dtype=F64) for _ in range(3))
    t = torch.full((B,), 0.5, dtype=F64)
    A = torch.full((B,), sign, dtype=F64)
    v = (x_t - x0) / t[:, None]
    g = ps.deterministic_direction(x_t, t, x0, v_old, A)
    vt = v_old.clone().requires_grad_(True)
    loss = ps.path_space_item_loss(vt, v_old, g, torch.zeros(B, dtype=F64), torch.ones(B, dtype=F64)).sum()
    (grad,) = torch.autograd.grad(loss, vt)
    new = v_old - 0.5 * grad
    before = ps._mean_e((v_old - v) ** 2)
    after = ps._mean_e((new - v) ** 2)
    assert torch.all(after < before) if sign > 0 else torch.all(after > before)


def test_sign_stochastic_step_increases_log_prob_of_sampled_state():
    gen = torch.Generator().manual_seed(31)
    batch, coef, mean_old = _trajectory_batch(gen, "flow_sde", 4, 0.7)
    batch.advantages = batch.advantages.abs() + 0.1
    cfg = ps.PathSpaceConfig(preset="ps_sto", kl_coef=0.0)
    b = ps.prepare_path_space(batch, cfg)
    vt = b.old_velocity.clone().requires_grad_(True)
    out = get_loss_spec("path_space").fn(StepQuantities(velocity=vt), b, cfg)
    (grad,) = torch.autograd.grad(out.loss, vt)
    new = b.old_velocity - 10.0 * grad
    lp_new = sde.gaussian_log_prob(b.x_next, sde.step_mean(b.x_t, new, coef), b.std)
    lp_old = sde.gaussian_log_prob(b.x_next, mean_old, b.std)
    assert torch.all(lp_new > lp_old)


# ---------------------------------------------------------------- check 7: on-policy gradient
@pytest.mark.parametrize("preset", ["ps_kde", "ps_det", "ps_sto"])
def test_on_policy_gradient_is_w2_g_over_d(preset):
    gen = torch.Generator().manual_seed(40)
    batch, _, _ = _trajectory_batch(gen, "flow_sde", 3, 0.7)
    cfg = ps.PathSpaceConfig(preset=preset, kl_coef=0.0, w1_constant=3.0, w2_exponent=2.0)
    b = ps.prepare_path_space(batch, cfg)
    vt = b.old_velocity.clone().requires_grad_(True)
    out = get_loss_spec("path_space").fn(StepQuantities(velocity=vt), b, cfg)
    (grad,) = torch.autograd.grad(out.loss, vt)
    B, d = vt.shape[0], vt[0].numel()
    w2 = ps.w2_weight(cfg.w2_family, b.t, exponent=2.0)
    torch.testing.assert_close(grad, w2[:, None, None] * b.value_direction / (d * B))


# ---------------------------------------------------------------- check 8: weights
def test_weight_numbers_and_bounds():
    t = torch.tensor([0.25], dtype=F64)
    A = torch.tensor([-2.0], dtype=F64)
    assert float(ps.w2_weight("t", t, exponent=2)) == pytest.approx(0.0625)
    assert float(ps.w2_weight("one_minus_t", t, exponent=2)) == pytest.approx(0.5625)
    assert float(ps.w1_weight("t", t, A, exponent=2)) == pytest.approx(0.0625)
    assert float(ps.w1_weight("one_minus_t", t, A, exponent=2)) == pytest.approx(0.5625)
    assert float(ps.w1_weight("adv_one_minus_t", t, A, exponent=2)) == pytest.approx(-1.125)
    assert float(ps.w1_weight("zero", t, A)) == 0.0
    tt = torch.linspace(0, 1, 101, dtype=F64)
    AA = torch.linspace(-5, 5, 101, dtype=F64)
    for alpha in (0.0, 0.5, 1.0, 2.0, 7.0):
        for fam in ("t", "one_minus_t"):
            w = ps.w2_weight(fam, tt, exponent=alpha)
            assert torch.all((w >= 0) & (w <= 1))
            w = ps.w1_weight(fam, tt, AA, exponent=alpha)
            assert torch.all((w >= 0) & (w <= 1))
        for fam in ("adv_t", "adv_one_minus_t"):
            assert torch.all(ps.w1_weight(fam, tt, AA, exponent=alpha).abs() <= AA.abs() + 1e-15)


def test_unbounded_custom_weight_warns():
    with pytest.warns(UserWarning, match="unbounded"):
        ps.w2_weight("t", torch.tensor([0.5]), exponent=-1.0)
    with pytest.warns(UserWarning, match="unbounded"):
        ps.PathSpaceConfig(w1_exponent=-0.5)


# ---------------------------------------------------------------- registry / config
def test_registration_needs_and_batch_keys():
    spec = get_loss_spec("path_space")
    assert spec.prepare is ps.prepare_path_space
    assert spec.config is ps.PathSpaceConfig
    cfg = ps.PathSpaceConfig()
    assert cfg.estimator == "kde" and cfg.w1_family == "one_minus_t" and cfg.w2_family == "t"
    assert cfg.kl_coef == 1e-4 and cfg.kl_mode == "v_space" and cfg.xt_source == "trajectory"
    assert spec.needs_for(cfg) == StepNeeds.VELOCITY | StepNeeds.REF_VELOCITY
    assert set(spec.batch_keys_for(cfg)) == {"advantages", "x_t", "t", "x0", "old_velocity", "group_ids",
                                             "value_direction"}
    sto = ps.PathSpaceConfig(preset="ps_sto", kl_coef=0.0)
    assert spec.needs_for(sto) == StepNeeds.VELOCITY
    assert {"x_next", "c_x", "c_v", "std"} <= set(spec.batch_keys_for(sto))
    fwd = ps.PathSpaceConfig(preset="nft", kl_coef=0.0)
    assert spec.needs_for(fwd) == StepNeeds.VELOCITY | StepNeeds.OLD_VELOCITY_FRESH
    assert set(spec.batch_keys_for(fwd)) == {"advantages", "x_t", "x0", "t", "value_direction"}
    # the static declaration covers every config (the engine fills exactly spec.batch_keys)
    for name in ps.PATH_SPACE_PRESETS:
        for est in ps.ESTIMATORS:
            try:
                c = ps.PathSpaceConfig(preset=name, estimator=est, kl_mode="exact")
            except ValueError:
                continue
            assert set(spec.batch_keys_for(c)) <= set(spec.batch_keys), (name, est)
    assert spec.state_source_for(fwd) == StateSource.FORWARD_NOISING
    with pytest.raises(ValueError, match="estimator"):
        ps.PathSpaceConfig(estimator="bogus")
    with pytest.raises(ValueError, match="trajectory"):
        ps.PathSpaceConfig(preset="ps_sto", xt_source="forward_noising")
    assert set(ps.PATH_SPACE_PRESETS) == {"ps_kde", "ps_det", "ps_sto", "flow_grpo", "grpo_guard", "tempflow",
                                          "awm", "nft"}


def test_prepare_missing_field_names_it():
    gen = torch.Generator().manual_seed(50)
    batch, _, _ = _trajectory_batch(gen, "flow_sde", 3, 0.7)
    batch.group_ids = None
    with pytest.raises(ValueError, match="group_ids"):
        ps.prepare_path_space(batch, ps.PathSpaceConfig())


# ---------------------------------------------------------------- engine glue (workers/step_loss.py)
def _rows(gen, B=6, N=4, shape=(2, 3)):
    sig = sde.make_grid(N, 3.0, dtype=torch.float32)
    lat = torch.randn(B, N + 1, *shape, generator=gen)
    coefs = [sde.sampler_coefficients("flow_sde", sig, k, noise_level=0.7) for k in range(N)]
    return {
        "all_latents": lat, "sigmas": sig.expand(B, N + 1).clone(),
        "train_mask": torch.ones(B, N, dtype=torch.int32),
        "sde_cx": torch.stack([c.c_x for c in coefs]).expand(B, N).clone(),
        "sde_cv": torch.stack([c.c_v for c in coefs]).expand(B, N).clone(),
        "sde_std": torch.stack([c.std for c in coefs]).expand(B, N).clone(),
        "old_velocities": torch.randn(B, N, *shape, generator=gen),
        "advantages": torch.randn(B, 1, generator=gen).expand(B, N).clone(),
        "group_ids": torch.arange(B) // 3,
    }


@pytest.mark.parametrize("preset,xt_source", [("ps_kde", None), ("ps_sto", None), ("ps_det", "forward_noising"),
                                              ("nft", None)])
def test_registered_loss_runs_through_engine_glue(preset, xt_source):
    from verl_diffusion.workers.step_loss import make_step_loss, prepare_steps, run_step_loss

    gen = torch.Generator().manual_seed(60)
    rows = _rows(gen)
    knobs = {"preset": preset, "kl_coef": 0.0, "xt_source": xt_source}
    loss = make_step_loss("path_space", knobs)
    w = torch.tensor(0.9, requires_grad=True)
    vfn = lambda x, t, r: w * x  # noqa: E731
    rows.update(prepare_steps(loss, rows, velocity_fn=vfn, generator=gen))
    out, n, q, st = run_step_loss(loss, rows, 1, velocity_fn=vfn)
    assert n == 6 and torch.isfinite(out.loss)
    out.loss.backward()
    assert w.grad is not None and torch.isfinite(w.grad)


def test_forward_kde_through_engine_uses_fresh_old_velocity():
    from verl_diffusion.workers.step_loss import PREP_PREFIX, make_step_loss, prepare_steps

    gen = torch.Generator().manual_seed(61)
    rows = _rows(gen)
    loss = make_step_loss("path_space", {"preset": "ps_kde", "xt_source": "forward_noising", "kl_coef": 0.0})
    vfn = lambda x, t, r: 0.9 * x  # noqa: E731
    prep = prepare_steps(loss, rows, velocity_fn=vfn, generator=gen)
    k = 1
    x_t, t = prep[PREP_PREFIX + "x_t"][:, k], rows["sigmas"][:, k]
    expect = ps.kde_value_gradient(x_t, t, rows["all_latents"][:, -1], vfn(x_t, t, rows), rows["advantages"][:, k],
                                   rows["group_ids"])
    torch.testing.assert_close(prep[PREP_PREFIX + "value_direction"][:, k], expect)


def test_prepare_with_metrics_reports_kde_weights():
    gen = torch.Generator().manual_seed(62)
    batch, _, _ = _trajectory_batch(gen, "flow_sde", 3, 0.7)
    b, m = ps.prepare_path_space_with_metrics(batch, ps.PathSpaceConfig(kde_bandwidth=1e6))
    assert b.value_direction.shape == batch.x_t.shape
    assert m["actor/kde_weight_entropy"] == pytest.approx(math.log(3), rel=1e-4)   # groups of 3, uniform weights
    assert m["actor/kde_weight_max"] == pytest.approx(1 / 3, rel=1e-4)
    assert m["actor/ps_estimator_norm"] > 0


@pytest.mark.parametrize("kl_mode", ["v_space", "gaussian_step", "girsanov"])
def test_reference_kl_added_with_kl_coef(kl_mode):
    from verl_diffusion.algos.kl import reference_kl

    gen = torch.Generator().manual_seed(63)
    batch, _, _ = _trajectory_batch(gen, "flow_sde", 3, 0.7)
    cfg = ps.PathSpaceConfig(kl_coef=1e-2, kl_mode=kl_mode, noise_level=0.7)
    b = ps.prepare_path_space(batch, cfg)
    v = b.old_velocity + 0.1 * torch.randn(b.old_velocity.shape, generator=gen, dtype=F64)
    v_ref = b.old_velocity + 0.1 * torch.randn(b.old_velocity.shape, generator=gen, dtype=F64)
    out = get_loss_spec("path_space").fn(StepQuantities(velocity=v, ref_velocity=v_ref), b, cfg)
    base = get_loss_spec("path_space").fn(StepQuantities(velocity=v), b, ps.PathSpaceConfig(kl_coef=0.0))
    kl = reference_kl(kl_mode, velocity=v, ref_velocity=v_ref, c_v=b.c_v, std=b.std, t=b.t, dt=b.t - b.t_next,
                      noise_level=0.7)
    torch.testing.assert_close(out.loss, base.loss + 1e-2 * kl.mean())
    assert out.metrics["actor/kl"] == pytest.approx(float(kl.mean()))
