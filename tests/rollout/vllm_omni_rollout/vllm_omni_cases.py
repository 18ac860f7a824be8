"""Shared cases of the vllm-omni tests: prompts, rollout settings and a generate request."""

from verl_diffusion.algos.windows import SdeWindowConfig
from verl_diffusion.rollout.diffusers_rollout import RolloutConfig

PROMPTS = ["a cat"] * 3 + ["the word ok"] * 3
GROUPS = [0, 0, 0, 1, 1, 1]
N = 6


def rollout_config(**kw) -> RolloutConfig:
    base = dict(num_steps=N, height=64, width=64, micro_batch_size=len(PROMPTS),
                window=SdeWindowConfig(mode="fixed", size=2, lo=1, hi=N))
    base.update(kw)
    return RolloutConfig(**base)


def generate_request(seed: int = 3, **kw) -> dict:
    """A generate request as docs/rollout_replicas.md §3 specifies it."""
    req = {"request_id": "t", "prompts": list(PROMPTS), "group_ids": list(GROUPS), "seed": seed, "iteration": 0,
           "global_steps": 0, "store_velocities": True, "branched": None}
    req.update(kw)
    return req
