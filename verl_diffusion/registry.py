"""The only module that touches verl's registries.

``register_all()`` is called by ``verl_diffusion.plugin`` (the ``verl.plugins`` entry point) in every
process that imports verl, Ray workers included. Order matters: the CPU platform is registered before
anything imports ``verl.workers.engine``, whose FSDP module reads the device name at import time.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from verl_diffusion.algos.losses import LOSSES, LossSpec, load_builtin_losses
from verl_diffusion.algos.ratio_losses import KL_BATCH_KEYS
from verl_diffusion.algos.types import StepBatch, StepNeeds, StepQuantities

# The advantage estimators we add to verl's `algorithm.adv_estimator`.
ADV_ESTIMATORS = ("flow_grpo", "flow_grpo_gdpo", "flow_grpo_batch")

_REGISTERED: list[str] = []
_DONE = False


def registered() -> list[str]:
    """What register_all() registered, as 'kind:name' lines (for ``python -m verl_diffusion.check``)."""
    return list(_REGISTERED)


def register_all() -> None:
    """Register platform, advantage estimators, policy losses, engine and reward managers. Idempotent."""
    global _DONE
    if _DONE:
        return
    _register_platform()
    _register_advantage_estimators()
    _register_policy_losses()
    _register_engine()
    _register_reward_managers()
    _register_diffusers_rollout()
    _register_vllm_omni_rollout()
    _register_checkpoint_engine()
    _register_trainers()
    _DONE = True


# ----------------------------------------------------------------------------------------------------
# Platform and engine


def _register_trainers() -> None:
    """verl's V1 trainer registry gets ``diffusion_sync`` and ``diffusion_async`` (``trainer.v1.trainer_mode``), so
    verl's own entry point can select them after a plain ``import verl`` (about 0.5 s on top of verl's own import,
    docs/benchmarks.md)."""
    import verl_diffusion.trainer.async_trainer  # noqa: F401  (the modules register at import)

    _REGISTERED.extend(["trainer:diffusion_sync", "trainer:diffusion_async"])


def _register_platform() -> None:
    from verl_diffusion.workers.platform_cpu import register_cpu_platform

    register_cpu_platform()
    _REGISTERED.append("platform:cpu")


def _register_diffusers_rollout() -> None:
    """The colocated ``diffusers`` replica (verl's ``RolloutReplicaRegistry``, loaded lazily) and its in-worker adapter
    (verl's ``_ROLLOUT_REGISTRY`` dict, which has no register function; tests check it in every Ray worker)."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    def load_diffusers():
        from verl_diffusion.rollout.diffusers_replica import load_diffusers_replica

        return load_diffusers_replica()

    RolloutReplicaRegistry.register("diffusers", load_diffusers)
    rollout_base._ROLLOUT_REGISTRY[("diffusers", "async")] = \
        "verl_diffusion.rollout.diffusers_replica.DiffusersRolloutAdapter"
    _REGISTERED.extend(["rollout_replica:diffusers", "rollout_adapter:diffusers"])


def _register_vllm_omni_rollout() -> None:
    """The ``vllm_omni`` replica (verl's ``RolloutReplicaRegistry``; the loader imports it lazily) and its in-worker
    adapter (verl's ``_ROLLOUT_REGISTRY`` dict, which has no register function). docs/rollout_replicas.md §1.
    Neither imports vllm-omni here: a process without it can still name the replica and get a clear error later."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    def load_vllm_omni():
        from verl_diffusion.rollout.vllm_omni.replica import VllmOmniReplica

        return VllmOmniReplica

    RolloutReplicaRegistry.register("vllm_omni", load_vllm_omni)
    rollout_base._ROLLOUT_REGISTRY[("vllm_omni", "async")] = \
        "verl_diffusion.rollout.vllm_omni.replica.VllmOmniServerAdapter"
    _REGISTERED.extend(["rollout_replica:vllm_omni", "rollout_adapter:vllm_omni"])


def _register_checkpoint_engine() -> None:
    """``diffusion_gloo`` in verl's ``CheckpointEngineRegistry``: weight sync to standalone / async diffusers
    replicas, on CPU and GPU (rollout/checkpoint_engine.py)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry

    from verl_diffusion.rollout.checkpoint_engine import BACKEND, engine_class

    CheckpointEngineRegistry.register(BACKEND)(engine_class())
    _REGISTERED.append(f"checkpoint_engine:{BACKEND}")


def _register_engine() -> None:
    from verl_diffusion.workers.engine import register_engines

    for line in register_engines() or ["engine:diffusion_model"]:
        _REGISTERED.append(line)


def _register_reward_managers() -> None:
    from verl_diffusion.rewards.manager import register_reward_managers

    for name in register_reward_managers() or ["diffusion"]:
        _REGISTERED.append(f"reward_manager:{name}")


# ----------------------------------------------------------------------------------------------------
# Advantage estimators (docs/algorithms.md §2) in verl's calling convention


def _knob(config: Any, name: str, default: Any) -> Any:
    """Read an optional knob from verl's algorithm config (DictConfig, dict, dataclass or None).

    verl's AlgoConfig has no fields for our knobs; recipes put them under ``algorithm.flow_grpo``.
    The defaults here are docs/algorithms.md §2.1's and are documented in docs/training.md.
    """
    if config is None:
        return default
    sub = config.get("flow_grpo", None) if hasattr(config, "get") else getattr(config, "flow_grpo", None)
    for src in (sub, config):
        if src is None:
            continue
        val = src.get(name, None) if hasattr(src, "get") else getattr(src, name, None)
        if val is not None:
            return val
    return default


def _sample_rewards(sample_level_rewards: Optional[torch.Tensor], token_level_rewards: Optional[torch.Tensor]):
    if sample_level_rewards is not None:
        return sample_level_rewards.reshape(-1).float()
    if token_level_rewards is not None:
        # verl's generic path passes token-level rewards; an outcome reward is their sum per sample.
        return token_level_rewards.sum(dim=-1).float()
    raise ValueError("advantage estimator needs sample_level_rewards [B] (or token_level_rewards [B, T])")


def _broadcast(adv: torch.Tensor, response_mask: Optional[torch.Tensor]) -> torch.Tensor:
    from verl_diffusion.algos.advantages import broadcast_to_steps

    if response_mask is None:
        return adv.unsqueeze(-1)
    return broadcast_to_steps(adv, response_mask)


def flow_grpo_advantage(sample_level_rewards=None, response_mask=None, index=None, config=None,
                        token_level_rewards=None, **_: Any):
    """verl adapter of docs/algorithms.md §2.1: per-prompt mean, std over *samples*, broadcast after normalisation.

    Args: sample_level_rewards [B]; response_mask [B, T]; index: per-sample group uid (len B).
    Returns: (advantages [B, T], returns [B, T]) — returns equal advantages, as in verl's GRPO.
    """
    from verl_diffusion.algos.advantages import group_advantages, group_ids_from_uids

    rewards = _sample_rewards(sample_level_rewards, token_level_rewards)
    if index is None:
        raise ValueError("flow_grpo advantages need `index` (the group uid of each sample)")
    std_mode = _knob(config, "std_mode", None)
    if std_mode is None:
        norm = _knob(config, "norm_adv_by_std_in_grpo", True)
        global_std = _knob(config, "global_std", True)
        std_mode = "none" if not norm else ("global" if global_std else "group")
    adv = group_advantages(
        rewards, group_ids_from_uids(index).to(rewards.device), std_mode=std_mode,
        eps=float(_knob(config, "adv_eps", 1e-4)), clip=float(_knob(config, "adv_clip_max", 5.0)),
        ddof=int(_knob(config, "std_ddof", 0)),
    )
    out = _broadcast(adv, response_mask)
    return out, out


def flow_grpo_gdpo_advantage(sample_level_rewards=None, response_mask=None, index=None, config=None,
                             batch=None, reward_components=None, **_: Any):
    """verl adapter of docs/algorithms.md §2.2 `gdpo`: per-reward group normalisation, weighted sum, batch whitening.

    Components come from ``reward_components`` [B, M] or from ``batch['reward_components/<name>']``.
    """
    from verl_diffusion.algos.advantages import gdpo_advantages, group_ids_from_uids

    if reward_components is None and batch is not None:
        keys = sorted(k for k in batch.keys() if str(k).startswith("reward_components/"))
        if keys:
            reward_components = torch.stack([batch[k].reshape(-1).float() for k in keys], dim=-1)
    if reward_components is None:
        if sample_level_rewards is None:
            raise ValueError("flow_grpo_gdpo needs reward components [B, M] (batch 'reward_components/<name>')")
        reward_components = sample_level_rewards.reshape(-1, 1).float()
    if index is None:
        raise ValueError("flow_grpo_gdpo advantages need `index` (the group uid of each sample)")
    weights = _knob(config, "gdpo_reward_weights", None)
    adv = gdpo_advantages(
        reward_components.float(), group_ids_from_uids(index).to(reward_components.device),
        weights=None if weights is None else torch.tensor(list(weights), dtype=torch.float32),
        clip=float(_knob(config, "adv_clip_max", 5.0)),
    )
    out = _broadcast(adv, response_mask)
    return out, out


def flow_grpo_batch_advantage(sample_level_rewards=None, response_mask=None, config=None,
                              token_level_rewards=None, **_: Any):
    """verl adapter of docs/algorithms.md §2.1 mode `batch` (no grouping; for G = 1 by design)."""
    from verl_diffusion.algos.advantages import batch_advantages

    rewards = _sample_rewards(sample_level_rewards, token_level_rewards)
    adv = batch_advantages(rewards, eps=float(_knob(config, "adv_eps", 1e-4)),
                           clip=float(_knob(config, "adv_clip_max", 5.0)))
    out = _broadcast(adv, response_mask)
    return out, out


def _register_advantage_estimators() -> None:
    from verl.trainer.ppo.core_algos import register_adv_est

    for name, fn in zip(ADV_ESTIMATORS, (flow_grpo_advantage, flow_grpo_gdpo_advantage, flow_grpo_batch_advantage)):
        register_adv_est(name)(fn)
        _REGISTERED.append(f"adv_estimator:{name}")


# ----------------------------------------------------------------------------------------------------
# Policy losses


class VerlPolicyLoss:
    """A registered loss in verl's policy-loss calling convention.

    verl's ``PolicyLossFn`` sees only token log-probs. Losses that need nothing else (``flow_grpo``,
    ``dance_grpo``) run through it unchanged: items = positions where ``response_mask`` is 1. Losses that
    need velocities, means, states or a reference KL (``kl_coef > 0``) run per timestep in our diffusion engine
    (``verl_diffusion.workers.step_loss``), which reads ``.spec``; calling them here raises one line
    saying so.
    """

    def __init__(self, spec: LossSpec):
        self.spec = spec
        self.__name__ = f"verl_diffusion_{spec.name}"

    def __call__(self, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                 config=None, rollout_is_weights=None, **_: Any):
        knobs = _loss_knobs(config, self.spec)
        cfg = self.spec.config(**knobs)
        needs = self.spec.needs_for(cfg)
        # The KL fields are declared by every ratio loss but read only when kl_coef > 0 (REF_VELOCITY).
        token_keys = {"advantages", "old_log_prob"} | set(KL_BATCH_KEYS)
        if needs & ~(StepNeeds.LOG_PROB | StepNeeds.VELOCITY) or not set(self.spec.batch_keys) <= token_keys:
            raise ValueError(
                f"loss_mode={self.spec.name!r} needs per-timestep quantities {needs} and batch fields "
                f"{self.spec.batch_keys}; it runs inside the diffusion engine (model_type=diffusion_model), "
                "not through verl's token policy-loss call")
        mask = response_mask.bool()
        batch = StepBatch(advantages=advantages[mask], old_log_prob=old_log_prob[mask])
        out = self.spec.fn(StepQuantities(log_prob=log_prob[mask]), batch, cfg)
        return out.loss, out.metrics


def _loss_knobs(config: Any, spec: LossSpec) -> dict:
    """Knobs for the loss config dataclass from ``actor.policy_loss`` (only fields the dataclass has)."""
    import dataclasses

    if config is None:
        return {}
    pl = config.get("policy_loss", None) if hasattr(config, "get") else getattr(config, "policy_loss", None)
    if pl is None:
        return {}
    names = {f.name for f in dataclasses.fields(spec.config)}
    out = {}
    for n in names:
        val = pl.get(n, None) if hasattr(pl, "get") else getattr(pl, n, None)
        if val is not None:
            out[n] = val
    return out


def _register_policy_losses() -> None:
    from verl.trainer.ppo.core_algos import register_policy_loss

    load_builtin_losses()
    for name, spec in sorted(LOSSES.items()):
        register_policy_loss(name)(VerlPolicyLoss(spec))
        _REGISTERED.append(f"policy_loss:{name}")

