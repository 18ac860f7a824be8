"""SPEC §3 (GRPO family) and §4 (Flow-DPPO) checks for verl_diffusion.algos.ratio_losses (fp64, tiny tensors)."""

import math
from dataclasses import replace

import pytest
import torch

from verl_diffusion.algos.losses import LOSSES, get_loss_spec
from verl_diffusion.algos.ratio_losses import (
    DPPO_MASKS,
    KL_BATCH_KEYS,
    DanceGrpoConfig,
    DppoMask,
    FlowDppoConfig,
    FlowGrpoConfig,
    GrpoGuardConfig,
    TempFlowGrpoConfig,
    clipped_surrogate_loss,
    dppo_keep_mask,
    dppo_predictive_terms,
    flow_dppo_loss,
    guard_log_ratio,
)
from verl_diffusion.algos.sde import (
    gaussian_log_prob,
    log_ratio_exact,
    make_grid,
    sampler_coefficients,
    step_mean,
)
from verl_diffusion.algos.types import StepBatch, StepNeeds, StepQuantities

D64 = torch.float64
NOISE = 0.7


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def make_items(sampler="flow_sde", steps=(1, 3, 5, 7), d=8, seed=0, noise_level=NOISE, dv_scale=0.0):
    """A fp64 batch of items on the N = 10, S = 3 grid: one item per step in ``steps``.

    Returns (batch, v_old, v_theta leaf, coef, sigmas) with x_next drawn from π_old and
    v_theta = v_old + dv_scale·noise (a leaf with grad).
    """
    g = gen(seed)
    sig = make_grid(10, 3.0, dtype=D64)
    k = torch.tensor(steps)
    coef = sampler_coefficients(sampler, sig, k, noise_level=noise_level)
    b = len(steps)
    x = torch.randn(b, d, generator=g, dtype=D64)
    v_old = torch.randn(b, d, generator=g, dtype=D64)
    z = torch.randn(b, d, generator=g, dtype=D64)
    mu_old = step_mean(x, v_old, coef)
    x_next = mu_old + coef.std[:, None] * z
    adv = torch.randn(b, generator=g, dtype=D64)
    v_theta = (v_old + dv_scale * torch.randn(b, d, generator=g, dtype=D64)).requires_grad_(True)
    batch = StepBatch(advantages=adv, x_t=x, t=sig[k], x_next=x_next, t_next=sig[k + 1], c_x=coef.c_x,
                      c_v=coef.c_v, std=coef.std,
                      old_log_prob=gaussian_log_prob(x_next, mu_old, coef.std), old_mean=mu_old,
                      old_velocity=v_old)
    return batch, v_old, v_theta, coef, sig


def quantities(batch, v_theta, coef, ref_velocity=None):
    mean = step_mean(batch.x_t, v_theta, coef)
    return StepQuantities(velocity=v_theta, mean=mean, log_prob=gaussian_log_prob(batch.x_next, mean, coef.std),
                          ref_velocity=ref_velocity)


def run(name, q, batch, **cfg):
    spec = get_loss_spec(name)
    return spec.fn(q, batch, spec.config(**cfg))


# ======================================================================================================
# Registry, configs, errors
# ======================================================================================================

KL = ("c_v", "std", "t", "t_next")
EXPECTED = {
    "flow_grpo": (StepNeeds.LOG_PROB | StepNeeds.VELOCITY, ("advantages", "old_log_prob") + KL, FlowGrpoConfig),
    "dance_grpo": (StepNeeds.LOG_PROB | StepNeeds.VELOCITY, ("advantages", "old_log_prob") + KL, DanceGrpoConfig),
    "grpo_guard": (StepNeeds.MEAN | StepNeeds.VELOCITY,
                   ("advantages", "old_mean", "x_next", "std", "t", "t_next", "c_v"), GrpoGuardConfig),
    "tempflow_grpo": (StepNeeds.LOG_PROB | StepNeeds.VELOCITY,
                      ("advantages", "old_log_prob", "std", "c_v", "t", "t_next"), TempFlowGrpoConfig),
    "flow_dppo": (StepNeeds.MEAN | StepNeeds.VELOCITY,
                  ("advantages", "old_mean", "x_next", "std", "c_v", "t", "t_next"), FlowDppoConfig),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_registry_entries(name):
    spec = get_loss_spec(name)
    needs, keys, config = EXPECTED[name]
    assert spec.needs == needs and spec.batch_keys == keys and spec.config is config
    assert LOSSES[name] is spec
    assert set(KL_BATCH_KEYS) <= set(spec.batch_keys)  # the engine passes only declared keys
    cfg = config()  # working defaults
    ref = bool(spec.needs_for(cfg) & StepNeeds.REF_VELOCITY)
    assert ref == (cfg.kl_coef > 0)
    assert spec.needs_for(replace(cfg, kl_coef=0.1)) & StepNeeds.REF_VELOCITY


def test_presets():
    assert (FlowGrpoConfig().clip_range, FlowGrpoConfig().kl_coef, FlowGrpoConfig().kl_mode) == (
        1e-4, 0.04, "flow_grpo_legacy")
    assert (GrpoGuardConfig().clip_range, GrpoGuardConfig().kl_coef) == (2e-6, 0.0)
    assert (DanceGrpoConfig().clip_range, DanceGrpoConfig().kl_coef) == (1e-4, 0.0)
    assert TempFlowGrpoConfig().scale == 2.25 and TempFlowGrpoConfig().kl_mode == "exact"
    c = FlowDppoConfig()
    assert (c.mask, c.threshold) == ("original", 1e-5) and DPPO_MASKS == ("original", "first_order", "predictive")
    assert [m.value for m in DppoMask] == list(DPPO_MASKS)


def test_bad_names_one_clear_line():
    with pytest.raises(ValueError, match=r"loss_mode='flow_grp' is unknown; choose one of \[.*'flow_dppo'.*\]"):
        get_loss_spec("flow_grp")
    with pytest.raises(ValueError, match=r"kl_mode='k3' is unknown; choose one of \['exact', 'flow_grpo_legacy'\]"):
        FlowGrpoConfig(kl_mode="k3")
    with pytest.raises(ValueError, match=r"mask='second_order' is unknown; choose one of "
                                         r"\['first_order', 'original', 'predictive'\]"):
        FlowDppoConfig(mask="second_order")
    with pytest.raises(ValueError, match="predictive_lambda"):
        FlowDppoConfig(mask="predictive", predictive_lambda=0.0)
    with pytest.raises(ValueError, match="clip_range"):
        GrpoGuardConfig(clip_range=-1.0)
    with pytest.raises(ValueError, match="sampler"):
        FlowGrpoConfig(sampler="euler")
    assert FlowDppoConfig(mask="predictive").predictive_lambda == 3e-4


def test_shape_mismatch_names_tensors():
    batch, _, v, coef, _ = make_items()
    q = quantities(batch, v, coef)
    bad = replace(batch, old_log_prob=batch.old_log_prob[:3])
    with pytest.raises(ValueError, match="old_log_prob"):
        run("flow_grpo", q, bad, kl_coef=0.0)
    with pytest.raises(ValueError, match="log_prob"):
        run("flow_grpo", replace(q, log_prob=q.log_prob[:2]), batch, kl_coef=0.0)
    with pytest.raises(ValueError, match="mean"):
        run("flow_dppo", replace(q, mean=q.mean[:, :4]), batch)
    with pytest.raises(ValueError, match=r"needs StepBatch fields \['old_mean'\]"):
        run("flow_dppo", q, replace(batch, old_mean=None))
    with pytest.raises(ValueError, match="ref_velocity"):
        run("flow_grpo", q, batch)  # default kl_coef 0.04 needs the reference velocity


def test_metrics_are_floats_under_actor():
    batch, v_old, v, coef, _ = make_items(dv_scale=1e-3)
    q = quantities(batch, v, coef, ref_velocity=v_old + 0.01)
    for name in EXPECTED:
        kw = {"kl_coef": 0.1}
        out = run(name, q, batch, **kw)
        assert out.loss.dim() == 0 and out.loss.requires_grad
        assert out.metrics and all(k.startswith("actor/") and isinstance(x, float) for k, x in out.metrics.items())
        assert "actor/kl" in out.metrics and "actor/approx_kl" in out.metrics
        if name != "flow_dppo":
            assert {"actor/clipfrac", "actor/clipfrac_high", "actor/clipfrac_low",
                    "actor/ratio_mean", "actor/ratio_std"} <= set(out.metrics)
        else:
            assert "actor/dppo_mask_frac" in out.metrics


# ======================================================================================================
# SPEC §3 checks (GRPO family)
# ======================================================================================================

@pytest.mark.parametrize("name", ["flow_grpo", "dance_grpo"])
def test_s3_check1_on_policy_ratio_one_and_gradient(name):
    sampler = "dance" if name == "dance_grpo" else "flow_sde"
    batch, _, v, coef, _ = make_items(sampler=sampler, noise_level=0.3 if sampler == "dance" else NOISE)
    q = quantities(batch, v, coef)
    assert torch.equal(q.log_prob, batch.old_log_prob)  # identical computation → ρ == 1 exactly
    out = run(name, q, batch, kl_coef=0.0)
    assert out.metrics["actor/ratio_mean"] == 1.0 and out.metrics["actor/clipfrac"] == 0.0
    (g,) = torch.autograd.grad(out.loss, v, retain_graph=True)
    (g_ref,) = torch.autograd.grad(-(batch.advantages * q.log_prob).mean(), v)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-15)


def test_s3_check2_clipped_item_gradients():
    eps = 1e-4
    lp_old = torch.zeros(4, dtype=D64)
    # items: (A>0, ρ>1+ε), (A>0, ρ<1−ε), (A<0, ρ<1−ε), (A<0, ρ>1+ε)
    lr = torch.tensor([3e-4, -3e-4, -3e-4, 3e-4], dtype=D64)
    adv = torch.tensor([1.5, 1.5, -0.7, -0.7], dtype=D64)
    lp = lr.clone().requires_grad_(True)
    per_item, m = clipped_surrogate_loss(lp, lp_old, adv, clip_range=eps)
    (g,) = torch.autograd.grad(per_item.sum(), lp)
    rho = torch.exp(lr)
    assert g[0].item() == 0.0 and g[2].item() == 0.0  # optimistic side clipped: no gradient
    torch.testing.assert_close(g[1], -adv[1] * rho[1], rtol=1e-14, atol=0)  # −A·∇ρ, ∇ρ = ρ·∇ℓ
    torch.testing.assert_close(g[3], -adv[3] * rho[3], rtol=1e-14, atol=0)
    assert m["actor/clipfrac"].item() == 1.0
    assert m["actor/clipfrac_high"].item() == 0.5 and m["actor/clipfrac_low"].item() == 0.5
    # asymmetric ranges: ρ = exp(3e-4) is inside 1 + ε_hi = 1 + 1e-3, so item 0 now has gradient
    per_item, _ = clipped_surrogate_loss(lp, lp_old, adv, clip_range=eps, clip_range_high=1e-3)
    (g,) = torch.autograd.grad(per_item.sum(), lp)
    torch.testing.assert_close(g[0], -adv[0] * rho[0], rtol=1e-14, atol=0)


def test_s3_check3_legacy_kl_is_exact_times_dt():
    for sampler, noise in (("flow_sde", NOISE), ("dance", 0.3), ("cps", 0.8)):
        batch, v_old, v, coef, _ = make_items(sampler=sampler, noise_level=noise, dv_scale=1e-2)
        ref = v_old + 0.05 * torch.randn(v_old.shape, generator=gen(3), dtype=D64)
        kls = {}
        for mode in ("exact", "flow_grpo_legacy"):
            q = quantities(batch, v, coef, ref_velocity=ref)
            kls[mode] = run("flow_grpo", q, batch, kl_mode=mode, kl_coef=1.0, sampler=sampler).metrics["actor/kl"]
        exact = (batch.c_v ** 2 * ((v - ref) ** 2).mean(1) / (2 * batch.std ** 2)).detach()
        assert math.isclose(kls["exact"], exact.mean().item(), rel_tol=1e-12)
        dt = batch.t - batch.t_next
        expect = (exact * dt).mean().item() if sampler != "cps" else exact.mean().item()
        assert math.isclose(kls["flow_grpo_legacy"], expect, rel_tol=1e-12)


def test_kl_term_enters_loss():
    batch, v_old, v, coef, _ = make_items(dv_scale=1e-3)
    ref = v_old + 0.02
    q = quantities(batch, v, coef, ref_velocity=ref)
    base = run("flow_grpo", q, batch, kl_coef=0.0).loss
    out = run("flow_grpo", q, batch, kl_coef=0.5, kl_mode="exact")
    assert math.isclose(out.loss.item(), base.item() + 0.5 * out.metrics["actor/kl"], rel_tol=1e-12)



def _monte_carlo_actions(seed, m_draws, d, tau, dmu_scale):
    """M draws x' ~ N(μ_old, τ²I) with a fixed μ_θ = μ_old + dmu_scale·noise (same RNG order as before)."""
    g = gen(seed)
    mu_old = torch.randn(1, d, generator=g, dtype=D64).expand(m_draws, d)
    mu = mu_old + dmu_scale * torch.randn(1, d, generator=g, dtype=D64)
    std = torch.full((m_draws,), tau, dtype=D64)
    x_next = mu_old + tau * torch.randn(m_draws, d, generator=g, dtype=D64)
    return mu_old, mu, std, x_next


def test_s3_check4_guard_unbiased_and_on_policy_gradient():
    # E_z[log ρ^G] = 0 for any Δv, while E_z[ℓr] = −D < 0 (Monte Carlo, d = 4, M = 20000).
    m_draws, d, tau = 20000, 4, 0.35
    mu_old, mu, std, x_next = _monte_carlo_actions(7, m_draws, d, tau, 0.2)
    lg = guard_log_ratio(mu, mu_old, x_next, std)
    lr = log_ratio_exact(x_next, mu, mu_old, std)
    div = ((mu[0] - mu_old[0]) ** 2).mean() / (2 * tau ** 2)
    assert abs(lg.mean().item()) < 5 * lg.std().item() / math.sqrt(m_draws)
    assert abs(lr.mean().item() + div.item()) < 5 * lr.std().item() / math.sqrt(m_draws)
    torch.testing.assert_close(lg, (lr + div) * tau, rtol=1e-9, atol=1e-12)  # (ℓr + D)·τ
    # On-policy: log ρ^G = 0; ∇L^G = ∇ of (|c^v|/Δt)·A·⟨v_θ, z⟩_e  (= (1+η)·A·⟨v_θ, z⟩_e for k ≥ 1).
    batch, _, v, coef, _ = make_items(steps=(0, 2, 5, 9))
    q = quantities(batch, v, coef)
    out = run("grpo_guard", q, batch)
    assert out.metrics["actor/ratio_mean"] == 1.0 and out.metrics["actor/approx_kl"] == 0.0
    (grad,) = torch.autograd.grad(out.loss, v)
    z = (batch.x_next - batch.old_mean) / batch.std[:, None]
    dt = batch.t - batch.t_next
    w = batch.c_v.abs() / dt
    target = (w * batch.advantages * (v * z).mean(1)).mean()
    (grad_ref,) = torch.autograd.grad(target, v)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-15)
    eta = NOISE ** 2 / 2
    torch.testing.assert_close(w[1:], torch.full((3,), 1 + eta, dtype=D64), rtol=1e-12, atol=0)
    assert math.isclose(w[0].item(), 1.0, rel_tol=1e-12)  # k = 0: |c^v_0| = Δt_0


def test_guard_value_uses_each_items_tau_and_dt():
    batch, _, v, coef, _ = make_items(dv_scale=1e-3)
    q = quantities(batch, v, coef)
    out = run("grpo_guard", q, batch, clip_range=1.0)  # no clipping active
    lg = (batch.c_v * ((v - batch.old_velocity) * (batch.x_next - batch.old_mean)).mean(1) / batch.std).detach()
    expect = (-batch.advantages * torch.exp(lg) / (batch.t - batch.t_next)).mean()
    assert math.isclose(out.loss.item(), expect.item(), rel_tol=1e-10)


def test_s3_check5_sum_convention_multiplies_log_ratio_by_d():
    batch, v_old, v, coef, _ = make_items(d=16, dv_scale=1e-2)
    mu = step_mean(batch.x_t, v.detach(), coef)
    lr_mean = gaussian_log_prob(batch.x_next, mu, coef.std) - batch.old_log_prob
    s2 = 2 * coef.std ** 2
    lp_sum = -((batch.x_next - mu) ** 2).sum(1) / s2
    lp_old_sum = -((batch.x_next - batch.old_mean) ** 2).sum(1) / s2
    torch.testing.assert_close(lp_sum - lp_old_sum, 16 * lr_mean, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(log_ratio_exact(batch.x_next, mu, batch.old_mean, coef.std), lr_mean,
                               rtol=1e-9, atol=1e-12)
    # our losses read per-element means: the DPPO divergence equals the mean form, not the sum
    out = flow_dppo_loss(mu, batch.old_mean, batch.x_next, coef.std, batch.advantages)[1]
    dsum = ((mu - batch.old_mean) ** 2).sum(1) / s2
    torch.testing.assert_close(out["actor/dppo_div_mean"], dsum.mean() / 16, rtol=1e-12, atol=0)


def test_tempflow_value_and_step_advantage_fallback():
    batch, _, v, coef, _ = make_items(dv_scale=1e-4)
    q = quantities(batch, v, coef)
    out = run("tempflow_grpo", q, batch, clip_range=1.0)
    rho = torch.exp(q.log_prob - batch.old_log_prob).detach()
    expect = (2.25 * batch.std * (-batch.advantages * rho)).mean()
    assert math.isclose(out.loss.item(), expect.item(), rel_tol=1e-12)
    step_adv = torch.tensor([1.0, -2.0, 0.5, 0.0], dtype=D64)
    out2 = run("tempflow_grpo", q, replace(batch, step_advantages=step_adv), clip_range=1.0)
    expect2 = (2.25 * batch.std * (-step_adv * rho)).mean()
    assert math.isclose(out2.loss.item(), expect2.item(), rel_tol=1e-12)


# ======================================================================================================
# SPEC §4 checks (Flow-DPPO)
# ======================================================================================================

def test_s4_check1_divergence_matches_monte_carlo():
    m_draws, d, tau = 20000, 4, 0.5
    mu_old, mu, std, x_next = _monte_carlo_actions(11, m_draws, d, tau, 0.15)
    _, m = flow_dppo_loss(mu, mu_old, x_next, std, torch.ones(m_draws, dtype=D64))
    div = m["actor/dppo_div_mean"].item()
    mc = -m["actor/log_ratio_mean"].item()  # mean of ℓ_old(x') − ℓ_θ(x')
    assert abs(mc - div) < 5 * math.sqrt(2 * div / (d * m_draws))


def test_s4_check2_on_policy():
    batch, _, v, coef, _ = make_items()
    for mask in DPPO_MASKS:
        q = quantities(batch, v, coef)
        out = run("flow_dppo", q, batch, mask=mask)
        assert out.metrics["actor/dppo_div_mean"] == 0.0 and out.metrics["actor/dppo_mask_frac"] == 0.0
        (grad,) = torch.autograd.grad(out.loss, v)
        lr = log_ratio_exact(batch.x_next, step_mean(batch.x_t, v, coef), batch.old_mean, batch.std)
        (grad_ref,) = torch.autograd.grad(-(batch.advantages * lr).mean(), v)
        torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-15)


def test_s4_check3_truth_table():
    rows = [  # (A, ℓr, D) -> (original, first_order) keep?
        ((1.0, 3e-5, 2e-5), (False, False)),
        ((1.0, 1e-5, 2e-5), (False, True)),
        ((-1.0, 1e-5, 2e-5), (True, False)),
        ((-1.0, -1e-5, 2e-5), (False, False)),
        ((1.0, 3e-5, 5e-6), (True, True)),
        ((0.0, 3e-5, 2e-5), (True, True)),
        ((0.0, -1e-5, 2e-5), (True, True)),
    ]
    a, lr, d = (torch.tensor(c, dtype=D64) for c in zip(*[r[0] for r in rows]))
    for col, mask in enumerate(("original", "first_order")):
        keep = dppo_keep_mask(a, lr, d, mask=mask, threshold=1e-5)
        assert keep.tolist() == [r[1][col] for r in rows], mask


def test_s4_check4_exact_prediction():
    tau, eta_mu, a = 0.5, 0.05, 1.3
    mu_old = torch.tensor([[0.0, 0.1, -0.2, 0.3]], dtype=D64)
    z = torch.tensor([[0.5, -1.0, 1.5, 0.2]], dtype=D64)
    x_next = mu_old + tau * z
    mu = (mu_old + torch.tensor([[0.01, -0.02, 0.03, 0.0]], dtype=D64)).requires_grad_(True)
    std, adv = torch.tensor([tau], dtype=D64), torch.tensor([a], dtype=D64)
    per_item, m = flow_dppo_loss(mu, mu_old, x_next, std, adv, threshold=1.0)  # mask inactive: loss = −Aρ
    assert abs(m["actor/dppo_div_mean"].item() - 7e-4) < 1e-15
    lr = log_ratio_exact(x_next, mu, mu_old, std)
    assert abs(lr.item() - 0.0343) < 1e-14
    (grad,) = torch.autograd.grad(per_item.sum(), mu)
    mu_new = mu.detach() - eta_mu * grad  # one SGD step on −Aρ
    d_new = (((mu_new - mu_old) ** 2).mean() / (2 * tau ** 2)).item()
    assert abs(d_new - 0.004807319) < 5e-10  # SPEC's 9-digit number
    lam = eta_mu / 4
    f, q = dppo_predictive_terms(adv, lr.detach(), torch.tensor([7e-4], dtype=D64), std,
                                 ((x_next - mu.detach()) ** 2).mean(1))
    assert abs((7e-4 + lam * f + lam ** 2 * q).item() - d_new) < 1e-12
    _, m = flow_dppo_loss(mu.detach(), mu_old, x_next, std, adv, mask="predictive", predictive_lambda=lam)
    assert abs(m["actor/dppo_pred_div_mean"].item() - d_new) < 1e-12
    assert m["actor/dppo_mask_frac"].item() == 1.0  # D̂ > δ and F + λQ > 0: blocked


def _random_dppo(seed, n=4000):
    g = gen(seed)
    a = torch.randn(n, generator=g, dtype=D64)
    a[::50] = 0.0
    lr = 3e-5 * torch.randn(n, generator=g, dtype=D64)
    d = 2e-5 * torch.rand(n, generator=g, dtype=D64)
    std = 0.1 + torch.rand(n, generator=g, dtype=D64)
    res = std ** 2 * (0.5 + torch.rand(n, generator=g, dtype=D64))
    return a, lr, d, std, res


def test_s4_check5_predictive_zero_is_first_order():
    a, lr, d, std, res = _random_dppo(5)
    fo = dppo_keep_mask(a, lr, d, mask="first_order")
    p0 = dppo_keep_mask(a, lr, d, mask="predictive", std=std, residual_sq=res, predictive_lambda=0.0)
    assert torch.equal(fo, p0) and (~fo).any() and fo.any()
    for lam in (1e-4, 1e-3, 1e-2):
        keep = dppo_keep_mask(a, lr, d, mask="predictive", std=std, residual_sq=res, predictive_lambda=lam)
        f, q = dppo_predictive_terms(a, lr, d, std, res)
        assert keep[f + lam * q <= 0].all()  # corrective updates are never blocked
        assert (~keep).any()


def test_s4_check5_loss_level_equivalence():
    # dv_scale large enough that some items exceed δ (with 3e-3 every D < δ and the check was vacuous)
    batch, _, v, coef, _ = make_items(d=8, dv_scale=1e-2, steps=(1, 2, 3, 4, 5, 6, 7, 8))
    mu = step_mean(batch.x_t, v, coef)
    fo, m_fo = flow_dppo_loss(mu, batch.old_mean, batch.x_next, batch.std, batch.advantages, mask="first_order")
    assert 0.0 < m_fo["actor/dppo_mask_frac"].item() < 1.0
    p0, _ = flow_dppo_loss(mu, batch.old_mean, batch.x_next, batch.std, batch.advantages, mask="predictive",
                           predictive_lambda=0.0)
    assert torch.equal(fo, p0)


def test_s4_check6_mean_vs_sum_decisions():
    g = gen(9)
    n, d, delta = 3000, 16, 1e-5
    tau = 0.2 + torch.rand(n, generator=g, dtype=D64)
    mu_old = torch.randn(n, d, generator=g, dtype=D64)
    mu = mu_old + tau[:, None] * 0.01 * torch.randn(n, d, generator=g, dtype=D64)
    x_next = mu_old + tau[:, None] * torch.randn(n, d, generator=g, dtype=D64)
    a = torch.randn(n, generator=g, dtype=D64)
    lr = log_ratio_exact(x_next, mu, mu_old, tau)
    div = ((mu - mu_old) ** 2).mean(1) / (2 * tau ** 2)
    s2 = 2 * tau ** 2
    lr_sum = (((x_next - mu_old) ** 2).sum(1) - ((x_next - mu) ** 2).sum(1)) / s2
    div_sum = ((mu - mu_old) ** 2).sum(1) / s2
    for mask in ("original", "first_order"):
        k_mean = dppo_keep_mask(a, lr, div, mask=mask, threshold=delta)
        k_sum = dppo_keep_mask(a, lr_sum, div_sum, mask=mask, threshold=d * delta)
        assert torch.equal(k_mean, k_sum) and (~k_mean).any() and k_mean.any(), mask


def test_dppo_masked_items_stay_in_denominator():
    mu_old = torch.zeros(2, 4, dtype=D64)
    x_next = torch.tensor([[0.5, -1.0, 1.5, 0.2], [0.1, 0.2, -0.3, 0.4]], dtype=D64)
    mu = torch.tensor([[0.01, -0.02, 0.03, 0.0], [0.0, 0.0, 0.0, 0.0]], dtype=D64)
    std = torch.tensor([0.5, 0.5], dtype=D64)
    batch = StepBatch(advantages=torch.tensor([1.3, 0.7], dtype=D64), x_next=x_next, std=std, old_mean=mu_old,
                      c_v=-0.1 * torch.ones(2, dtype=D64), t=torch.full((2,), 0.8, dtype=D64),
                      t_next=torch.full((2,), 0.7, dtype=D64))
    out = run("flow_dppo", StepQuantities(mean=mu), batch)
    # item 0: D = 7e-4 > δ and A·ℓr > 0 → blocked; item 1 on-policy: −A·1. Loss = (0 − 0.7)/2.
    assert out.metrics["actor/dppo_mask_frac"] == 0.5
    assert math.isclose(out.loss.item(), -0.35, rel_tol=1e-14)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_entries_run_on_exactly_the_declared_fields(name):
    # The engine builds StepBatch with advantages + exactly spec.batch_keys; defaults (KL on for flow_grpo)
    # must work from those fields alone.
    full, v_old, v, coef, _ = make_items(dv_scale=1e-3)
    spec = get_loss_spec(name)
    batch = StepBatch(**{k: getattr(full, k) for k in ("advantages",) + spec.batch_keys})
    cfg = spec.config()
    needs = spec.needs_for(cfg)
    q0 = quantities(full, v, coef, ref_velocity=v_old + 0.01)
    q = StepQuantities(velocity=q0.velocity if needs & StepNeeds.VELOCITY else None,
                       mean=q0.mean if needs & StepNeeds.MEAN else None,
                       log_prob=q0.log_prob if needs & StepNeeds.LOG_PROB else None,
                       ref_velocity=q0.ref_velocity if needs & StepNeeds.REF_VELOCITY else None)
    out = spec.fn(q, batch, cfg)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()
