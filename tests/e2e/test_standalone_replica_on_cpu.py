"""Training through a standalone diffusers replica (its own Ray process, weights through the ``diffusion_gloo``
checkpoint engine every step) on CPU, LoRA and full fine-tune, against the colocated replica; one Ray session,
shared with the other e2e modules' in-process runs (tests/e2e/standalone_smoke.py, tests/e2e/conftest.py).

Standalone runs get one replica per actor worker (full fine-tune: 2, LoRA: 1): replica r samples the rows colocated
worker r would, with the same seed, so once the replicas' weights equal the actor's the two runs are the same
computation. Claims:
1. after every sync (the initial one and one per step) every replica's transformer equals the actor's bitwise, and
   reports the step as its weights version;
2. the train/rollout consistency metric ``rollout/logprob_abs_diff`` is exactly 0, and the batch of step k was
   sampled with the weights of step k − 1 (on-policy: the sync follows each update);
3. the reward of every step equals the colocated run's (so it moves exactly as there);
4. a full sync moves the whole transformer, a LoRA sync only the adapter tensors;
5. async (``diffusion_async``, LoRA): batch k ≥ 2 was sampled with the weights of step k − 2 while the actor trained
   on batch k − 1 (overlap ratio > 0), the first micro-step's log-ratio is exactly 0 at step 1 and nonzero after (old
   log-probs are the rollout's, SPEC §0.4), and the replica still equals the actor after every sync.
"""

import pytest

# full fine-tune: 2 actor workers and 2 replicas (rank 1 gathers shards outside the broadcast; two receivers)
CASES = ["co_full:colocated:0:sync:2", "sa_full:standalone:0:sync:2", "co_lora:colocated:4", "sa_lora:standalone:4",
         "as_lora:standalone:4:async"]


SESSION_CASES = [{"kind": "standalone", "case": case} for case in CASES]


@pytest.fixture(scope="module")
def runs(session_runs) -> dict:
    """The standalone-smoke rows of the e2e suite's shared Ray session (tests/e2e/conftest.py)."""
    out = {session_runs[("standalone", case)]["name"]: session_runs[("standalone", case)] for case in CASES}
    for name, row in out.items():
        assert "error" not in row, (name, row["error"])
    return out


@pytest.mark.parametrize("name", ["sa_full", "sa_lora", "as_lora"])
def test_replica_weights_equal_actor_after_every_sync(runs, name):
    probes = runs[name]["probes"]
    steps = len(runs[name]["history"])
    assert [p["step"] for p in probes] == list(range(steps + 1))     # the initial sync + one per step
    for p in probes:
        assert p["keys_equal"] and p["bitwise_equal"] and p["max_abs_diff"] == 0.0, p
        assert p["replica_version"] == p["step"]
        assert p["replicas"] == runs[name]["workers"]


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_consistency_zero_and_reward_identical_to_colocated(runs, kind):
    sa, co = runs[f"sa_{kind}"]["history"], runs[f"co_{kind}"]["history"]
    assert len(sa) == len(co) >= 2
    for s, c in zip(sa, co):
        assert s["rollout/logprob_abs_diff"] == 0.0, s["step"]
        assert s["rollout/weights_version"] == s["step"] - 1
        assert s["reward/mean"] == c["reward/mean"], (s["step"], s["reward/mean"], c["reward/mean"])
        assert s["loss"] == c["loss"]


def test_full_sync_moves_the_transformer_lora_sync_only_the_adapter(runs):
    full = [p["sync"] for p in runs["sa_full"]["probes"]]
    lora = [p for p in runs["sa_lora"]["probes"]]
    assert all(s["weight_sync/bytes"] == full[0]["weight_sync/bytes"] > 0 for s in full)
    for p in lora:
        assert p["replica_sync"]["weight_sync/lora_only"] == 1.0
        assert p["sync"]["weight_sync/bytes"] == p["replica_sync"]["weight_sync/received_bytes"]
    ratio = full[0]["weight_sync/bytes"] / lora[0]["sync"]["weight_sync/bytes"]
    print(f"bytes per sync: full {full[0]['weight_sync/bytes']:.0f}, LoRA r4 {lora[0]['sync']['weight_sync/bytes']:.0f}"
          f" ({ratio:.1f}x less)")
    assert ratio > 10


def test_async_samples_one_step_stale_and_trains_off_policy(runs):
    rows = runs["as_lora"]["history"]
    assert len(rows) >= 3
    first, later = rows[0], rows[1:]
    assert first["rollout/weights_version"] == 0 and first["async/overlap_ratio"] == 0.0
    assert first["actor/first_micro_log_ratio_abs_max"] == 0.0 and first["rollout/logprob_abs_diff"] == 0.0
    for r in later:
        assert r["rollout/weights_version"] == r["step"] - 2, r["step"]
        assert r["async/overlap_ratio"] > 0.0, r["step"]
        # θ_old = the sampler's weights (one update behind the actor): ratio ≠ 1, small (one LoRA step)
        assert 0.0 < r["actor/first_micro_log_ratio_abs_max"] < 1e-2, r["step"]
    # the first step is the sync run's first step (same seeds, same initial weights, nothing stale yet)
    assert first["reward/mean"] == runs["sa_lora"]["history"][0]["reward/mean"]
