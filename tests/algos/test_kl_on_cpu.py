"""KL-to-reference modes (SPEC §1.7, §7.6): verl_diffusion/algos/kl.py."""

import math

import pytest
import torch

from verl_diffusion.algos import sde
from verl_diffusion.algos.kl import KL_MODES, reference_kl

F64 = torch.float64


def _vels(b=3, d=(2, 3, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(b, *d, generator=g, dtype=F64)
    return v, v + 0.1 * torch.randn(b, *d, generator=g, dtype=F64)


def test_hand_computed_tiny_case():
    v = torch.tensor([[1.0, 2.0]], dtype=F64)
    ref = torch.zeros(1, 2, dtype=F64)
    assert reference_kl("v_space", velocity=v, ref_velocity=ref).item() == pytest.approx(2.5)
    kw = dict(velocity=v, ref_velocity=ref, c_v=torch.tensor([-0.1], dtype=F64), std=torch.tensor([0.5], dtype=F64))
    assert reference_kl("exact", **kw).item() == pytest.approx(0.01 * 2.5 / 0.5)
    assert reference_kl("gaussian_step", **kw).item() == pytest.approx(0.05)
    assert reference_kl("flow_grpo_legacy", dt=torch.tensor([-0.2], dtype=F64), **kw).item() == pytest.approx(0.01)
    # girsanov: a = 1 -> η = 0.5; t = 0.5: w̃ = 2.25·0.5/(4·0.5·0.5) = 1.125; × Δt 0.2 × 2.5
    g = reference_kl("girsanov", velocity=v, ref_velocity=ref, t=torch.tensor([0.5], dtype=F64),
                     dt=torch.tensor([-0.2], dtype=F64), noise_level=1.0)
    assert g.item() == pytest.approx(1.125 * 0.2 * 2.5)


@pytest.mark.parametrize("k", [0, 3, 9])
def test_exact_equals_gaussian_step_kl_of_means(k):
    s = sde.make_grid(10, dtype=F64)
    coef = sde.sampler_coefficients("flow_sde", s.expand(3, 11), k, noise_level=0.7)
    v, ref = _vels()
    x = torch.randn(3, 2, 3, 4, generator=torch.Generator().manual_seed(1), dtype=F64)
    expected = sde.gaussian_step_kl(sde.step_mean(x, v, coef), sde.step_mean(x, ref, coef), coef.std)
    got = reference_kl("exact", velocity=v, ref_velocity=ref, c_v=coef.c_v, std=coef.std)
    torch.testing.assert_close(got, expected, atol=1e-14, rtol=1e-12)
    assert got.shape == (3,)


@pytest.mark.parametrize("k", [0, 4, 9])
def test_legacy_is_exact_times_dt_for_flow_sde(k):
    s = sde.make_grid(10, dtype=F64)
    coef = sde.sampler_coefficients("flow_sde", s, k, noise_level=0.7)
    v, ref = _vels()
    dt = s[k + 1] - s[k]
    exact = reference_kl("exact", velocity=v, ref_velocity=ref, c_v=coef.c_v, std=coef.std)
    legacy = reference_kl("flow_grpo_legacy", velocity=v, ref_velocity=ref, c_v=coef.c_v, std=coef.std, dt=dt)
    torch.testing.assert_close(legacy, exact * (-dt), atol=1e-15, rtol=1e-12)
    # equivalently: divide by 2g² instead of 2τ²
    t = s[k].item()
    t_tilde = t if t < 1 else s[1].item()
    g2 = 0.49 * t / (1 - t_tilde)
    sq = ((v - ref) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(legacy, coef.c_v**2 * sq / (2 * g2), atol=1e-15, rtol=1e-10)


def test_legacy_equals_exact_for_cps():
    s = sde.make_grid(10, dtype=F64)
    coef = sde.sampler_coefficients("cps", s, 5, noise_level=0.8)
    v, ref = _vels()
    kw = dict(velocity=v, ref_velocity=ref, c_v=coef.c_v, std=coef.std)
    assert torch.equal(reference_kl("flow_grpo_legacy", sampler="cps", **kw), reference_kl("exact", **kw))


@pytest.mark.parametrize("k", [1, 3, 6, 9])
@pytest.mark.parametrize("a", [0.7, 0.1, math.sqrt(2)])
def test_girsanov_equals_gaussian_step_for_flow_sde_k_ge_1(k, a):
    s = sde.make_grid(10, dtype=F64)
    coef = sde.sampler_coefficients("flow_sde", s, k, noise_level=a)
    v, ref = _vels()
    gs = reference_kl("gaussian_step", velocity=v, ref_velocity=ref, c_v=coef.c_v, std=coef.std)
    gi = reference_kl("girsanov", velocity=v, ref_velocity=ref, t=s[k].expand(3), dt=(s[k + 1] - s[k]).expand(3),
                      noise_level=a)
    torch.testing.assert_close(gi, gs, atol=1e-15, rtol=1e-12)


def test_girsanov_differs_at_k0_because_of_sigma1_substitution():
    s = sde.make_grid(10, dtype=F64)
    coef = sde.sampler_coefficients("flow_sde", s, 0, noise_level=0.7)
    v, ref = _vels()
    gs = reference_kl("gaussian_step", velocity=v, ref_velocity=ref, c_v=coef.c_v, std=coef.std)
    gi = reference_kl("girsanov", velocity=v, ref_velocity=ref, t=s[0], dt=s[1] - s[0], noise_level=0.7)
    assert torch.all(gi == 0) and torch.all(gs > 0)  # w̃(1) = 0


def test_v_space_gradient_is_2dv_over_d():
    v, ref = _vels(b=2, d=(5,))
    v = v.clone().requires_grad_(True)
    reference_kl("v_space", velocity=v, ref_velocity=ref).sum().backward()
    torch.testing.assert_close(v.grad, 2 * (v - ref).detach() / 5, atol=1e-15, rtol=0)


def test_bf16_velocities_give_fp32_kl():
    v, ref = (u.to(torch.bfloat16) for u in _vels())
    out = reference_kl("v_space", velocity=v, ref_velocity=ref)
    assert out.dtype == torch.float32 and out.shape == (3,)


def test_missing_arguments_and_bad_modes_raise_one_clear_error():
    v, ref = _vels()
    with pytest.raises(ValueError, match=r"mode='exact'.*needs \['c_v', 'std'\].*\['std'\]"):
        reference_kl("exact", velocity=v, ref_velocity=ref, c_v=torch.ones(3))
    with pytest.raises(ValueError, match=r"needs \['c_v', 'std', 'dt'\].*\['dt'\]"):
        reference_kl("flow_grpo_legacy", velocity=v, ref_velocity=ref, c_v=torch.ones(3), std=torch.ones(3))
    with pytest.raises(ValueError, match=r"\['t', 'dt', 'noise_level'\]"):
        reference_kl("girsanov", velocity=v, ref_velocity=ref, t=torch.ones(3))
    with pytest.raises(ValueError, match=r"kl_mode='k3'.*'exact'"):
        reference_kl("k3", velocity=v, ref_velocity=ref)
    with pytest.raises(ValueError, match="std has entries <= 0"):
        reference_kl("exact", velocity=v, ref_velocity=ref, c_v=torch.ones(3), std=torch.zeros(3))
    with pytest.raises(ValueError, match="noise_level=0.0"):
        reference_kl("girsanov", velocity=v, ref_velocity=ref, t=torch.ones(3), dt=torch.ones(3), noise_level=0.0)
    assert KL_MODES == ("exact", "flow_grpo_legacy", "v_space", "girsanov", "gaussian_step")
