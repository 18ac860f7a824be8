"""workers/step_loss.py: only the declared quantities are computed; items follow train_mask; errors teach."""

from dataclasses import dataclass

import pytest
import torch

from verl_diffusion.algos.losses import LossSpec
from verl_diffusion.algos.sde import StepCoefficients, gaussian_log_prob, sampler_coefficients, step_mean
from verl_diffusion.algos.types import LossOutput, StepNeeds
from verl_diffusion.workers.step_loss import (DiffusionStepLoss, build_step_batch, make_step_loss, run_step_loss,
                                              step_tensors, trained_steps)


@dataclass(frozen=True)
class _Cfg:
    kl_coef: float = 0.0


def _rows(B=4, N=3, mask=None):
    g = torch.Generator().manual_seed(0)
    sig = torch.tensor([1.0, 0.75, 0.4, 0.0]).expand(B, N + 1).contiguous()
    cx, cv, sd = (torch.zeros(B, N) for _ in range(3))
    for k in range(N - 1):
        c = sampler_coefficients("flow_sde", sig, k, noise_level=0.7)
        cx[:, k], cv[:, k], sd[:, k] = c.c_x, c.c_v, c.std
    cx[:, -1], cv[:, -1] = 1.0, -0.4
    return {"all_latents": torch.randn(B, N + 1, 2, 4, 4, generator=g), "sigmas": sig,
            "train_mask": mask if mask is not None else torch.tensor([[1, 1, 0]] * B, dtype=torch.int32),
            "sde_cx": cx, "sde_cv": cv, "sde_std": sd, "rollout_log_probs": torch.randn(B, N, generator=g),
            "advantages": torch.randn(B, 1, generator=g).expand(B, N).contiguous()}


def _spy_loss(needs, keys=("advantages", "old_log_prob"), kl=0.0):
    seen = {}

    def fn(q, b, cfg):
        seen["q"], seen["b"] = q, b
        return LossOutput(-(b.advantages * torch.exp(q.log_prob - b.old_log_prob)).mean() if q.log_prob is not None
                          else (q.velocity ** 2).mean(), {})

    return DiffusionStepLoss(LossSpec("spy", fn, needs, keys, _Cfg), _Cfg(kl)), seen


def _velocity(calls):
    def v(x, t, rows):
        calls.append(x.shape[0])
        return 0.5 * x * t.view(-1, 1, 1, 1)
    return v


def test_log_prob_is_the_kernel_on_stored_coefficients():
    rows = _rows()
    loss, seen = _spy_loss(StepNeeds.VELOCITY | StepNeeds.MEAN | StepNeeds.LOG_PROB)
    calls = []
    out, n, q, st = run_step_loss(loss, rows, 0, velocity_fn=_velocity(calls))
    x = rows["all_latents"][:, 0]
    v = 0.5 * x * rows["sigmas"][:, 0].view(-1, 1, 1, 1)
    coef = StepCoefficients(rows["sde_cx"][:, 0], rows["sde_cv"][:, 0], rows["sde_std"][:, 0])
    ref = gaussian_log_prob(rows["all_latents"][:, 1], step_mean(x, v, coef), coef.std)
    assert torch.equal(q.log_prob, ref) and n == 4 and calls == [4]
    # only the declared batch fields are filled
    assert seen["b"].x_t is None and seen["b"].old_mean is None
    assert torch.equal(seen["b"].old_log_prob, rows["rollout_log_probs"][:, 0])


def test_velocity_only_loss_gets_no_log_prob():
    loss, seen = _spy_loss(StepNeeds.VELOCITY, keys=("advantages",))
    run_step_loss(loss, _rows(), 0, velocity_fn=_velocity([]))
    assert seen["q"].velocity is not None and seen["q"].mean is None and seen["q"].log_prob is None


def test_only_rows_trained_at_k_are_forwarded():
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.int32)
    loss, seen = _spy_loss(StepNeeds.VELOCITY | StepNeeds.MEAN | StepNeeds.LOG_PROB)
    calls = []
    out, n, q, _ = run_step_loss(loss, _rows(mask=mask), 0, velocity_fn=_velocity(calls))
    assert n == 3 and calls == [3] and seen["b"].advantages.shape == (3,) and seen["q"].log_prob.shape == (3,)
    assert trained_steps(mask) == [0]
    calls = []
    none, n0, _, _ = run_step_loss(loss, _rows(mask=mask), 1, velocity_fn=_velocity(calls))
    assert none is None and n0 == 0 and calls == []          # nobody trained at k: no forward at all


def test_all_rows_trained_forward_the_whole_micro_batch_unchanged():
    """Ordinary rollouts (every row trained at each window step): the same single forward of all rows as before."""
    rows = _rows()
    loss, _ = _spy_loss(StepNeeds.VELOCITY | StepNeeds.MEAN | StepNeeds.LOG_PROB)
    seen_x = []

    def vel(x, t, r):
        seen_x.append(x)
        return 0.5 * x * t.view(-1, 1, 1, 1)

    out, n, q, st = run_step_loss(loss, rows, 0, velocity_fn=vel)
    assert n == 4 and len(seen_x) == 1 and seen_x[0].data_ptr() == rows["all_latents"][:, 0].data_ptr()


def test_mixed_branch_steps_in_one_micro_batch():
    """A branched TempFlow micro-batch: rows whose only stochastic step is 0 or 1 (τ = 0 elsewhere). Each step
    forwards only its rows; the log-probs equal those of the rows alone; Σ n·loss / total = mean over items."""
    from verl_diffusion.algos.ratio_losses import tempflow_grpo_loss

    B, N = 4, 3
    rows = _rows(B, N)
    branch = torch.tensor([0, 0, 1, 1])
    mask = torch.zeros(B, N, dtype=torch.int32)
    mask[torch.arange(B), branch] = 1
    ode = torch.tensor([1.0, 0.75, 0.4, 0.0])
    for key in ("sde_cx", "sde_cv", "sde_std"):
        rows[key] = rows[key].clone()
    off = mask == 0
    rows["sde_cx"][off] = 1.0
    rows["sde_cv"][off] = (ode[1:] - ode[:-1]).expand(B, N)[off]
    rows["sde_std"][off] = 0.0
    rows["train_mask"] = mask
    rows["step_advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5]).unsqueeze(1) * mask
    loss = make_step_loss("tempflow_grpo", {"scale": 2.25, "kl_coef": 0.0, "clip_range": 1e-4})
    vel = lambda x, t, r: 0.5 * x * t.view(-1, 1, 1, 1)  # noqa: E731
    # the old behaviour (forward all rows at k) raises on the τ = 0 rows
    from verl_diffusion.workers.step_loss import compute_step_quantities
    with pytest.raises(ValueError):
        compute_step_quantities(loss, step_tensors(rows, 0), velocity_fn=vel, rows=rows)
    total, items = 0.0, 0
    for k in trained_steps(mask):
        calls = []
        out, n, q, st = run_step_loss(loss, rows, k, velocity_fn=lambda x, t, r: (calls.append(x.shape[0]), vel(x, t, r))[1])
        sel = (branch == k).nonzero().flatten()
        assert n == 2 and calls == [2] and torch.isfinite(out.loss)
        x = rows["all_latents"][sel, k]
        coef = StepCoefficients(rows["sde_cx"][sel, k], rows["sde_cv"][sel, k], rows["sde_std"][sel, k])
        ref_lp = gaussian_log_prob(rows["all_latents"][sel, k + 1],
                                   step_mean(x, vel(x, rows["sigmas"][sel, k], None), coef), coef.std)
        assert torch.equal(q.log_prob, ref_lp)
        ref, _ = tempflow_grpo_loss(ref_lp, rows["rollout_log_probs"][sel, k], rows["step_advantages"][sel, k],
                                    coef.std, scale=2.25, clip_range=1e-4)
        torch.testing.assert_close(out.loss, ref.mean())
        total, items = total + float(out.loss) * n, items + n
    assert items == int(mask.sum())


def test_reference_is_required_when_kl_is_on():
    loss, _ = _spy_loss(StepNeeds.VELOCITY, keys=("advantages",), kl=0.1)
    assert loss.needs_reference()
    with pytest.raises(ValueError, match="REF_VELOCITY"):
        run_step_loss(loss, _rows(), 0, velocity_fn=_velocity([]))
    calls = []
    run_step_loss(loss, _rows(), 0, velocity_fn=_velocity([]), ref_velocity_fn=_velocity(calls))
    assert calls == [4]


def test_old_mean_from_old_velocities():
    rows = _rows()
    rows["old_velocities"] = torch.randn(4, 3, 2, 4, 4)
    st = step_tensors(rows, 0)
    ref = rows["sde_cx"][:, 0].view(-1, 1, 1, 1) * rows["all_latents"][:, 0] + \
        rows["sde_cv"][:, 0].view(-1, 1, 1, 1) * rows["old_velocities"][:, 0]
    assert torch.allclose(st["old_mean"], ref)


def test_make_step_loss_names_unknown_knobs_and_losses():
    with pytest.raises(ValueError, match="loss_mode"):
        make_step_loss("no_such_loss")
    with pytest.raises(ValueError, match="clip_rnage"):
        make_step_loss("flow_grpo", {"clip_rnage": 0.1})
    loss = make_step_loss("flow_grpo")
    assert loss.name == "flow_grpo"


def test_missing_advantages_is_one_line():
    rows = _rows()
    del rows["advantages"]
    loss, _ = _spy_loss(StepNeeds.VELOCITY, keys=("advantages",))
    with pytest.raises(ValueError, match="advantages"):
        build_step_batch(loss, step_tensors(rows, 0))


def test_tempflow_reads_step_advantages_when_the_batch_has_them():
    """Process advantages of a branched rollout reach tempflow_grpo (an optional key, never required)."""
    from verl_diffusion.algos.ratio_losses import tempflow_grpo_loss
    from verl_diffusion.workers.worker import _TRAIN_KEYS

    assert "step_advantages" in _TRAIN_KEYS                 # travels from the DataProto to the engine
    loss = make_step_loss("tempflow_grpo", {"clip_range": 1e-4, "scale": 2.25, "kl_coef": 0.0})
    assert "step_advantages" not in loss.spec.batch_keys and "step_advantages" in loss.spec.optional_batch_keys
    vel = lambda x, t, r: 0.5 * x * t.view(-1, 1, 1, 1)  # noqa: E731
    rows = _rows()
    plain, n, q, _ = run_step_loss(loss, rows, 1, velocity_fn=vel)   # absent: falls back to advantages
    rows["step_advantages"] = torch.tensor([[0.0, 2.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.5, 0.0], [0.0, 3.0, 0.0]])
    out, n, q, st = run_step_loss(loss, rows, 1, velocity_fn=vel)
    assert n == 4 and torch.equal(st["step_advantages"], rows["step_advantages"][:, 1])
    ref, _ = tempflow_grpo_loss(q.log_prob, st["old_log_prob"], rows["step_advantages"][:, 1], st["std"],
                                scale=2.25, clip_range=1e-4)
    torch.testing.assert_close(out.loss, ref.mean())
    ref_plain, _ = tempflow_grpo_loss(q.log_prob, st["old_log_prob"], rows["advantages"][:, 1], st["std"],
                                      scale=2.25, clip_range=1e-4)
    torch.testing.assert_close(plain.loss, ref_plain.mean())
    assert not torch.allclose(out.loss, plain.loss)


def test_optional_keys_are_sliced_with_the_items_and_never_required():
    mask = torch.tensor([[1, 0, 0], [0, 0, 0], [1, 0, 0], [1, 0, 0]], dtype=torch.int32)
    loss, seen = _spy_loss(StepNeeds.VELOCITY, keys=("advantages",))
    run_step_loss(loss, _rows(mask=mask), 0, velocity_fn=_velocity([]))
    assert seen["b"].step_advantages is None
    rows = _rows(mask=mask)
    rows["step_advantages"] = torch.arange(12.0).view(4, 3)
    run_step_loss(loss, rows, 0, velocity_fn=_velocity([]))
    assert seen["b"].step_advantages.tolist() == [0.0, 6.0, 9.0]
