"""Diffusers rollout on the tiny SD3 model: data-flow contract, bitwise log-prob recomputation, windows,
determinism, per-group noise and ODE validation (SPEC §1, docs/data_flow.md)."""

import dataclasses

import pytest
import torch

from verl_diffusion.algos.sde import StepCoefficients, gaussian_log_prob, make_grid, step_mean
from verl_diffusion.algos.windows import SdeWindowConfig
from verl_diffusion.models.base import Conditioning
from verl_diffusion.models.sd3 import SD3Adapter
from verl_diffusion.models.tiny import build_tiny_sd3_pipeline
from verl_diffusion.rollout.diffusers_rollout import ROLLOUT_KEYS, DiffusersRollout, RolloutConfig

PROMPTS = ["a cat"] * 3 + ["the word ok"] * 3
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
N = 6


@pytest.fixture(scope="module")
def adapter():
    return SD3Adapter.from_pipeline(build_tiny_sd3_pipeline(seed=0))


def make(adapter, **kw):
    base = dict(num_steps=N, height=64, width=64, micro_batch_size=4,
                window=SdeWindowConfig(mode="fixed", size=2, lo=1, hi=N))
    base.update(kw)
    return DiffusersRollout(adapter, RolloutConfig(**base))


def test_keys_shapes_dtypes_match_data_flow(adapter):
    out = make(adapter).generate(PROMPTS, GROUPS, seed=0, store_velocities=True)
    b, lat = len(PROMPTS), (16, 16, 16)
    assert set(out) == set(ROLLOUT_KEYS) | {"old_velocities"}
    assert out["all_latents"].shape == (b, N + 1, *lat)
    assert out["old_velocities"].shape == (b, N, *lat)
    for key in ("train_mask", "rollout_log_probs", "sde_cx", "sde_cv", "sde_std"):
        assert out[key].shape == (b, N), key
    assert out["sigmas"].shape == (b, N + 1)
    assert torch.equal(out["sigmas"][0], make_grid(N, 3.0, dtype=torch.float32))
    assert out["train_mask"].dtype == torch.int32
    assert out["images"].shape == (b, 3, 64, 64) and out["images"].dtype == torch.uint8
    assert out["prompt_embeds"].shape[0] == b and out["pooled_prompt_embeds"].shape == (b, 32)
    for key in ("all_latents", "rollout_log_probs", "sde_cx", "sde_cv", "sde_std", "sigmas"):
        assert out[key].dtype == torch.float32, key
    # Without store_velocities there is no old_velocities key.
    assert set(make(adapter).generate(PROMPTS, GROUPS, seed=0)) == set(ROLLOUT_KEYS)


def test_only_window_steps_are_trained_and_ode_elsewhere(adapter):
    out = make(adapter).generate(PROMPTS, GROUPS, seed=0, store_velocities=True)
    expect = torch.zeros(N, dtype=torch.int32)
    expect[1:3] = 1
    assert torch.equal(out["train_mask"], expect.expand(len(PROMPTS), N))
    off = out["train_mask"] == 0
    assert torch.all(out["rollout_log_probs"][off] == 0) and torch.all(out["sde_std"][off] == 0)
    assert torch.all(out["sde_cx"][off] == 1)
    dt = out["sigmas"][:, 1:] - out["sigmas"][:, :-1]
    assert torch.equal(out["sde_cv"][off], dt[off])
    assert torch.all(out["sde_std"][~off] > 0) and torch.all(out["rollout_log_probs"][~off] != 0)
    assert torch.all(out["old_velocities"][:, [0, 3, 4, 5]] == 0)


def test_recomputed_log_probs_equal_stored_bitwise(adapter):
    """The engine's on-policy recomputation (same velocity) reproduces ℓ_old exactly."""
    out = make(adapter).generate(PROMPTS, GROUPS, seed=3, store_velocities=True)
    for k in (1, 2):
        coef = StepCoefficients(out["sde_cx"][:, k], out["sde_cv"][:, k], out["sde_std"][:, k])
        mean = step_mean(out["all_latents"][:, k], out["old_velocities"][:, k], coef)
        lp = gaussian_log_prob(out["all_latents"][:, k + 1], mean, coef.std)
        assert torch.equal(lp, out["rollout_log_probs"][:, k])


def test_recomputed_velocity_matches_stored(adapter):
    """A fresh forward at the stored state (the engine's path) gives the stored v_old, hence ℓ_old."""
    out = make(adapter).generate(PROMPTS, GROUPS, seed=3, store_velocities=True)
    k = 1
    cond = Conditioning.from_dict(out)                        # the stored embeddings, as the engine reads them
    with torch.no_grad():
        v = adapter.velocity(out["all_latents"][:, k], out["sigmas"][:, k], cond)
    coef = StepCoefficients(out["sde_cx"][:, k], out["sde_cv"][:, k], out["sde_std"][:, k])
    lp = gaussian_log_prob(out["all_latents"][:, k + 1], step_mean(out["all_latents"][:, k], v, coef), coef.std)
    # Rollout micro-batches of 4 vs one forward of 6 here: equal up to batched-matmul round-off.
    torch.testing.assert_close(v, out["old_velocities"][:, k], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp, out["rollout_log_probs"][:, k], rtol=1e-5, atol=1e-5)
    # Same batch composition as the rollout's forward: bitwise.
    out6 = make(adapter, micro_batch_size=6).generate(PROMPTS, GROUPS, seed=3, store_velocities=True)
    with torch.no_grad():
        v6 = adapter.velocity(out6["all_latents"][:, k], out6["sigmas"][:, k], Conditioning.from_dict(out6))
    lp6 = gaussian_log_prob(out6["all_latents"][:, k + 1], step_mean(out6["all_latents"][:, k], v6, coef), coef.std)
    assert torch.equal(v6, out6["old_velocities"][:, k])
    assert torch.equal(lp6, out6["rollout_log_probs"][:, k])


def test_same_seed_is_bitwise_same_and_independent_of_micro_batch(adapter):
    a = make(adapter).generate(PROMPTS, GROUPS, seed=7)
    b = make(adapter).generate(PROMPTS, GROUPS, seed=7)
    c = make(adapter).generate(PROMPTS, GROUPS, seed=8)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert not torch.equal(a["all_latents"], c["all_latents"])
    d = make(adapter, micro_batch_size=6).generate(PROMPTS, GROUPS, seed=7)
    torch.testing.assert_close(d["all_latents"], a["all_latents"], rtol=1e-4, atol=1e-4)


def test_outside_window_bitwise_equal_given_same_noise(adapter):
    """SPEC §1.8 check 8: same initial noise + same window noise → bitwise equal outside the window;
    before the window the states are the pure ODE trajectory."""
    ro = make(adapter, micro_batch_size=len(PROMPTS))     # one forward per step, as run_trajectory below
    b = len(PROMPTS)
    x0 = torch.randn((b, 16, 16, 16), generator=torch.Generator().manual_seed(11))
    a = ro.generate(PROMPTS, GROUPS, seed=1, initial_noise=x0)
    a2 = ro.generate(PROMPTS, GROUPS, seed=1, initial_noise=x0)
    other = ro.generate(PROMPTS, GROUPS, seed=2, initial_noise=x0)    # different window noise
    assert torch.equal(a["all_latents"], a2["all_latents"])
    assert torch.equal(a["all_latents"][:, :2], other["all_latents"][:, :2])  # states up to the window start
    assert not torch.equal(a["all_latents"][:, 2:], other["all_latents"][:, 2:])
    sigmas = make_grid(N, 3.0, dtype=torch.float32).expand(b, -1)
    cond = ro.encode_prompts(PROMPTS)
    ode = ro.run_trajectory(cond, x0, sigmas=sigmas)
    assert torch.equal(ode["all_latents"][:, :2], a["all_latents"][:, :2])
    assert torch.all(ode["train_mask"] == 0)
    # Window draws through run_trajectory with explicit noise reproduce generate bitwise.
    z = {k: torch.randn((b, 16, 16, 16), generator=torch.Generator().manual_seed(k)) for k in (1, 2)}
    r1 = ro.run_trajectory(cond, x0, sigmas=sigmas, stochastic=[1, 2], trained=[1, 2],
                           step_noise=z)
    r2 = ro.run_trajectory(cond, x0, sigmas=sigmas, stochastic=[1, 2], trained=[1, 2],
                           step_noise=z)
    assert torch.equal(r1["all_latents"], r2["all_latents"])


def test_random_window_is_shared_and_seeded(adapter):
    cfg_w = SdeWindowConfig(mode="random", size=2, lo=0, hi=N)
    ro = make(adapter, window=cfg_w)
    starts = set()
    for seed in range(6):
        out = ro.generate(PROMPTS, GROUPS, seed=seed)
        m = out["train_mask"]
        assert torch.all(m == m[0]) and int(m[0].sum()) == 2       # one window for the whole batch
        s = int(m[0].nonzero()[0])
        assert 0 <= s <= N - 2 and ro.metrics["rollout/window_start"] == s
        starts.add(s)
    assert len(starts) > 1


def test_progressive_window_follows_iteration(adapter):
    ro = make(adapter, window=SdeWindowConfig(mode="progressive", size=2, lo=0, hi=N, period=1, stride=1))
    for it, s in [(0, 0), (1, 1), (4, 4), (5, 0)]:
        m = ro.generate(PROMPTS[:2], GROUPS[:2], seed=0, iteration=it)["train_mask"][0]
        assert m.nonzero().flatten().tolist() == [s, s + 1], it


def test_window_none_trains_first_99_percent(adapter):
    out = make(adapter, window=SdeWindowConfig(mode="none")).generate(PROMPTS[:2], GROUPS[:2], seed=0)
    assert out["train_mask"][0].tolist() == [1] * (N - 1) + [0]
    assert out["sde_std"][0, -1] > 0          # last step still stochastic, just not trained


def test_same_noise_per_group(adapter):
    groups = torch.tensor([5, 5, 5, 2, 2, 2])
    out = make(adapter, same_noise_per_group=True).generate(PROMPTS, groups, seed=0)
    x = out["all_latents"]
    assert torch.equal(x[0, 0], x[1, 0]) and torch.equal(x[3, 0], x[5, 0])
    assert not torch.equal(x[0, 0], x[3, 0])
    assert not torch.equal(x[0, -1], x[1, -1])                      # window noise stays independent
    indep = make(adapter).generate(PROMPTS, groups, seed=0)["all_latents"]
    assert not torch.equal(indep[0, 0], indep[1, 0])
    # verl's uid strings work as group ids (numbered by first appearance).
    uids = ["u-b"] * 3 + ["u-a"] * 3
    by_uid = make(adapter, same_noise_per_group=True).generate(PROMPTS, uids, seed=0)["all_latents"]
    assert torch.equal(by_uid[0, 0], by_uid[2, 0]) and not torch.equal(by_uid[0, 0], by_uid[3, 0])


def test_cfg_rollout_stores_negative_embeddings(adapter):
    out = make(adapter, guidance_scale=4.5).generate(PROMPTS[:2], GROUPS[:2], seed=0)
    assert out["negative_prompt_embeds"].shape == out["prompt_embeds"].shape
    assert out["negative_pooled_prompt_embeds"].shape == out["pooled_prompt_embeds"].shape


def test_ode_validation_is_deterministic(adapter):
    ro = make(adapter)
    imgs = ro.generate_ode(PROMPTS[:4], seeds=[0, 1, 2, 3], num_steps=4)
    again = ro.generate_ode(PROMPTS[:4], seeds=[0, 1, 2, 3], num_steps=4)
    assert imgs.shape == (4, 3, 64, 64) and imgs.dtype == torch.uint8
    assert torch.equal(imgs, again)
    # An image depends on its own (prompt, seed) only.
    single = ro.generate_ode(PROMPTS[2:3], seeds=[2], num_steps=4)
    assert (single[0].int() - imgs[2].int()).abs().max() <= 1
    assert ro.metrics["perf/val_time_per_image"] > 0


def test_unnormalized_convention_and_errors(adapter):
    out = make(adapter, sampler="cps", noise_level=0.8, log_prob_convention="unnormalized").generate(
        PROMPTS[:2], GROUPS[:2], seed=0, store_velocities=True)
    k = 1
    coef = StepCoefficients(out["sde_cx"][:, k], out["sde_cv"][:, k], out["sde_std"][:, k])
    mean = step_mean(out["all_latents"][:, k], out["old_velocities"][:, k], coef)
    lp = gaussian_log_prob(out["all_latents"][:, k + 1], mean, coef.std, convention="unnormalized")
    assert torch.equal(lp, out["rollout_log_probs"][:, k])
    with pytest.raises(ValueError, match="rollout.sde.type"):
        RolloutConfig(sampler="euler")
    with pytest.raises(ValueError, match="one group id per sample"):
        make(adapter).generate(PROMPTS, GROUPS[:2], seed=0)
    cfg = dataclasses.replace(RolloutConfig(), window={"mode": "fixed", "size": 3})
    assert cfg.window == SdeWindowConfig(mode="fixed", size=3)
