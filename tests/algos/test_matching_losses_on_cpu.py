"""SPEC §5 (DiffusionNFT) checks 1–3 and §6 (AWM) checks 1–2, time-drawing helpers, registrations."""

import pytest
import torch

from verl_diffusion.algos import matching_losses as ml
from verl_diffusion.algos import path_space as ps
from verl_diffusion.algos.losses import get_loss_spec
from verl_diffusion.algos.types import StateSource, StepBatch, StepNeeds, StepQuantities

F64 = torch.float64


def _data(seed, B=5, shape=(2, 4)):
    g = torch.Generator().manual_seed(seed)
    x0, eps, v_old = (torch.randn(B, *shape, generator=g, dtype=F64) for _ in range(3))
    t = torch.rand(B, generator=g, dtype=F64) * 0.8 + 0.1
    A = 3.0 * torch.randn(B, generator=g, dtype=F64)
    x_t = ml.forward_noise(x0, t, eps)
    return x0, eps, v_old, t, A, x_t, g


# ---------------------------------------------------------------- DiffusionNFT §5
def test_nft_check1_identities_elementwise():
    x0, eps, v_old, t, A, x_t, g = _data(0)
    v_theta = torch.randn(v_old.shape, generator=g, dtype=F64)
    v = eps - x0
    for beta in (1.0, 0.1, 0.7):
        v_pos = beta * v_theta + (1 - beta) * v_old
        v_neg = (1 + beta) * v_old - beta * v_theta
        dv = v_theta - v_old
        torch.testing.assert_close(v_pos - v, beta * dv - (v - v_old))
        torch.testing.assert_close(v_neg - v, -beta * dv - (v - v_old))


def test_nft_check2_expansion_and_gradient_at_zero():
    x0, eps, v_old, t, A, x_t, g = _data(1)
    A = A.clamp(-1, 1)
    v = eps - x0
    d = v[0].numel()
    for beta in (1.0, 0.1):
        v_theta = torch.randn(v_old.shape, generator=g, dtype=F64)
        dv = v_theta - v_old
        lhs = ml.nft_paper_loss(v_theta, v_old, v, A, beta=beta)
        rhs = beta**2 * (ps._mean_e(dv**2) - (2 * A / beta) * ps._mean_e(dv * (v - v_old))) + ps._mean_e((v - v_old) ** 2)
        torch.testing.assert_close(lhs, rhs)
        vt = v_old.clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(ml.nft_paper_loss(vt, v_old, v, A, beta=beta).sum(), vt)
        torch.testing.assert_close(grad, -2 * beta * A[:, None, None] * (v - v_old) / d)
        # descent moves v_θ toward v when A > 0
        pos = A > 0
        new = v_old - 0.1 * grad
        assert torch.all(ps._mean_e((new - v) ** 2)[pos] < ps._mean_e((v_old - v) ** 2)[pos])


@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_nft_check3_reference_gradient_factor(beta):
    x0, eps, v_old, t, A, x_t, g = _data(2)
    A_max = 5.0
    vt = v_old.clone().requires_grad_(True)
    item, metrics = ml.diffusion_nft_loss(vt, v_old, x_t, t, x0, A, beta=beta, adv_clip_max=A_max)
    (g_ref,) = torch.autograd.grad(item.sum(), vt)
    W = torch.clamp(t * ps._mean_e((eps - x0 - v_old).abs()), min=1e-5)
    # W⁺ = W⁻ = W at θ = θ_old
    err = x_t - t[:, None, None] * v_old - x0
    torch.testing.assert_close(ps._mean_e(err.abs()).clamp_min(1e-5), W)
    # NFT preset of §7.7 built with A'
    cfg = ps.PathSpaceConfig(preset="nft", kl_coef=0.0, nft_beta=beta)
    b = StepBatch(advantages=A, x0=x0, noise=eps, t=t)
    vt2 = v_old.clone().requires_grad_(True)
    a1 = ml.nft_advantages(A, adv_clip_max=A_max)
    w1, w2 = ps.preset_weights("nft", advantages=a1, nft_beta=beta)
    item_p = ps.path_space_item_loss(vt2, v_old, ps.compute_value_direction(b, cfg, old_velocity=v_old), w1, w2)
    (g_p,) = torch.autograd.grad(item_p.sum(), vt2)
    factor = A_max * beta * t**2 / W
    torch.testing.assert_close(g_ref, factor[:, None, None] * g_p)


def test_nft_weights_fp64_no_grad_and_adv_modes():
    x0, eps, v_old, t, A, x_t, g = _data(3)
    vt = torch.randn(v_old.shape, generator=g, dtype=torch.float32, requires_grad=True)
    item, m = ml.diffusion_nft_loss(vt, v_old.float(), x_t.float(), t.float(), x0.float(), A.float())
    assert item.dtype == torch.float32 and item.shape == (5,)
    a = torch.tensor([-7.0, -2.5, 0.0, 2.5, 7.0])
    torch.testing.assert_close(ml.nft_advantages(a), torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0]))
    torch.testing.assert_close(ml.nft_advantages(a, mode="positive_only"), torch.tensor([0.0, 0.0, 0.0, 0.5, 1.0]))
    torch.testing.assert_close(ml.nft_advantages(a, mode="negative_only"), torch.tensor([-1.0, -0.5, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(ml.nft_advantages(a, mode="one_only"), torch.tensor([0.0, 0.0, 0.0, 1.0, 1.0]))
    torch.testing.assert_close(ml.nft_advantages(a, mode="binary"), torch.tensor([-1.0, -1.0, 0.0, 1.0, 1.0]))


# ---------------------------------------------------------------- AWM §6
def test_awm_check1_on_policy_ratio_one_and_gradient():
    x0, eps, v_old, t, A, x_t, g = _data(4)
    vt = torch.randn(v_old.shape, generator=g, dtype=F64, requires_grad=True)
    item, metrics = ml.awm_loss(vt, eps, x0, t, A)
    assert metrics["actor/awm_ratio_mean"] == 1.0
    (grad,) = torch.autograd.grad(item.mean(), vt)
    a2 = A.clamp(-5, 5) / 5
    vt2 = vt.detach().clone().requires_grad_(True)
    (expect,) = torch.autograd.grad((a2 * ps._mean_e((vt2 - (eps - x0)) ** 2)).mean(), vt2)
    torch.testing.assert_close(grad, expect)
    # off-policy ratio at θ = θ_old is exactly 1 as well
    _, m2 = ml.awm_loss(vt.detach(), eps, x0, t, A, old_velocity=vt.detach())
    assert m2["actor/awm_ratio_mean"] == 1.0


def test_awm_check2_equals_preset_gradient_independent_of_v_old():
    x0, eps, v_old, t, A, x_t, g = _data(5)
    v_theta = torch.randn(v_old.shape, generator=g, dtype=F64)
    vt = v_theta.clone().requires_grad_(True)
    item, _ = ml.awm_loss(vt, eps, x0, t, A)
    (g_awm,) = torch.autograd.grad(item.sum(), vt)
    cfg = ps.PathSpaceConfig(preset="awm", kl_coef=0.0)
    b = StepBatch(advantages=A, x0=x0, noise=eps, t=t)
    a2 = ps.transform_advantages("awm", A)
    for seed in (0, 1):
        v_o = torch.randn(v_old.shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
        vt2 = v_theta.clone().requires_grad_(True)
        w1, w2 = ps.preset_weights("awm", advantages=a2)
        it = ps.path_space_item_loss(vt2, v_o, ps.compute_value_direction(b, cfg, old_velocity=v_o), w1, w2)
        (g_p,) = torch.autograd.grad(it.sum(), vt2)
        torch.testing.assert_close(g_awm, g_p)


def test_awm_phi_and_clip():
    m = torch.tensor([0.5, 2.0], dtype=F64)
    t = torch.tensor([0.5, 0.25], dtype=F64)
    torch.testing.assert_close(ml.awm_phi(m, t, phi="t"), t * m)
    torch.testing.assert_close(ml.awm_phi(m, t, phi="t2"), t * t * m)
    p = 0.25
    torch.testing.assert_close(ml.awm_phi(m, t, phi="ghuber"), t * ((m + 1e-10) ** p - 1e-10**p) / p)
    # clipped branch: A > 0 and ρ > 1 + ε → zero gradient
    x0, eps, v_old, t5, A, x_t, g = _data(6)
    A = A.abs() + 0.1
    v = eps - x0
    vt = (v + 0.01).clone().requires_grad_(True)
    item, met = ml.awm_loss(vt, eps, x0, t5, A, old_velocity=v + 0.5, clip_range=1e-5)
    (grad,) = torch.autograd.grad(item.sum(), vt)
    assert met["actor/awm_clipfrac"] == 1.0 and torch.all(grad == 0)


# ---------------------------------------------------------------- time drawing
def test_nft_time_indices_random_order_per_sample():
    g = torch.Generator().manual_seed(7)
    idx = ml.draw_nft_time_indices(64, 10, generator=g)
    assert idx.shape == (64, 9)                               # ⌊0.99·10⌋ = 9
    assert all(len(set(r.tolist())) == 9 for r in idx)        # distinct per sample
    assert int(idx.min()) >= 0 and int(idx.max()) <= 9
    assert not torch.all(idx == idx[0])                       # independent orders
    assert ml.draw_nft_time_indices(2, 25, generator=g).shape == (2, 24)


def test_awm_time_indices_stratified():
    g = torch.Generator().manual_seed(8)
    draws = torch.stack([ml.draw_awm_time_indices(14, 4, generator=g) for _ in range(2000)])
    edges = [1, 4, 8, 11, 15]                                  # {1..14} in 4 strata
    for j in range(4):
        col = draws[:, j]
        assert set(col.tolist()) == set(range(edges[j], edges[j + 1]))
    d2 = ml.draw_awm_time_indices(10, 2, fraction=0.6, generator=g)
    assert 1 <= int(d2[0]) <= 3 and 4 <= int(d2[1]) <= 6
    with pytest.raises(ValueError):
        ml.draw_awm_time_indices(4, 5)


# ---------------------------------------------------------------- registrations
def test_registrations_and_defaults():
    nft = get_loss_spec("diffusion_nft")
    assert nft.needs == StepNeeds.VELOCITY | StepNeeds.OLD_VELOCITY_FRESH
    assert nft.batch_keys == ("advantages", "x0", "noise", "t")
    assert nft.state_source == StateSource.FORWARD_NOISING
    c = nft.config()
    assert (c.beta, c.adv_clip_max, c.kl_coef) == (1.0, 5.0, 1e-4)
    assert nft.needs_for(c) & StepNeeds.REF_VELOCITY
    awm = get_loss_spec("awm")
    assert awm.needs == StepNeeds.VELOCITY and awm.state_source == StateSource.FORWARD_NOISING
    c = awm.config()
    assert (c.phi, c.clip_range, c.kl_coef, c.adv_scale) == ("uniform", 1.0, 0.003, 1.0)
    with pytest.raises(ValueError, match="phi"):
        ml.AWMConfig(phi="bogus")


def test_registered_entries_with_kl():
    x0, eps, v_old, t, A, x_t, g = _data(9)
    vt = torch.randn(v_old.shape, generator=g, dtype=F64, requires_grad=True)
    v_ref = torch.randn(v_old.shape, generator=g, dtype=F64)
    b = StepBatch(advantages=A, x0=x0, noise=eps, t=t)
    kl = ps._mean_e((vt - v_ref) ** 2).mean()
    out = get_loss_spec("diffusion_nft").fn(StepQuantities(velocity=vt, old_velocity=v_old, ref_velocity=v_ref), b,
                                            ml.DiffusionNFTConfig())
    item, _ = ml.diffusion_nft_loss(vt, v_old, x_t, t, x0, A)
    torch.testing.assert_close(out.loss, item.mean() + 1e-4 * kl)
    out = get_loss_spec("awm").fn(StepQuantities(velocity=vt, ref_velocity=v_ref), b, ml.AWMConfig())
    item, _ = ml.awm_loss(vt, eps, x0, t, A)
    torch.testing.assert_close(out.loss, item.mean() + 0.003 * kl)


def test_awm_off_policy_reads_the_pre_update_velocity_through_the_engine_glue():
    """SPEC §6 off_policy: needs_for adds OLD_VELOCITY_FRESH; prepare_steps computes v_old with the pre-update
    weights at the fresh state; ρ = exp(ℓ_θ − ℓ_old) is 1 before the update and moves after it."""
    from verl_diffusion.algos import sde
    from verl_diffusion.workers.step_loss import PREP_PREFIX, make_step_loss, prepare_steps, run_step_loss

    on = make_step_loss("awm", {"kl_coef": 0.0})
    off = make_step_loss("awm", {"kl_coef": 0.0, "off_policy": True})
    assert not (on.needs & StepNeeds.OLD_VELOCITY_FRESH)
    assert off.needs & StepNeeds.OLD_VELOCITY_FRESH and off.needs & StepNeeds.VELOCITY
    g = torch.Generator().manual_seed(9)
    B, N = 4, 3
    sig = sde.make_grid(N, 3.0, dtype=torch.float32)
    rows = {"all_latents": torch.randn(B, N + 1, 2, 3, generator=g), "sigmas": sig.expand(B, N + 1).clone(),
            "train_mask": torch.tensor([[0, 1, 0]] * B, dtype=torch.int32),
            "advantages": torch.tensor([1.0, -2.0, 0.5, 3.0])[:, None] * torch.tensor([[0, 1, 0]])}
    w = torch.tensor(0.9, requires_grad=True)
    vfn = lambda x, t, r: w * x  # noqa: E731
    rows.update(prepare_steps(off, rows, velocity_fn=vfn, generator=g))
    x_t = rows[PREP_PREFIX + "x_t"][:, 1]
    torch.testing.assert_close(rows[PREP_PREFIX + "fresh_old_velocity"][:, 1], 0.9 * x_t)
    out, n, q, st = run_step_loss(off, rows, 1, velocity_fn=vfn)
    assert n == 4 and out.metrics["actor/awm_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    with torch.no_grad():
        w.fill_(0.7)                                             # "after an optimizer step"
    out, _, q, st = run_step_loss(off, rows, 1, velocity_fn=vfn)
    x0, eps = rows["all_latents"][:, -1], rows[PREP_PREFIX + "noise"][:, 1]
    item, m = ml.awm_loss(0.7 * x_t, eps, x0, st["t"], st["advantages"], old_velocity=0.9 * x_t)
    torch.testing.assert_close(out.loss, item.mean())
    assert m["actor/awm_ratio_mean"] != pytest.approx(1.0)
    assert out.metrics["actor/awm_ratio_mean"] == pytest.approx(m["actor/awm_ratio_mean"])
    # on-policy ignores v_old: ρ ≡ 1 even after the update
    on_out, _, _, _ = run_step_loss(on, rows, 1, velocity_fn=vfn)
    assert on_out.metrics["actor/awm_ratio_mean"] == 1.0
    with pytest.raises(ValueError, match="OLD_VELOCITY_FRESH"):
        get_loss_spec("awm").fn(StepQuantities(velocity=x_t), StepBatch(advantages=st["advantages"], x0=x0,
                                                                        noise=eps, t=st["t"]), off.cfg)


def test_fresh_old_velocity_forwards_only_the_trained_items():
    """Per-sample step subsets (train_step_fraction): v_old is computed for the rows trained at each step, so the
    no-grad forwards cover exactly the trained items (not every row at every step of the union), with the values a
    whole-batch forward gives there and zeros elsewhere; the loss is unchanged."""
    from verl_diffusion.algos import sde
    from verl_diffusion.trainer.train_masks import subsample_train_steps
    from verl_diffusion.workers.step_loss import PREP_PREFIX, make_step_loss, prepare_steps, run_step_loss

    off = make_step_loss("awm", {"kl_coef": 0.0, "off_policy": True})
    B, N = 8, 5
    g = torch.Generator().manual_seed(3)
    mask = subsample_train_steps(torch.ones(B, N, dtype=torch.int32), 0.4, generator=g)
    union = int(mask.any(dim=0).sum())
    assert int(mask.sum()) == 2 * B and union >= 4
    rows = {"all_latents": torch.randn(B, N + 1, 2, 3, generator=g),
            "sigmas": sde.make_grid(N, 3.0, dtype=torch.float32).expand(B, N + 1).clone(), "train_mask": mask,
            "advantages": torch.randn(B, generator=g)[:, None] * mask, "cond": torch.randn(B, 1, 1, generator=g)}
    seen = []

    def vfn(x, t, r):
        seen.append(x.shape[0])
        return 0.9 * x + r["cond"] * t[:, None, None]

    prep = prepare_steps(off, rows, velocity_fn=vfn, generator=torch.Generator().manual_seed(4))
    assert sum(seen) == int(mask.sum()) == 16 < B * union               # not every row at every step of the union
    x_t, v_old = prep[PREP_PREFIX + "x_t"], prep[PREP_PREFIX + "fresh_old_velocity"]
    t = rows["sigmas"][:, :N]
    whole = 0.9 * x_t + rows["cond"][:, None] * t[:, :, None, None]
    m = mask.bool()
    torch.testing.assert_close(v_old[m], whole[m])
    assert bool((v_old[~m] == 0).all())
    rows.update(prep)
    for k in torch.nonzero(mask.any(dim=0)).flatten().tolist():
        out, n, _, _ = run_step_loss(off, rows, k, velocity_fn=vfn)
        assert n == int(mask[:, k].sum()) and out.metrics["actor/awm_ratio_mean"] == pytest.approx(1.0, abs=1e-6)
