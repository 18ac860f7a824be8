"""SPEC §1 checks 1–7 for the shared SDE kernel (verl_diffusion/algos/sde.py)."""

import math

import pytest
import torch

from verl_diffusion.algos import sde

F64 = torch.float64


def grid64(n=10, shift=3.0):
    return sde.make_grid(n, shift, dtype=F64)


# ---------------------------------------------------------------------------------------------- check 1


def test_grid_n10_shift3_matches_spec_values():
    expected = [1, 0.964286, 0.923077, 0.875, 0.818182, 0.75, 0.666667, 0.5625, 0.428571, 0.25, 0]
    t = sde.make_grid(10, 3.0)
    assert t.dtype == torch.float32 and t.shape == (11,)
    torch.testing.assert_close(t.double(), torch.tensor(expected, dtype=F64), atol=1e-6, rtol=0)
    assert t[0].item() == 1.0 and t[-1].item() == 0.0


def test_grid_shift1_is_uniform_and_bad_args_raise():
    torch.testing.assert_close(sde.make_grid(4, 1.0, dtype=F64), torch.tensor([1, 0.75, 0.5, 0.25, 0], dtype=F64))
    with pytest.raises(ValueError, match="num_steps=0"):
        sde.make_grid(0)
    with pytest.raises(ValueError, match="shift=-1"):
        sde.make_grid(10, -1.0)


# ---------------------------------------------------------------------------------------------- check 2


@pytest.mark.parametrize(
    "k, c_x, c_v, std",
    [(0, 0.755, -0.0357143, 0.7), (5, 0.918333, -0.10375, 0.35), (9, None, -0.31125, 0.202073)],
)
def test_flow_sde_coefficients_match_spec(k, c_x, c_v, std):
    coef = sde.sampler_coefficients("flow_sde", grid64(), k, noise_level=0.7)
    if c_x is not None:
        assert coef.c_x.item() == pytest.approx(c_x, abs=1e-6)
    assert coef.c_v.item() == pytest.approx(c_v, abs=1e-6)
    assert coef.std.item() == pytest.approx(std, abs=1e-6)


def test_flow_sde_k0_exact_and_k5_cv_is_minus_1p245_dt():
    s = grid64()
    c0 = sde.sampler_coefficients("flow_sde", s, 0, noise_level=0.7)
    assert c0.std.item() == pytest.approx(0.7, abs=1e-12)
    assert c0.c_x.item() == pytest.approx(1 - 0.49 / 2, abs=1e-12)
    assert c0.c_v.item() == pytest.approx((s[1] - s[0]).item(), abs=1e-15)
    c5 = sde.sampler_coefficients("flow_sde", s, 5, noise_level=0.7)
    assert c5.c_v.item() == pytest.approx(-1.245 * (s[5] - s[6]).item(), abs=1e-12)


def test_sampler_coefficients_shapes_dtype_and_per_sample_steps():
    s32 = sde.make_grid(10)
    coef = sde.sampler_coefficients("flow_sde", s32, 5, noise_level=0.7)
    assert coef.c_x.dtype == torch.float32 and coef.c_x.dim() == 0
    batch = s32.expand(3, 11)
    steps = torch.tensor([0, 5, 9])
    for sig in (s32, batch):
        c = sde.sampler_coefficients("flow_sde", sig, steps, noise_level=0.7)
        assert c.c_v.shape == (3,) and c.c_v.dtype == torch.float32
        torch.testing.assert_close(c.std.double(), torch.tensor([0.7, 0.35, 0.202073], dtype=F64), atol=1e-6, rtol=0)
    cb = sde.sampler_coefficients("cps", batch, 5, noise_level=0.8)
    assert cb.std.shape == (3,)


def test_unknown_sampler_and_bad_knobs_raise_teaching_errors():
    s = grid64()
    with pytest.raises(ValueError, match=r"sampler='ddim'.*'cps'.*'dance'.*'flow_sde'.*'ode'"):
        sde.sampler_coefficients("ddim", s, 0, noise_level=0.7)
    with pytest.raises(ValueError, match="step=10"):
        sde.sampler_coefficients("flow_sde", s, 10, noise_level=0.7)
    with pytest.raises(ValueError, match="noise_level=1.5"):
        sde.sampler_coefficients("cps", s, 0, noise_level=1.5)
    with pytest.raises(ValueError, match="noise_level=-0.1"):
        sde.sampler_coefficients("flow_sde", s, 0, noise_level=-0.1)
    with pytest.raises(ValueError, match="convention='sum'"):
        sde.gaussian_log_prob(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), convention="sum")


def test_ode_coefficients():
    s = grid64()
    c = sde.sampler_coefficients("ode", s, 3, noise_level=0.0)
    assert c.c_x.item() == 1.0 and c.std.item() == 0.0
    assert c.c_v.item() == (s[4] - s[3]).item()


# ---------------------------------------------------------------------------------------------- check 3


def _xv(b=2, shape=(3, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, *shape, generator=g, dtype=F64), torch.randn(b, *shape, generator=g, dtype=F64)


@pytest.mark.parametrize("sampler", ["flow_sde", "dance", "cps"])
def test_zero_noise_is_euler_and_log_prob_refused(sampler):
    s = grid64()
    x, v = _xv()
    for k in range(1 if sampler != "flow_sde" else 0, 10):
        coef = sde.sampler_coefficients(sampler, s, k, noise_level=0.0)
        euler = x + v * (s[k + 1] - s[k])
        if sampler == "cps":
            torch.testing.assert_close(sde.step_mean(x, v, coef), euler, atol=1e-15, rtol=0)
        else:  # c_x = 1 and c_v = dt exactly, so the mean is bitwise Euler
            assert torch.equal(sde.step_mean(x, v, coef), euler)
        assert torch.all(coef.std == 0)
        with pytest.raises(ValueError, match="no log-prob"):
            sde.gaussian_log_prob(euler, euler, coef.std)
        out = sde.sde_step(x, v, coef)
        assert out.log_prob is None
        torch.testing.assert_close(out.next_x, euler, atol=1e-15, rtol=0)


def test_ode_step_and_cps_last_step_refused():
    s = grid64()
    x, v = _xv()
    out = sde.ode_step(x, v, s[2], s[3])
    assert torch.equal(out.next_x, x + (s[3] - s[2]) * v) and out.log_prob is None and out.noise is None
    last = sde.sampler_coefficients("cps", s, 9, noise_level=0.8)
    assert last.std.item() == 0.0
    with pytest.raises(ValueError, match="last CPS step"):
        sde.gaussian_log_prob(x, x, last.std)


# ---------------------------------------------------------------------------------------------- check 4


@pytest.mark.parametrize("k", [1, 4, 9])
def test_dance_with_eta_equal_g_reproduces_flow_sde(k):
    s = grid64()
    a = 0.7
    t = s[k].item()
    g_k = a * math.sqrt(t / (1 - t))
    fs = sde.sampler_coefficients("flow_sde", s, k, noise_level=a)
    dn = sde.sampler_coefficients("dance", s, k, noise_level=g_k)
    x, v = _xv()
    torch.testing.assert_close(sde.step_mean(x, v, dn), sde.step_mean(x, v, fs), atol=1e-14, rtol=0)
    torch.testing.assert_close(dn.std, fs.std, atol=1e-14, rtol=0)


# ---------------------------------------------------------------------------------------------- check 5


def test_cps_k5_values_and_coefficient_preservation():
    s = grid64()
    a = 0.8
    coef = sde.sampler_coefficients("cps", s, 5, noise_level=a)
    assert coef.std.item() == pytest.approx(0.634038, abs=1e-6)
    assert coef.c_v.item() == pytest.approx(-0.198497, abs=1e-6)
    t, tn = s[5].item(), s[6].item()
    r = tn * math.cos(a * math.pi / 2)
    assert r * r + coef.std.item() ** 2 == pytest.approx(tn * tn, abs=1e-15)
    g = torch.Generator().manual_seed(1)
    x0, eps, z = (torch.randn(2, 8, generator=g, dtype=F64) for _ in range(3))
    x = (1 - t) * x0 + t * eps
    v = eps - x0
    out = sde.sde_step(x, v, coef, noise=z)
    eps_new = (r * eps + coef.std.item() * z) / tn
    torch.testing.assert_close(out.next_x, (1 - tn) * x0 + tn * eps_new, atol=1e-14, rtol=0)


# ---------------------------------------------------------------------------------------------- check 6


@pytest.mark.parametrize("sampler, a", [("flow_sde", 0.7), ("cps", 0.8), ("dance", 0.3)])
def test_samples_match_mean_std_and_log_density(sampler, a):
    m, d = 100_000, 4
    s = grid64()
    coef = sde.sampler_coefficients(sampler, s, 5, noise_level=a)
    x1, v1 = _xv(b=1, shape=(d,), seed=3)
    x, v = x1.expand(m, d), v1.expand(m, d)
    out = sde.sde_step(x, v, coef, generator=torch.Generator().manual_seed(4))
    tau = coef.std.item()
    mu = sde.step_mean(x1, v1, coef)[0]
    emp_mean, emp_std = out.next_x.mean(0), out.next_x.std(0)
    assert torch.all((emp_mean - mu).abs() < 5 * tau / math.sqrt(m))
    assert torch.all((emp_std - tau).abs() < 5 * tau / math.sqrt(2 * m))
    ref = torch.distributions.Normal(out.mean, tau).log_prob(out.next_x).mean(1)
    torch.testing.assert_close(out.log_prob, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(sde.gaussian_log_prob(out.next_x, out.mean, out.std), ref, atol=1e-12, rtol=0)


def test_unnormalized_convention_and_ratio_relation():
    s = grid64()
    coef = sde.sampler_coefficients("cps", s, 2, noise_level=0.8)
    x, v = _xv()
    dv = 0.1 * _xv(seed=9)[0]
    out = sde.sde_step(x, v, coef, generator=torch.Generator().manual_seed(0), convention="unnormalized")
    assert torch.equal(out.log_prob, -((out.next_x - out.mean) ** 2).flatten(1).mean(1))
    mean_new = sde.step_mean(x, v + dv, coef)
    lr_u = sde.gaussian_log_prob(out.next_x, mean_new, coef.std, convention="unnormalized") - out.log_prob
    lr = sde.log_ratio_exact(out.next_x, mean_new, out.mean, coef.std)
    torch.testing.assert_close(lr_u, 2 * coef.std**2 * lr, atol=1e-13, rtol=0)


def test_on_policy_log_ratio_is_exactly_zero_fp64():
    s = grid64()
    for sampler, a in (("flow_sde", 0.7), ("cps", 0.8), ("dance", 0.3)):
        for k in (0, 4, 8):
            coef = sde.sampler_coefficients(sampler, s.expand(2, 11), k, noise_level=a)
            x, v = _xv(seed=k)
            out = sde.sde_step(x, v, coef, generator=torch.Generator().manual_seed(k))
            # training recomputes from stored x, x', v_old and the stored coefficients
            coef2 = sde.sampler_coefficients(sampler, s.expand(2, 11), torch.tensor([k, k]), noise_level=a)
            lp = sde.gaussian_log_prob(out.next_x, sde.step_mean(x, v, coef2), coef2.std)
            assert torch.equal(lp - out.log_prob, torch.zeros(2, dtype=F64))
            assert torch.equal(sde.log_ratio_exact(out.next_x, out.mean, out.mean, coef.std), torch.zeros(2, dtype=F64))


def test_mixed_std_batch_masks_zero_entries():
    coef = sde.StepCoefficients(torch.ones(2, dtype=F64), torch.full((2,), -0.1, dtype=F64),
                                torch.tensor([0.5, 0.0], dtype=F64))
    x, v = _xv()
    out = sde.sde_step(x, v, coef, generator=torch.Generator().manual_seed(0))
    assert out.log_prob[1].item() == 0.0
    ref = sde.gaussian_log_prob(out.next_x[:1], out.mean[:1], coef.std[:1])
    assert torch.equal(out.log_prob[:1], ref)


def test_named_step_wrappers_match_sde_step():
    s = grid64()
    x, v = _xv()
    z = _xv(seed=5)[0]
    t, tn = s[3].expand(2), s[4].expand(2)
    pairs = [
        (sde.flow_sde_step(x, v, t, tn, noise_level=0.7, t_sub=s[1], noise=z),
         sde.sampler_coefficients("flow_sde", s, 3, noise_level=0.7)),
        (sde.cps_step(x, v, t, tn, noise_level=0.8, noise=z), sde.sampler_coefficients("cps", s, 3, noise_level=0.8)),
        (sde.dance_step(x, v, t, tn, noise_level=0.3, noise=z), sde.sampler_coefficients("dance", s, 3, noise_level=0.3)),
    ]
    for out, coef in pairs:
        ref = sde.sde_step(x, v, coef, noise=z)
        assert torch.equal(out.next_x, ref.next_x) and torch.equal(out.log_prob, ref.log_prob)


def test_generator_reproducible_and_bf16_log_prob_is_fp32():
    s = sde.make_grid(10)
    coef = sde.sampler_coefficients("flow_sde", s, 2, noise_level=0.7)
    x, v = (u.to(torch.bfloat16) for u in _xv())
    o1 = sde.sde_step(x, v, coef, generator=torch.Generator().manual_seed(7))
    o2 = sde.sde_step(x, v, coef, generator=torch.Generator().manual_seed(7))
    assert torch.equal(o1.next_x, o2.next_x) and torch.equal(o1.log_prob, o2.log_prob)
    assert o1.log_prob.dtype == torch.float32 and o1.log_prob.shape == (2,)


# ---------------------------------------------------------------------------------------------- check 7


@pytest.mark.parametrize("sampler, a, k", [("flow_sde", 0.7, 5), ("cps", 0.8, 3), ("flow_sde", 0.7, 0)])
def test_monte_carlo_kl_and_log_ratio_variance(sampler, a, k):
    m, d = 20_000, 16
    s = grid64()
    coef = sde.sampler_coefficients(sampler, s, k, noise_level=a)
    x1, v1 = _xv(b=1, shape=(d,), seed=11)
    dv1 = torch.randn(1, d, generator=torch.Generator().manual_seed(12), dtype=F64)
    # scale Δv so that D = 0.02
    d_target = 0.02
    dv1 = dv1 * math.sqrt(d_target * 2 * coef.std.item() ** 2 / (coef.c_v.item() ** 2 * (dv1**2).mean().item()))
    x, v_old, v_new = x1.expand(m, d), v1.expand(m, d), (v1 + dv1).expand(m, d)
    out = sde.sde_step(x, v_old, coef, generator=torch.Generator().manual_seed(13))
    mean_new = sde.step_mean(x, v_new, coef)
    kl = sde.gaussian_step_kl(mean_new, out.mean, coef.std)
    assert kl[0].item() == pytest.approx(d_target, rel=1e-12)
    assert torch.allclose(kl, kl[0].expand(m))
    lr = sde.gaussian_log_prob(out.next_x, mean_new, coef.std) - out.log_prob
    D = d_target
    assert abs((-lr).mean().item() - D) < 5 * math.sqrt(2 * D / (d * m))
    assert lr.var().item() == pytest.approx(2 * D / d, rel=0.05)
    torch.testing.assert_close(sde.log_ratio_exact(out.next_x, mean_new, out.mean, coef.std), lr, atol=1e-12, rtol=0)
    # analytic form ℓr = (c_v/τ)·⟨Δv, z⟩_e − D
    analytic = coef.c_v / coef.std * (dv1 * out.noise).mean(1) - D
    torch.testing.assert_close(lr, analytic, atol=1e-12, rtol=0)


def test_total_variation_monitor():
    kl = torch.tensor([0.0, 1e-5, 1.0], dtype=F64)
    tv = sde.total_variation(kl, 65536)
    expected = [2 * 0.5 * (1 + math.erf(math.sqrt(65536 * D / 2) / math.sqrt(2))) - 1 for D in kl.tolist()]
    torch.testing.assert_close(tv, torch.tensor(expected, dtype=F64), atol=1e-12, rtol=0)
    assert tv[1].item() == pytest.approx(0.432972, abs=1e-6)


def test_step_mean_is_at_least_fp32_for_shared_step_coefficients():
    # SPEC §0.5: means are computed in fp32 or better. A shared step (1-D grid, int k) gives 0-dim
    # coefficients, which must not let bf16 latents/velocities pull the mean down to bf16; the mean must
    # equal the per-sample-coefficient mean bitwise (rollout and training may use either form).
    s = sde.make_grid(10)
    x, v = (u.to(torch.bfloat16) for u in _xv())
    shared = sde.sampler_coefficients("flow_sde", s, 2, noise_level=0.7)
    per_sample = sde.sampler_coefficients("flow_sde", s.expand(2, 11), 2, noise_level=0.7)
    assert shared.c_x.dim() == 0 and per_sample.c_x.shape == (2,)
    m_shared, m_per = sde.step_mean(x, v, shared), sde.step_mean(x, v, per_sample)
    assert m_shared.dtype == torch.float32 and m_per.dtype == torch.float32
    assert torch.equal(m_shared, m_per)
    ref = shared.c_x.item() * x.double() + shared.c_v.item() * v.double()
    torch.testing.assert_close(m_shared.double(), ref, atol=1e-6, rtol=0)
    out = sde.sde_step(x, v, shared, generator=torch.Generator().manual_seed(0))
    assert out.mean.dtype == torch.float32


@pytest.mark.parametrize("t_next", [0.9, 0.8, 0.96, 0.7531])
def test_python_float_times_go_straight_to_fp64(t_next):
    """Issue 12 item 13: a Python-float t_sub (or t, t_next) is not rounded through float32 first. At t = 1 with
    t_sub = t_next, 1 − t_sub = Δt, so the Flow-SDE std is a·√(Δt/Δt) = a (SPEC §1.3)."""
    t64 = torch.tensor([1.0], dtype=torch.float64)
    tn64 = torch.tensor([t_next], dtype=torch.float64)
    mixed = sde.flow_sde_coefficients(t64, tn64, noise_level=0.7, t_sub=t_next)
    tensor = sde.flow_sde_coefficients(t64, tn64, noise_level=0.7, t_sub=tn64)
    assert mixed.std.dtype == torch.float64
    assert torch.equal(mixed.std, tensor.std) and torch.equal(mixed.c_x, tensor.c_x)
    assert abs(mixed.std.item() - 0.7) < 4e-16
    # Every named step function with Python-float times equals its tensor path: fp64 math, then the
    # coefficients in float32 (the dtype for Python-float times).
    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    v = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    z = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    t, tn = 1.0, t_next
    T, TN = torch.full((3,), t, dtype=torch.float64), torch.full((3,), tn, dtype=torch.float64)
    cases = [
        (sde.flow_sde_step, sde.flow_sde_coefficients, dict(noise_level=0.7, t_sub=t_next), dict(noise_level=0.7, t_sub=TN)),
        (sde.cps_step, sde.cps_coefficients, dict(noise_level=0.5), dict(noise_level=0.5)),
        (sde.dance_step, sde.dance_coefficients, dict(noise_level=0.3), dict(noise_level=0.3)),
    ]
    for step_fn, coef_fn, float_kw, tensor_kw in cases:
        ref = coef_fn(T, TN, **tensor_kw)
        ref32 = sde.StepCoefficients(*(c.to(torch.float32) for c in (ref.c_x, ref.c_v, ref.std)))
        a = step_fn(x, v, t, tn, noise=z, **float_kw)
        b = sde.sde_step(x, v, ref32, noise=z)
        for field in ("std", "mean", "next_x", "log_prob"):
            assert torch.equal(getattr(a, field), getattr(b, field)), (step_fn.__name__, field)
    assert sde.flow_sde_step(x, v, 1.0, t_next, noise_level=0.7, t_sub=t_next, noise=z).std[0].item() == \
        torch.tensor(0.7, dtype=torch.float32).item()
    a = sde.ode_step(x, v, t, tn)
    assert torch.equal(a.mean, x + v * torch.tensor(tn - t, dtype=torch.float64).to(torch.float32))
