"""SPEC §1 check 8: SDE windows (verl_diffusion/algos/windows.py)."""

import pytest
import torch

from verl_diffusion.algos import sde
from verl_diffusion.algos.windows import (WINDOW_MODES, SdeWindowConfig, stochastic_steps, window_bounds,
                                          window_start, window_steps)


def test_progressive_sequence_matches_spec():
    cfg = SdeWindowConfig(mode="progressive", size=4, lo=0, hi=10, period=2, stride=1)
    seq = [window_start(cfg, num_steps=10, iteration=n) for n in range(18)]
    assert seq == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 0, 0, 1, 1]


def test_mixgrpo_preset_slides_every_25_iterations():
    cfg = SdeWindowConfig(mode="progressive", size=4, lo=0, hi=25, period=25, stride=1)
    assert [window_start(cfg, num_steps=25, iteration=n) for n in (0, 24, 25, 50, 21 * 25, 22 * 25)] == [0, 0, 1, 2, 21, 0]


@pytest.mark.parametrize("mode", ["fixed", "random", "progressive"])
@pytest.mark.parametrize("size, lo, hi, n", [(2, 0, None, 10), (3, 1, 8, 10), (4, 0, 25, 25), (3, 0, None, 16)])
def test_window_invariants(mode, size, lo, hi, n):
    cfg = SdeWindowConfig(mode=mode, size=size, lo=lo, hi=hi)
    lo_r, hi_r = window_bounds(cfg, num_steps=n)
    g = torch.Generator().manual_seed(0)
    starts = set()
    for it in range(40):
        steps = window_steps(cfg, num_steps=n, iteration=it, generator=g)
        s = steps[0]
        starts.add(s)
        assert len(steps) == size and steps == list(range(s, s + size))
        assert lo_r <= s <= hi_r - size
    if mode == "fixed":
        assert starts == {lo}
    if mode == "random" and hi_r - size - lo_r + 1 <= 6:
        assert starts == set(range(lo_r, hi_r - size + 1))  # 40 draws cover ≤ 6 starts


def test_hi_none_is_first_half():
    cfg = SdeWindowConfig(mode="random", size=2)
    assert window_bounds(cfg, num_steps=10) == (0, 5)
    assert window_bounds(cfg, num_steps=25) == (0, 12)


def test_random_start_is_seeded_and_one_value_per_batch():
    cfg = SdeWindowConfig(mode="random", size=3, hi=10)
    a = [window_start(cfg, num_steps=10, generator=torch.Generator().manual_seed(5)) for _ in range(3)]
    assert len(set(a)) == 1 and isinstance(a[0], int)


def test_none_mode_all_stochastic_trains_first_99_percent():
    cfg = SdeWindowConfig(mode="none")
    assert stochastic_steps(cfg, num_steps=10) == list(range(10))
    assert window_steps(cfg, num_steps=10) == list(range(9))
    assert len(window_steps(cfg, num_steps=100)) == 99
    assert len(window_steps(cfg, num_steps=200)) == 198
    assert window_start(cfg, num_steps=10) == 0


def test_invalid_configs_raise_teaching_errors():
    with pytest.raises(ValueError, match=r"sde_window.mode='sliding'.*'fixed'"):
        SdeWindowConfig(mode="sliding")
    with pytest.raises(ValueError, match="sde_window.size=0"):
        SdeWindowConfig(size=0)
    with pytest.raises(ValueError, match="sde_window.hi=3"):
        SdeWindowConfig(size=2, lo=2, hi=3)
    with pytest.raises(ValueError, match="sde_window.period=0"):
        SdeWindowConfig(period=0)
    with pytest.raises(ValueError, match="does not fit num_steps=4"):
        window_start(SdeWindowConfig(size=3), num_steps=4)
    with pytest.raises(ValueError, match="does not fit num_steps=10"):
        window_start(SdeWindowConfig(size=2, hi=12), num_steps=10)
    assert set(WINDOW_MODES) == {"none", "fixed", "random", "progressive"}


def _rollout(x_init, steps, noise_seed, n=10):
    """Toy rollout: deterministic velocity, Flow-SDE inside the window, ODE outside."""
    sig = sde.make_grid(n, dtype=torch.float64)
    g = torch.Generator().manual_seed(noise_seed)
    xs = [x_init]
    x = x_init
    for k in range(n):
        v = torch.tanh(x) - 0.5 * x
        sampler = "flow_sde" if k in steps else "ode"
        coef = sde.sampler_coefficients(sampler, sig, k, noise_level=0.7)
        x = sde.sde_step(x, v, coef, generator=g).next_x if k in steps else sde.ode_step(x, v, sig[k], sig[k + 1]).next_x
        xs.append(x)
    return torch.stack(xs, 1)


def test_rollouts_bitwise_equal_outside_window():
    x_init = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    cfg = SdeWindowConfig(mode="fixed", size=2, lo=2)
    w = window_steps(cfg, num_steps=10)
    assert w == [2, 3]
    a, b = _rollout(x_init, w, 7), _rollout(x_init, w, 7)
    assert torch.equal(a, b)
    c = _rollout(x_init, w, 8)               # different window noise
    ode = _rollout(x_init, [], 7)             # no window at all
    assert torch.equal(a[:, : w[0] + 1], c[:, : w[0] + 1])
    assert torch.equal(a[:, : w[0] + 1], ode[:, : w[0] + 1])
    assert not torch.equal(a[:, w[0] + 1], c[:, w[0] + 1])
