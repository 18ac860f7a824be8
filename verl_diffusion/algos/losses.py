"""The catalogue of per-timestep losses by name: :func:`get_loss_spec` (loading the built-in loss modules first);
the registry itself (:class:`LossSpec`, :func:`register_loss`) is :mod:`verl_diffusion.algos.loss_spec`.

A loss module registers itself with :func:`register_loss`; ``verl_diffusion/registry.py`` forwards the
names into verl's ``register_policy_loss`` and the engine looks the spec up with :func:`get_loss_spec`.
Interface: docs/loss_interface.md.
"""

from __future__ import annotations

from verl_diffusion.algos.checks import check_choice
from verl_diffusion.algos.loss_spec import (  # noqa: F401  (re-exported: the catalogue's public names)
    LOSSES, OPTIONAL_BATCH_KEYS, LossFn, LossSpec, PrepareFn, register_loss)


def get_loss_spec(name: str) -> LossSpec:
    """Look up a loss by name; loads the built-in loss modules first."""
    load_builtin_losses()
    check_choice("actor_rollout_ref.actor.policy_loss.loss_mode", name, LOSSES)
    return LOSSES[name]


def load_builtin_losses() -> None:
    """Import the modules whose decorators fill :data:`LOSSES` (idempotent)."""
    from verl_diffusion.algos import matching_losses, path_space, ratio_losses  # noqa: F401
