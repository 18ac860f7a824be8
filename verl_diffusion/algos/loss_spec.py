"""The registry of per-timestep losses: name → (function, declared needs, config class). A loss module registers
itself with :func:`register_loss`; :mod:`verl_diffusion.algos.losses` loads the built-in ones and looks a loss up by
name. Interface: docs/loss_interface.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from verl_diffusion.algos.types import LossOutput, StateSource, StepBatch, StepNeeds, StepQuantities

# fn(q, batch, cfg) -> LossOutput
LossFn = Callable[[StepQuantities, StepBatch, Any], LossOutput]
# prepare(batch, cfg) -> batch: θ-independent pre-processing of one trained step over the *whole* rollout
# batch (complete groups), run once after advantages and before mini-batching (e.g. path-space ĝ).
PrepareFn = Callable[[StepBatch, Any], StepBatch]


# Fields every loss receives when the rollout batch carries them (a loss without a use for them ignores them).
OPTIONAL_BATCH_KEYS: tuple[str, ...] = ("step_advantages",)


@dataclass(frozen=True)
class LossSpec:
    """What the engine must know about a registered loss."""

    name: str
    fn: LossFn
    # θ-dependent quantities the engine computes (one trainable forward at most, plus optional no-grad ones).
    needs: StepNeeds
    # StepBatch fields the rollout / pre-processing must fill.
    batch_keys: tuple[str, ...]
    # Frozen dataclass of the loss's knobs; ``config()`` must give working defaults.
    config: type
    # Where item states come from (docs/algorithms.md §7.3). A config may override it when it has an ``xt_source`` field.
    state_source: StateSource = StateSource.TRAJECTORY
    # Optional per-step pre-processing over whole groups (see PrepareFn).
    prepare: Optional[PrepareFn] = None
    # StepBatch fields handed over when the batch has them and left None otherwise (never required), e.g. the
    # per-step process advantages of a branched TempFlow rollout (docs/algorithms.md §3.3).
    optional_batch_keys: tuple[str, ...] = OPTIONAL_BATCH_KEYS

    def needs_for(self, cfg: Any) -> StepNeeds:
        """Declared needs plus REF_VELOCITY when the config turns a reference KL on (``kl_coef > 0``)."""
        needs = self.needs
        if getattr(cfg, "kl_coef", 0.0) > 0:
            needs |= StepNeeds.REF_VELOCITY
        return needs

    def state_source_for(self, cfg: Any) -> StateSource:
        """The config's ``xt_source`` when it has one, else the loss's fixed source."""
        src = getattr(cfg, "xt_source", None)
        return StateSource(src) if src is not None else self.state_source


LOSSES: dict[str, LossSpec] = {}


def register_loss(name: str, *, needs: StepNeeds, batch_keys: tuple[str, ...], config: type,
                  state_source: StateSource = StateSource.TRAJECTORY,
                  prepare: Optional[PrepareFn] = None,
                  optional_batch_keys: tuple[str, ...] = OPTIONAL_BATCH_KEYS) -> Callable[[LossFn], LossFn]:
    """Decorator: register ``fn`` under ``name``. Re-registering a different function raises."""

    def wrap(fn: LossFn) -> LossFn:
        spec = LossSpec(name, fn, needs, tuple(batch_keys), config, state_source, prepare,
                        tuple(optional_batch_keys))
        old = LOSSES.get(name)
        if old is not None and old.fn is not fn:
            raise KeyError(f"loss {name!r} is already registered by {old.fn.__module__}.{old.fn.__qualname__}")
        LOSSES[name] = spec
        return fn

    return wrap
