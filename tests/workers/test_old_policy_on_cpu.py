"""Soft old-policy copy θ_old (SPEC §8.2, workers/old_policy.py): schedule values applied after training, the
fresh old velocity of diffusion_nft / awm(off_policy) from θ_old, bitwise restore, checkpoint state.

In-process tests are pure torch; ``test_worker_*`` run the real worker (FSDP2 DTensor shards, gloo, no Ray) in a
subprocess (tests/workers/old_policy_smoke.py)."""

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_diffusion.algos.ema import soft_update_
from verl_diffusion.workers.old_policy import OldPolicy, OldPolicyConfig
from verl_diffusion.workers.step_loss import PREP_PREFIX, make_step_loss, prepare_steps

HERE = Path(__file__).resolve().parent


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(5, generator=g))]


@pytest.mark.parametrize("cfg,n,d", [
    ({"schedule": "nft", "nft_type": 2}, 74, 0.0), ({"schedule": "nft", "nft_type": 2}, 76, 0.0075),
    ({"schedule": "nft", "nft_type": 2}, 208, 0.9975), ({"schedule": "nft", "nft_type": 2}, 209, 0.999),
    ({"schedule": "nft", "nft_type": 1}, 100, 0.1), ({"schedule": "nft", "nft_type": 1}, 900, 0.5),
    ({"schedule": "nft", "nft_type": 0}, 50, 0.0),
    ({"schedule": "awm_linear", "decay_max": 0.3}, 100, 0.1), ({"schedule": "awm_linear", "decay_max": 0.3}, 400, 0.3),
    ({"schedule": "awm_constant", "decay_max": 0.3}, 0, 0.3), ({"schedule": "constant", "decay": 0.25}, 7, 0.25)])
def test_schedule_values(cfg, n, d):
    assert OldPolicyConfig.from_dict(cfg).decay_at(n) == pytest.approx(d, abs=1e-12)


def test_config_defaults_and_errors():
    assert not OldPolicyConfig.from_dict(None).enabled
    assert not OldPolicyConfig.from_dict({"schedule": "none", "decay": None}).enabled
    for bad in ({"schedule": "ema"}, {"schedule": "nft", "nft_type": 3}, {"schedule": "constant"},
                {"schedule": "nft", "typo": 1}, {"schedule": "awm_linear", "decay_max": 1.5}):
        with pytest.raises(ValueError):
            OldPolicyConfig.from_dict(bad)


def test_update_after_training_type2_at_76():
    params = _params()
    old = OldPolicy(params, OldPolicyConfig(schedule="nft", nft_type=2))
    theta_old = [p.detach().clone() for p in params]
    assert all(torch.equal(s, t) for s, t in zip(old.shadow, theta_old))   # θ_old starts as θ
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    d = old.update(76)
    assert d == pytest.approx(0.0075)
    for s, o, p in zip(old.shadow, theta_old, params):
        assert torch.equal(s, torch.lerp(o, p.detach(), 1.0 - d))                 # the ema.soft_update_ kernel
        torch.testing.assert_close(s, d * o + (1 - d) * p.detach(), rtol=0, atol=1e-6)
    # d = 0 (n < 75): θ_old = θ exactly
    old.update(10)
    assert all(torch.equal(s, p.detach()) for s, p in zip(old.shadow, params))


def test_swap_in_holds_old_and_restores_bitwise_even_on_error():
    params = _params()
    old = OldPolicy(params, OldPolicyConfig(schedule="constant", decay=0.5))
    with torch.no_grad():
        for p in params:
            p.mul_(1.7).add_(0.3)
    theta = [p.detach().clone() for p in params]
    with old.swap_in():
        assert not torch.is_grad_enabled()
        assert all(torch.equal(p.detach(), s) for p, s in zip(params, old.shadow))
    assert all(torch.equal(p.detach(), t) for p, t in zip(params, theta))
    with pytest.raises(RuntimeError):
        with old.swap_in():
            raise RuntimeError("boom")
    assert all(torch.equal(p.detach(), t) for p, t in zip(params, theta))
    assert torch.is_grad_enabled()


def test_state_survives_save_and_load():
    params = _params()
    old = OldPolicy(params, OldPolicyConfig(schedule="awm_linear", decay_max=0.3))
    with torch.no_grad():
        params[0].add_(2.0)
    old.update(120)
    buf = io.BytesIO()
    torch.save(old.state_dict(), buf)
    other = OldPolicy(_params(seed=1), OldPolicyConfig(schedule="awm_linear", decay_max=0.3))
    buf.seek(0)
    other.load_state_dict(torch.load(buf, weights_only=False))
    assert all(torch.equal(a, b) for a, b in zip(other.shadow, old.shadow))
    assert other.last_decay == pytest.approx(0.12)
    with pytest.raises(ValueError):
        other.load_state_dict({"shadow": old.shadow[:1]})


def _nft_rows(B=4, N=3, C=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"all_latents": torch.randn(B, N + 1, C, generator=g),
            "sigmas": torch.linspace(1.0, 0.0, N + 1).expand(B, N + 1).contiguous(),
            "train_mask": torch.ones(B, N, dtype=torch.long), "advantages": torch.randn(B, N, generator=g)}


@pytest.mark.parametrize("mode,knobs", [("diffusion_nft", {}), ("awm", {"off_policy": True})])
def test_fresh_old_velocity_is_theta_old(mode, knobs):
    """schedule none: the pre-update weights' velocity (unchanged); d > 0: the soft-averaged weights' velocity."""
    loss = make_step_loss(mode, knobs)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 4)
    params = [p for p in net.parameters() if p.requires_grad]

    def velocity(x_t, t, rows):
        return net(x_t) * t[:, None]

    old = OldPolicy(params, OldPolicyConfig(schedule="constant", decay=0.4))
    theta_old0 = [p.detach().clone() for p in params]
    with torch.no_grad():                                  # "training" moved θ
        for p in params:
            p.add_(torch.randn_like(p))
    old.update(1)
    rows = _nft_rows()

    def prep(ctx):
        with ctx:
            return prepare_steps(loss, rows, velocity_fn=velocity, generator=torch.Generator().manual_seed(3))

    theta = [p.detach().clone() for p in params]
    import contextlib

    # none: no swap -> current (pre-update) weights
    out_none = prep(contextlib.nullcontext())
    # d > 0: θ_old = 0.4·θ_old0 + 0.6·θ
    out_old = prep(old.swap_in())
    assert all(torch.equal(p.detach(), t) for p, t in zip(params, theta))

    avg = torch.nn.Linear(4, 4)
    with torch.no_grad():
        for q, o, t in zip(avg.parameters(), theta_old0, theta):
            q.copy_(torch.lerp(o, t, 0.6))
            torch.testing.assert_close(q, 0.4 * o + 0.6 * t)
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(net.state_dict())
    key = PREP_PREFIX + "fresh_old_velocity"
    for k in range(3):
        x_t, t = out_none[PREP_PREFIX + "x_t"][:, k], rows["sigmas"][:, k]
        assert torch.equal(out_old[PREP_PREFIX + "x_t"][:, k], x_t)           # same fresh states either way
        with torch.no_grad():
            assert torch.equal(out_none[key][:, k], ref(x_t) * t[:, None])
            assert torch.equal(out_old[key][:, k], avg(x_t) * t[:, None])
    assert not torch.equal(out_none[key], out_old[key])


@pytest.fixture(scope="module")
def worker_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("old_policy")
    env = dict(os.environ, VERL_PLATFORM="cpu", OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(HERE / "old_policy_smoke.py"), str(out)], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-5000:])
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    return {r["check"]: r for r in rows}


def test_worker_soft_update_after_training(worker_run):
    for lora in (0, 4):
        r = worker_run[f"update_lora{lora}"]
        assert r["decay"] == pytest.approx(0.5) and r["metric"] == pytest.approx(0.5), r
        assert r["shadow_err"] <= 1e-6 and r["dtensor"], r
        assert r["n_tracked"] == r["n_trainable"], r


def test_worker_fresh_old_velocity_and_rollout_use_theta_old(worker_run):
    for lora in (0, 4):
        r = worker_run[f"update_lora{lora}"]
        assert r["prep_old_vs_theta_old"] == 0.0, r      # fresh v_old = v(θ_old), bitwise
        assert r["prep_old_vs_theta"] > 0.0, r           # ... not the current weights
        assert r["rollout_swapped"], r
        assert r["restored_bitwise"], r


def test_worker_state_survives_checkpoint(worker_run):
    for lora in (0, 4):
        r = worker_run[f"ckpt_lora{lora}"]
        assert r["shadow_equal"] and r["optimizer_steps"] == r["expected_steps"], r


@pytest.mark.parametrize("recipe,expect", [("sd35_ocr_diffusion_nft", ("nft", 76, 0.0075)),
                                           ("sd35_pickscore_awm", ("awm_linear", 400, 0.3))])
def test_recipes_set_the_published_schedule(recipe, expect):
    from omegaconf import OmegaConf

    node = OmegaConf.load(HERE.parents[1] / "recipes" / f"{recipe}.yaml").actor_rollout_ref.actor
    cfg = OldPolicyConfig.from_dict(OmegaConf.to_container(node.old_policy))
    schedule, n, d = expect
    assert cfg.schedule == schedule and cfg.use_for_rollout and cfg.decay_at(n) == pytest.approx(d)
    if recipe.endswith("awm"):
        assert node.policy_loss.off_policy is True


def test_default_config_keeps_no_copy():
    from omegaconf import OmegaConf

    node = OmegaConf.load(HERE.parents[1] / "verl_diffusion" / "config" / "flowgrpo_trainer.yaml")
    assert not OldPolicyConfig.from_dict(OmegaConf.to_container(node.actor_rollout_ref.actor.old_policy)).enabled
