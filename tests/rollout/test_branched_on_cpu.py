"""TempFlow-GRPO branched rollout on the tiny SD3 model (SPEC §3.3): layout, ODE trunk, children's
log-probs, determinism, process step advantages and one tempflow_grpo loss evaluation."""

import pytest
import torch

from verl_diffusion.algos.advantages import broadcast_to_steps, group_advantages
from verl_diffusion.algos.sde import StepCoefficients, gaussian_log_prob, make_grid, step_mean
from verl_diffusion.models.base import Conditioning
from verl_diffusion.models.sd3 import SD3Adapter
from verl_diffusion.models.tiny import build_tiny_sd3_pipeline
from verl_diffusion.rollout.branched import BRANCHED_KEYS, branched_step_advantages, generate_branched
from verl_diffusion.rollout.diffusers_rollout import ROLLOUT_KEYS, DiffusersRollout, RolloutConfig
from verl_diffusion.workers.step_loss import make_step_loss, run_step_loss

PROMPTS = ["a cat", "the word ok"]
N, KB = 4, 2
P, S = len(PROMPTS), N - 1
B = P * S * KB
LAT = (16, 16, 16)


@pytest.fixture(scope="module")
def adapter():
    return SD3Adapter.from_pipeline(build_tiny_sd3_pipeline(seed=0))


def make(adapter, **kw):
    base = dict(num_steps=N, height=64, width=64, micro_batch_size=4)
    base.update(kw)
    return DiffusersRollout(adapter, RolloutConfig(**base))


@pytest.fixture(scope="module")
def out(adapter):
    return generate_branched(make(adapter), PROMPTS, seed=0, num_children=KB, store_velocities=True)


def test_keys_shapes_and_layout(out):
    assert set(out) == set(ROLLOUT_KEYS) | set(BRANCHED_KEYS) | {"old_velocities"}
    assert out["all_latents"].shape == (B, N + 1, *LAT) and out["old_velocities"].shape == (B, N, *LAT)
    for key in ("train_mask", "rollout_log_probs", "sde_cx", "sde_cv", "sde_std"):
        assert out[key].shape == (B, N), key
    assert out["images"].shape == (B, 3, 64, 64) and out["images"].dtype == torch.uint8
    assert out["prompt_embeds"].shape[0] == B and out["pooled_prompt_embeds"].shape[0] == B
    assert torch.equal(out["sigmas"], make_grid(N, 3.0).expand(B, -1))
    # Row order: prompt, branch step, child.
    assert out["prompt_ids"].tolist() == [0] * 6 + [1] * 6
    assert out["branch_step"].tolist() == [0, 0, 1, 1, 2, 2] * 2
    assert out["group_ids"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
    at_k = torch.nn.functional.one_hot(out["branch_step"], N).bool()
    assert torch.equal(out["train_mask"], at_k.to(torch.int32))                # trained at k only
    assert torch.all(out["sde_std"][at_k] > 0) and torch.all(out["rollout_log_probs"][at_k] != 0)
    assert torch.all(out["sde_std"][~at_k] == 0) and torch.all(out["rollout_log_probs"][~at_k] == 0)
    assert torch.all(out["sde_cx"][~at_k] == 1) and torch.all(out["old_velocities"][~at_k] == 0)
    dt = out["sigmas"][:, 1:] - out["sigmas"][:, :-1]
    assert torch.equal(out["sde_cv"][~at_k], dt[~at_k])
    # Same embeddings as the plain rollout's encoding of the row's prompt.
    assert torch.equal(out["prompt_embeds"][6], out["prompt_embeds"][11])
    assert not torch.equal(out["prompt_embeds"][0], out["prompt_embeds"][6])


def test_trunk_is_bitwise_the_ode_trajectory(adapter, out):
    ro = make(adapter)
    x_init = out["all_latents"][[0, 6], 0]                                     # the two trunks' noise
    ode = ro.run_trajectory(ro.encode_prompts(PROMPTS), x_init, sigmas=make_grid(N, 3.0).expand(P, -1))
    for i in range(B):
        p, k = int(out["prompt_ids"][i]), int(out["branch_step"][i])
        assert torch.equal(out["all_latents"][i, :k + 1], ode["all_latents"][p, :k + 1]), i
    # Children of one (prompt, k) share the trunk up to x_{t_k} and differ from x_{t_{k+1}} on.
    for g in range(B // KB):
        a, b = 2 * g, 2 * g + 1
        k = int(out["branch_step"][a])
        assert torch.equal(out["all_latents"][a, :k + 1], out["all_latents"][b, :k + 1])
        assert not torch.equal(out["all_latents"][a, k + 1], out["all_latents"][b, k + 1])
        assert not torch.equal(out["images"][a], out["images"][b])


def test_children_log_probs_recompute_from_stored_latents_and_velocity(adapter, out):
    k_all = out["branch_step"]
    idx = torch.arange(B)
    coef = StepCoefficients(out["sde_cx"][idx, k_all], out["sde_cv"][idx, k_all], out["sde_std"][idx, k_all])
    x, x_next = out["all_latents"][idx, k_all], out["all_latents"][idx, k_all + 1]
    lp = gaussian_log_prob(x_next, step_mean(x, out["old_velocities"][idx, k_all], coef), coef.std)
    assert torch.equal(lp, out["rollout_log_probs"][idx, k_all])
    # A fresh forward at the stored states (the engine's path) gives v_old: bitwise with the trunk's batch
    # composition (the P trunk states of step k in one forward), to round-off with another.
    for k in range(S):
        rows = torch.tensor([2 * k, 6 + 2 * k])                                # child 0 of (p, k), p = 0, 1
        cond = Conditioning.from_dict({key: out[key][rows] for key in ("prompt_embeds", "pooled_prompt_embeds")})
        with torch.no_grad():
            v = adapter.velocity(out["all_latents"][rows, k], out["sigmas"][rows, k], cond)
        assert torch.equal(v, out["old_velocities"][rows, k]), k
    cond = Conditioning.from_dict(out)
    with torch.no_grad():
        v_all = adapter.velocity(x, out["sigmas"][idx, k_all], cond)
    torch.testing.assert_close(v_all, out["old_velocities"][idx, k_all], rtol=1e-5, atol=1e-5)


def test_deterministic_by_seed_and_independent_of_micro_batch(adapter, out):
    again = generate_branched(make(adapter), PROMPTS, seed=0, num_children=KB, store_velocities=True)
    for key in out:
        assert torch.equal(out[key], again[key]), key
    other = generate_branched(make(adapter), PROMPTS, seed=1, num_children=KB)
    assert not torch.equal(out["all_latents"], other["all_latents"])
    assert "old_velocities" not in other
    mb1 = generate_branched(make(adapter, micro_batch_size=1), PROMPTS, seed=0, num_children=KB)
    torch.testing.assert_close(mb1["all_latents"], out["all_latents"], rtol=1e-4, atol=1e-4)


def test_branch_step_subset_and_errors(adapter):
    ro = make(adapter)
    sub = generate_branched(ro, PROMPTS[:1], seed=0, branch_steps=[2, 0], num_children=3)
    assert sub["branch_step"].tolist() == [0, 0, 0, 2, 2, 2] and sub["group_ids"].tolist() == [0, 0, 0, 1, 1, 1]
    assert ro.metrics["rollout/num_branch_steps"] == 2.0 and ro.metrics["perf/rollout_time"] > 0
    with pytest.raises(ValueError, match="branch_steps"):
        generate_branched(ro, PROMPTS, seed=0, branch_steps=[N - 1], num_children=2)
    with pytest.raises(ValueError, match="num_children"):
        generate_branched(ro, PROMPTS, seed=0, num_children=0)
    with pytest.raises(ValueError, match="stochastic sampler"):
        generate_branched(make(adapter, sampler="ode"), PROMPTS, seed=0, num_children=2)


def _rewards(out):
    """A deterministic stand-in reward per child image."""
    return out["images"].to(torch.float64).mean(dim=(1, 2, 3)) / 255.0


def test_step_advantages_sum_to_zero_per_prompt_and_k(out):
    sa = branched_step_advantages(_rewards(out), out["prompt_ids"], out["branch_step"], N)
    assert sa.shape == (B, N)
    at_k = torch.nn.functional.one_hot(out["branch_step"], N).bool()
    assert torch.all(sa[~at_k] == 0) and torch.all(sa[at_k] != 0)
    sums = torch.zeros(B // KB, dtype=sa.dtype).index_add_(0, out["group_ids"], sa.sum(dim=1))
    torch.testing.assert_close(sums, torch.zeros_like(sums), rtol=0, atol=1e-9)


def test_tempflow_loss_reads_step_advantages(adapter, out):
    rewards = _rewards(out)
    sample_adv = group_advantages(rewards, out["prompt_ids"])                  # per-prompt fallback
    rows = dict(out)
    rows["advantages"] = broadcast_to_steps(sample_adv, out["train_mask"]).float()
    rows["old_log_probs"] = out["rollout_log_probs"]
    step_adv = branched_step_advantages(rewards, out["prompt_ids"], out["branch_step"], N).float()
    loss = make_step_loss("tempflow_grpo")

    def velocity_fn(x, t, r):
        return adapter.velocity(x, t, Conditioning.from_dict(r))

    k = 0
    # run_step_loss forwards every row it is given at step k and computes its log-prob, which refuses τ_k = 0:
    # a branched batch is fed per branch step (only the rows that branch at k).
    sel = torch.nonzero(out["branch_step"] == k).flatten()
    rows = {key: val[sel] for key, val in rows.items()}
    step_adv = step_adv[sel]
    with torch.no_grad():
        res, n_items, q, _ = run_step_loss(loss, {**rows, "step_advantages": step_adv}, k,
                                           velocity_fn=velocity_fn)
        fb, n_fb, _, _ = run_step_loss(loss, rows, k, velocity_fn=velocity_fn)
    assert n_items == n_fb == P * KB
    assert torch.isfinite(res.loss) and torch.isfinite(fb.loss)
    # Hand formula: c·τ_k·max(−Aρ, −A·clip(ρ)), c = 2.25, ε = 1e-4; on-policy ρ ≈ 1 (the forward here batches
    # P·K_b rows, the trunk's batched P), and the step advantages sum to 0 within each (prompt, k).
    ratio = torch.exp(q.log_prob.double() - rows["rollout_log_probs"][:, k].double())
    torch.testing.assert_close(ratio, torch.ones_like(ratio), rtol=0, atol=1e-4)
    a = step_adv[:, k].double()
    expect = (2.25 * rows["sde_std"][:, k].double()
              * torch.maximum(-a * ratio, -a * ratio.clamp(1 - 1e-4, 1 + 1e-4))).mean()
    torch.testing.assert_close(res.loss.double(), expect, rtol=1e-5, atol=1e-7)
    assert abs(float(res.loss) - float(fb.loss)) > 1e-6
