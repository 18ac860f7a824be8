"""SPEC §2 checks for verl_diffusion.algos.advantages (numbers from SPEC)."""

import pytest
import torch

from verl_diffusion.algos.advantages import (
    DANCE_GRPO_PRESET,
    STD_MODES,
    advantage_metrics,
    batch_advantages,
    broadcast_to_steps,
    dance_grpo_advantages,
    gdpo_advantages,
    group_advantages,
    group_ids_from_uids,
    sum_advantages,
)

D = torch.float64
REWARDS = torch.tensor([0, 1, 2, 3, 5, 5, 5, 5, 7], dtype=D)
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2])


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=D), torch.as_tensor(b, dtype=D), rtol=0, atol=tol)


# --- check 1 -------------------------------------------------------------------------------------------

def test_check1_global_std():
    assert abs(REWARDS.std(unbiased=False).item() - 2.160247) < 1e-6
    close(group_advantages(REWARDS, GROUPS, std_mode="global"),
          [-0.694333, -0.231444, 0.231444, 0.694333, 0, 0, 0, 0, 0])


def test_check1_group_std():
    close(group_advantages(REWARDS, GROUPS, std_mode="group"),
          [-1.341521, -0.447174, 0.447174, 1.341521, 0, 0, 0, 0, 0])


def test_singleton_group_is_zero_not_r_over_sigma():
    # The singleton (reward 7) must be exactly 0 in every mode, also with ddof = 1.
    for mode in STD_MODES:
        for ddof in (0, 1):
            a = group_advantages(REWARDS, GROUPS, std_mode=mode, ddof=ddof)
            assert a[-1].item() == 0.0
            assert torch.isfinite(a).all()


def test_none_mode_is_centred_reward():
    close(group_advantages(REWARDS, GROUPS, std_mode="none"), [-1.5, -0.5, 0.5, 1.5, 0, 0, 0, 0, 0], 1e-12)


def test_group_ids_need_not_be_sorted_or_contiguous():
    perm = torch.tensor([8, 3, 5, 0, 1, 7, 2, 6, 4])
    labels = torch.tensor([10, 10, 10, 10, -3, -3, -3, -3, 99])
    a = group_advantages(REWARDS, GROUPS, std_mode="group")
    b = group_advantages(REWARDS[perm], labels[perm], std_mode="group")
    close(b, a[perm], 1e-12)


# --- check 2 -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", STD_MODES)
def test_check2_group_sums_zero_before_clipping(mode):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(24, generator=g, dtype=D)
    ids = torch.arange(6).repeat_interleave(4)
    a = group_advantages(r, ids, std_mode=mode, clip=None)
    sums = torch.zeros(6, dtype=D).index_add_(0, ids, a)
    close(sums, torch.zeros(6), 1e-12)


# --- check 3 -------------------------------------------------------------------------------------------

def test_check3_independent_of_number_of_steps():
    a = group_advantages(REWARDS, GROUPS, std_mode="global")
    out1 = broadcast_to_steps(a, torch.ones(9, 1, dtype=torch.int32))
    out10 = broadcast_to_steps(a, torch.ones(9, 10, dtype=torch.int32))
    assert torch.equal(out1[:, 0], a)
    assert torch.equal(out10, a.unsqueeze(1).expand(9, 10))
    mask = torch.zeros(9, 10, dtype=torch.bool)
    mask[:, 2:5] = True
    out = broadcast_to_steps(a, mask)
    assert torch.equal(out[:, 2:5], a.unsqueeze(1).expand(9, 3)) and (out[:, :2] == 0).all()
    with pytest.raises(ValueError, match="one per sample"):
        group_advantages(REWARDS.unsqueeze(1).expand(9, 10), GROUPS)


# --- check 4 -------------------------------------------------------------------------------------------

R2 = torch.tensor([[1, 0.6], [0, 0.2], [1, 0.3], [1, 0.9]], dtype=D)
G2 = torch.tensor([1, 1, 2, 2])


def test_check4_gdpo():
    # S before whitening: reproduce step (1)+(2) with group_advantages(group, ddof 0, eps 1e-6, no clip).
    s = sum(group_advantages(R2[:, m], G2, std_mode="group", eps=1e-6, clip=None) for m in range(2))
    close(s, [2, -2, -1, 1], 1e-5)
    close(gdpo_advantages(R2, G2), [1.264911, -1.264911, -0.632456, 0.632456])


def test_check4_sum_global():
    close(sum_advantages(R2, G2, std_mode="global"), [1.089729, -1.089729, -0.467027, 0.467027])


def test_multi_reward_weights():
    w = [2.0, 0.5]
    close(sum_advantages(R2, G2, weights=w), group_advantages(R2 @ torch.tensor(w, dtype=D), G2), 1e-12)
    with pytest.raises(ValueError, match="weights has 3 entries"):
        gdpo_advantages(R2, G2, weights=[1, 1, 1])


# --- check 5 -------------------------------------------------------------------------------------------

def test_check5_clipping_exact():
    r = torch.tensor([0.0] * 99 + [100.0], dtype=D)
    ids = torch.zeros(100, dtype=torch.long)
    a = group_advantages(r, ids, std_mode="global")
    assert a[-1].item() == 5.0
    assert group_advantages(-r, ids, std_mode="global")[-1].item() == -5.0
    assert group_advantages(r, ids, std_mode="global", clip=None)[-1].item() > 5.0
    assert batch_advantages(r)[-1].item() == 5.0


# --- other modes, presets, metrics, errors -------------------------------------------------------------

def test_bad_clip_raises():
    with pytest.raises(ValueError, match="A_max > 0"):
        group_advantages(REWARDS, GROUPS, clip=0.0)


def test_batch_mode():
    r = torch.tensor([1.0, 2.0, 4.0], dtype=D)
    close(batch_advantages(r), (r - r.mean()) / (r.std(unbiased=False) + 1e-4), 1e-12)


def test_dance_grpo_preset():
    assert DANCE_GRPO_PRESET == {"std_mode": "group", "ddof": 1, "eps": 1e-8}
    a = dance_grpo_advantages(REWARDS, GROUPS)
    g0 = REWARDS[:4]
    close(a[:4], (g0 - g0.mean()) / (g0.std(unbiased=True) + 1e-8), 1e-12)
    assert (a[4:] == 0).all()


def test_nan_reward_names_sample():
    r = REWARDS.clone()
    r[6] = float("nan")
    with pytest.raises(ValueError, match="sample 6"):
        group_advantages(r, GROUPS)
    r2 = R2.clone()
    r2[2, 1] = float("inf")
    with pytest.raises(ValueError, match="sample 2, reward component 1"):
        gdpo_advantages(r2, G2)


def test_bad_std_mode_lists_choices():
    with pytest.raises(ValueError, match=r"choose one of \['global', 'group', 'none'\]"):
        group_advantages(REWARDS, GROUPS, std_mode="batchwise")


def test_metrics_and_uids():
    ids = group_ids_from_uids(["a", "a", "a", "a", "b", "b", "b", "b", "c"])
    assert ids.dtype == torch.long and ids.tolist() == GROUPS.tolist()
    a = group_advantages(REWARDS, ids)
    m = advantage_metrics(REWARDS, ids, a)
    assert all(isinstance(v, float) for v in m.values())
    assert abs(m["reward/mean"] - 33 / 9) < 1e-12
    assert abs(m["reward/std"] - 2.160247) < 1e-6
    assert abs(m["reward/zero_std_ratio"] - 2 / 3) < 1e-12  # group b and singleton c
    assert abs(m["actor/adv_abs_mean"] - a.abs().mean().item()) < 1e-12


# ---------------------------------------------------------------- TempFlow process advantages (SPEC §3.3)

from verl_diffusion.algos.advantages import branched_step_advantages, process_advantages  # noqa: E402

# [P = 2, K_b = 3, S = 2]: children along dim 1.
PROC = torch.tensor([[[1, 4], [2, 4], [3, 4]],
                     [[0, 1], [10, 1], [0, 2]]], dtype=D)
# By hand: (prompt 0, k 0) = [1, 2, 3]: σ = √(2/3) = 0.8164966 → ±1/(σ + 1e-4) = ±1.224595;
# (0, 1) all equal → 0; (1, 0) = [0, 10, 0]: mean 10/3, σ = √(200/9) = 4.714045 → −0.707092, 1.414184;
# (1, 1) = [1, 1, 2]: mean 4/3, σ = √2/3 = 0.4714045 → −0.706957, 1.413914.
PROC_A = torch.tensor([[[-1.224595, 0], [0, 0], [1.224595, 0]],
                       [[-0.707092, -0.706957], [1.414184, -0.706957], [-0.707092, 1.413914]]], dtype=D)


def test_process_advantages_dense_hand_numbers():
    a = process_advantages(PROC)
    assert a.shape == PROC.shape
    close(a, PROC_A, 1e-6)
    close(a.sum(dim=1), torch.zeros(2, 2, dtype=D), 1e-12)          # Σ over children = 0 per (prompt, k)
    # One child per (prompt, k) → 0 (its own mean), never r/σ.
    assert torch.equal(process_advantages(PROC[:, :1]), torch.zeros(2, 1, 2, dtype=D))


def test_process_advantages_flat_equals_dense_in_any_order():
    p_ids = torch.arange(2).view(2, 1, 1).expand(2, 3, 2).reshape(-1)
    k_ids = torch.tensor([3, 7]).view(1, 1, 2).expand(2, 3, 2).reshape(-1)   # labels need not be 0..S−1
    flat = PROC.reshape(-1)
    perm = torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(0))
    a = process_advantages(flat[perm], p_ids[perm], k_ids[perm])
    close(a, PROC_A.reshape(-1)[perm], 1e-6)
    with pytest.raises(ValueError, match="both prompt_ids and branch_step"):
        process_advantages(flat, p_ids)
    with pytest.raises(ValueError, match=r"\[P, K_b, S\]"):
        process_advantages(flat)


def test_process_advantages_clip():
    r = torch.zeros(1, 30, 1, dtype=D)
    r[0, 0, 0] = 1.0                                 # one outlier among 30: |A| = √29 ≈ 5.39 → clipped
    a = process_advantages(r)
    assert a[0, 0, 0] == 5.0 and a.max() == 5.0
    assert process_advantages(r, clip=None)[0, 0, 0] > 5.3


def test_branched_step_advantages_places_at_branch_step():
    rewards = torch.tensor([1, 2, 3, 4, 0, 10, 0, 5], dtype=D)
    prompt_ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    branch_step = torch.tensor([0, 0, 2, 2, 0, 0, 0, 1])
    sa = branched_step_advantages(rewards, prompt_ids, branch_step, 4)
    assert sa.shape == (8, 4)
    at_k = torch.nn.functional.one_hot(branch_step, 4).bool()
    assert torch.all(sa[~at_k] == 0) and torch.all(sa[:7][at_k[:7]] != 0)    # only at k
    s = 0.5 / (0.5 + 1e-4)                          # pairs (1, 2) and (3, 4): r − m = ±0.5, σ = 0.5
    close(sa[:4].sum(dim=1), torch.tensor([-s, s, -s, s], dtype=D), 1e-12)
    close(sa[4:7, 0], torch.tensor([-0.707092, 1.414184, -0.707092], dtype=D), 1e-6)
    assert torch.all(sa[7] == 0)                    # singleton (prompt 1, k 1) → 0
    with pytest.raises(ValueError, match="outside"):
        branched_step_advantages(rewards, prompt_ids, branch_step, 2)
