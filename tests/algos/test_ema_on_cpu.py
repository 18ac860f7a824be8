"""SPEC §8 checks 1–4: evaluation EMA and old-policy averaging (verl_diffusion/algos/ema.py)."""

import pytest
import torch

from verl_diffusion.algos.ema import (ParamEMA, awm_kl_ema_decay, ema_decay, nft_old_policy_decay,
                                      soft_update_)


def test_ema_decay_warmup_values():
    assert ema_decay(0, decay_max=0.9) == pytest.approx(0.1)
    assert ema_decay(7, decay_max=0.9) == pytest.approx(8 / 17)
    assert ema_decay(79, decay_max=0.9) == pytest.approx(80 / 89)
    assert ema_decay(79, decay_max=0.9) < 0.9
    assert ema_decay(80, decay_max=0.9) == pytest.approx(0.9)  # warm-up ends at n = 80
    assert ema_decay(10_000, decay_max=0.99) == 0.99


def test_check1_interval1_first_step_gives_0p9():
    theta = torch.ones(3, dtype=torch.float64, requires_grad=True)
    ema = ParamEMA([theta], decay_max=0.9, interval=1)
    ema.shadow[0].zero_()
    assert ema.step(0) == pytest.approx(0.1)
    torch.testing.assert_close(ema.shadow[0], torch.full((3,), 0.9, dtype=torch.float64), atol=1e-15, rtol=0)
    # one more step: θ̄ = 0.9 + (1 − 2/11)·0.1
    ema.step(1)
    assert ema.shadow[0][0].item() == pytest.approx(0.9 + (1 - 2 / 11) * 0.1, abs=1e-15)


def test_check2_interval8_first_update_at_n7():
    theta = torch.ones(2, dtype=torch.float64)
    ema = ParamEMA([theta], decay_max=0.9, interval=8)
    ema.shadow[0].zero_()
    for n in range(7):
        assert ema.step(n) is None
        assert torch.equal(ema.shadow[0], torch.zeros(2, dtype=torch.float64))
    assert ema.step(7) == pytest.approx(8 / 17)
    assert ema.shadow[0][0].item() == pytest.approx(1 - 8 / 17, abs=1e-15)
    assert ema.step(8) is None and ema.step(14) is None
    assert ema.step(15) == pytest.approx(16 / 25)


def test_check3_nft_type2_schedule():
    assert nft_old_policy_decay(2, 74) == 0.0
    assert nft_old_policy_decay(2, 76) == pytest.approx(0.0075)
    assert nft_old_policy_decay(2, 208) == pytest.approx(0.9975)
    assert nft_old_policy_decay(2, 209) == pytest.approx(0.999)
    assert nft_old_policy_decay(0, 500) == 0.0
    assert nft_old_policy_decay(1, 100) == pytest.approx(0.1)
    assert nft_old_policy_decay(1, 10_000) == 0.5
    with pytest.raises(ValueError, match=r"schedule_type=3.*\[0, 1, 2\]"):
        nft_old_policy_decay(3, 0)


def test_awm_kl_ema_decay():
    assert awm_kl_ema_decay("linear", 100) == pytest.approx(0.1)
    assert awm_kl_ema_decay("linear", 1000) == 0.3
    assert awm_kl_ema_decay("constant", 0) == 0.3
    assert awm_kl_ema_decay("constant", 5, decay_max=0.5) == 0.5
    with pytest.raises(ValueError, match="mode='cosine'"):
        awm_kl_ema_decay("cosine", 0)


def test_check4_swap_in_restores_bitwise():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in lin.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    ema = ParamEMA(lin.parameters(), decay_max=0.9, interval=1)
    before = [p.detach().clone() for p in lin.parameters()]
    with torch.no_grad():
        for p in lin.parameters():
            p.add_(torch.randn(p.shape, generator=g) / 3)
    ema.step(0)
    after_update = [p.detach().clone() for p in lin.parameters()]
    with ema.swap_in():
        for p, s in zip(lin.parameters(), ema.shadow):
            assert torch.equal(p, s)
        assert not torch.equal(lin.weight, after_update[0])
    for p, a in zip(lin.parameters(), after_update):
        assert torch.equal(p, a)
    with pytest.raises(RuntimeError):
        with ema.swap_in():
            raise RuntimeError("eval failed")
    for p, a in zip(lin.parameters(), after_update):
        assert torch.equal(p, a)
    assert not torch.equal(before[0], after_update[0])


def test_state_dict_roundtrip_and_shape_check():
    theta = torch.arange(4.0)
    ema = ParamEMA([theta], decay_max=0.99, interval=2)
    ema.shadow[0].fill_(7.0)
    sd = ema.state_dict()
    other = ParamEMA([torch.zeros(4)], decay_max=0.9, interval=8)
    other.load_state_dict(sd)
    assert torch.equal(other.shadow[0], torch.full((4,), 7.0))
    assert other.decay_max == 0.99 and other.interval == 2
    with pytest.raises(ValueError, match="shape"):
        ParamEMA([torch.zeros(5)]).load_state_dict(sd)


def test_soft_update():
    tgt = [torch.zeros(3, dtype=torch.float64)]
    src = [torch.ones(3, dtype=torch.float64)]
    soft_update_(tgt, src, decay=0.25)
    torch.testing.assert_close(tgt[0], torch.full((3,), 0.75, dtype=torch.float64), atol=1e-15, rtol=0)
    soft_update_(tgt, src, decay=1.0)
    assert tgt[0][0].item() == pytest.approx(0.75)
    src2 = [torch.randn(3, dtype=torch.float64)]
    soft_update_(tgt, src2, decay=0.0)
    assert torch.equal(tgt[0], src2[0])
    with pytest.raises(ValueError, match="decay=1.5"):
        soft_update_(tgt, src, decay=1.5)
