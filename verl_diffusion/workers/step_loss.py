"""Per-timestep glue between a rollout batch and a registered loss (docs/data_flow.md).

Rows of the rollout batch are samples; a loss sees *items* = (sample, trained step) pairs. For one trained
step ``k`` this module

* builds the θ-independent :class:`~verl_diffusion.algos.types.StepBatch` with only the fields the loss
  declares (``LossSpec.batch_keys``) — :func:`build_step_batch`;
* computes the θ-dependent :class:`~verl_diffusion.algos.types.StepQuantities` for the declared
  :class:`~verl_diffusion.algos.types.StepNeeds` only, through the shared SDE kernel ``algos.sde`` (so the
  on-policy log-prob is bitwise the rollout's) — :func:`compute_step_quantities`.

The velocity itself comes from a callable ``velocity_fn(x_t [B,*], t [B], rows) -> v [B,*]`` given by the
engine (the model adapter's ``velocity`` on the FSDP-wrapped transformer), so nothing here knows the model.
Pure torch plus ``verl_diffusion.algos``; no verl, no Ray.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from verl_diffusion.algos.losses import LossSpec, get_loss_spec
from verl_diffusion.algos.types import LossOutput, StateSource, StepBatch, StepNeeds, StepQuantities

# velocity_fn(x_t [B,*], t [B], rows: Mapping[str, Tensor] of the same B rows) -> v [B,*]
VelocityFn = Callable[[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]

# Keys that per-step preparation adds to a rollout batch ([B, N, *] or [B, N]); see prepare_steps().
PREP_PREFIX = "prep/"


@dataclass
class DiffusionStepLoss:
    """A registered loss bound to its config: what the engine calls per (micro-batch, trained step).

    Built once per worker from ``actor.policy_loss`` (``loss_mode`` + knobs) with :func:`make_step_loss`.
    """

    spec: LossSpec
    cfg: Any
    # Log-prob convention of the rollout's sampler (algos.sde.LOG_PROB_CONVENTIONS).
    log_prob_convention: str = "exact"
    needs: StepNeeds = field(init=False)
    state_source: StateSource = field(init=False)

    def __post_init__(self) -> None:
        self.needs = self.spec.needs_for(self.cfg)
        self.state_source = self.spec.state_source_for(self.cfg)

    @property
    def name(self) -> str:
        return self.spec.name

    def needs_reference(self) -> bool:
        return bool(self.needs & StepNeeds.REF_VELOCITY)

    def rollout_keys(self) -> set[str]:
        """Batch keys the rollout must store for this loss (docs/data_flow.md)."""
        keys = {"all_latents", "sigmas", "train_mask", "sde_cx", "sde_cv", "sde_std"}
        if {"old_velocity", "old_mean"} & set(self.spec.batch_keys):
            keys.add("old_velocities")
        return keys

    def __call__(self, q: StepQuantities, batch: StepBatch) -> LossOutput:
        batch.require(self.spec.batch_keys, self.spec.name)
        return self.spec.fn(q, batch, self.cfg)


def loss_config_fields(spec: LossSpec) -> set[str]:
    return {f.name for f in dataclasses.fields(spec.config)}


def make_step_loss(loss_mode: str, knobs: Optional[Mapping[str, Any]] = None, *,
                   log_prob_convention: str = "exact") -> DiffusionStepLoss:
    """Look the loss up by name and build its config dataclass from the knobs it has.

    Unknown knobs raise one line naming them and listing the accepted ones (a typo never trains silently
    with a default).
    """
    spec = get_loss_spec(loss_mode)
    knobs = {k: v for k, v in dict(knobs or {}).items() if v is not None}
    accepted = loss_config_fields(spec)
    unknown = sorted(set(knobs) - accepted)
    if unknown:
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss has knobs {unknown} that loss_mode={loss_mode!r} does not "
            f"take; accepted: {sorted(accepted)}")
    return DiffusionStepLoss(spec, spec.config(**knobs), log_prob_convention=log_prob_convention)


def step_loss_for(settings) -> DiffusionStepLoss:
    """The step loss of a typed ``actor_rollout_ref`` (config/schema.py ``ActorRolloutRefSection``): its loss config
    dataclass, built and checked with the config, and the rollout's log-prob convention."""
    return DiffusionStepLoss(get_loss_spec(settings.actor.loss_mode), settings.actor.loss,
                             log_prob_convention=settings.rollout.sampler.log_prob_convention)


def _col(rows: Mapping[str, torch.Tensor], key: str, k: int) -> Optional[torch.Tensor]:
    val = rows.get(key, None) if hasattr(rows, "get") else None
    return None if val is None else val[:, k]


def step_tensors(rows: Mapping[str, torch.Tensor], k: int) -> dict[str, Optional[torch.Tensor]]:
    """Every per-item tensor of step ``k`` the engine or a loss may read (views, no copies)."""
    lat = rows["all_latents"]
    sig = rows["sigmas"]
    out: dict[str, Optional[torch.Tensor]] = {
        "x_t": lat[:, k], "x_next": lat[:, k + 1], "t": sig[:, k], "t_next": sig[:, k + 1],
        "c_x": _col(rows, "sde_cx", k), "c_v": _col(rows, "sde_cv", k), "std": _col(rows, "sde_std", k),
        "x0": lat[:, -1],
        "old_log_prob": _col(rows, "old_log_probs", k),
        "rollout_log_prob": _col(rows, "rollout_log_probs", k),
        "advantages": _col(rows, "advantages", k),
        "old_velocity": _col(rows, "old_velocities", k),
        "group_ids": rows.get("group_ids", None),
        # Process advantages of a branched rollout (TempFlow, docs/algorithms.md §3.3) [B, N], when the batch has them.
        "step_advantages": _col(rows, "step_advantages", k),
    }
    if out["old_log_prob"] is None:
        out["old_log_prob"] = _col(rows, "rollout_log_probs", k)
    if out["old_velocity"] is not None and out["c_x"] is not None:
        from verl_diffusion.algos.sde import StepCoefficients, step_mean

        out["old_mean"] = step_mean(out["x_t"], out["old_velocity"],
                                    StepCoefficients(out["c_x"], out["c_v"], out["std"]))
    else:
        out["old_mean"] = None
    # Prepared per-step tensors (forward-noising states, fresh old velocities, path-space direction).
    for name in ("x_t", "t", "noise", "value_direction", "fresh_old_velocity", "step_advantages"):
        val = _col(rows, PREP_PREFIX + name, k)
        if val is not None:
            out[name] = val
    return out


def build_step_batch(loss: DiffusionStepLoss, st: Mapping[str, Optional[torch.Tensor]]) -> StepBatch:
    """StepBatch with ``advantages``, the fields ``loss.spec.batch_keys`` names, and those of
    ``loss.spec.optional_batch_keys`` that the batch has (the others stay None; they are never required)."""
    if st.get("advantages") is None:
        raise ValueError("the batch has no 'advantages'; the trainer computes them before update_actor")
    names = {f.name for f in dataclasses.fields(StepBatch)}
    kwargs = {"advantages": st["advantages"]}
    optional = tuple(getattr(loss.spec, "optional_batch_keys", ()) or ())
    for key in tuple(loss.spec.batch_keys) + optional:
        if key not in names:
            raise ValueError(f"loss {loss.name!r} declares batch key {key!r}, which StepBatch has no field for")
        if key != "advantages" and key not in kwargs:
            kwargs[key] = st.get(key)
    return StepBatch(**kwargs)


def compute_step_quantities(loss: DiffusionStepLoss, st: Mapping[str, Optional[torch.Tensor]], *,
                            velocity_fn: VelocityFn, rows: Mapping[str, torch.Tensor],
                            ref_velocity_fn: Optional[VelocityFn] = None) -> StepQuantities:
    """The θ-dependent quantities ``loss.needs`` declares, nothing more (one trainable forward at most)."""
    from verl_diffusion.algos.sde import StepCoefficients, gaussian_log_prob, step_mean

    needs = loss.needs
    q = StepQuantities()
    if needs & (StepNeeds.VELOCITY | StepNeeds.MEAN | StepNeeds.LOG_PROB):
        q.velocity = velocity_fn(st["x_t"], st["t"], rows)
    if needs & (StepNeeds.MEAN | StepNeeds.LOG_PROB):
        q.mean = step_mean(st["x_t"], q.velocity, StepCoefficients(st["c_x"], st["c_v"], st["std"]))
    if needs & StepNeeds.LOG_PROB:
        q.log_prob = gaussian_log_prob(st["x_next"], q.mean, st["std"], convention=loss.log_prob_convention)
    if needs & StepNeeds.REF_VELOCITY:
        if ref_velocity_fn is None:
            raise ValueError(f"loss {loss.name!r} needs REF_VELOCITY (kl_coef > 0) but the worker has no reference")
        with torch.no_grad():
            q.ref_velocity = ref_velocity_fn(st["x_t"], st["t"], rows).detach()
    if needs & StepNeeds.OLD_VELOCITY_FRESH:
        v = st.get("fresh_old_velocity")
        if v is None:
            raise ValueError(f"loss {loss.name!r} needs OLD_VELOCITY_FRESH; prepare_steps() computes it before "
                             "the update")
        q.old_velocity = v
    return q


def step_log_probs(st: Mapping[str, Optional[torch.Tensor]], velocity: torch.Tensor, *,
                   convention: str = "exact") -> torch.Tensor:
    """ℓ_θ(x_next | x_t) [B] for an already computed velocity (off-policy old-log-prob recompute)."""
    from verl_diffusion.algos.sde import StepCoefficients, gaussian_log_prob, step_mean

    mean = step_mean(st["x_t"], velocity, StepCoefficients(st["c_x"], st["c_v"], st["std"]))
    return gaussian_log_prob(st["x_next"], mean, st["std"], convention=convention)


def trained_steps(train_mask: torch.Tensor) -> list[int]:
    """Steps k where any row of the batch is trained ([B, N] int mask -> sorted list)."""
    return [int(k) for k in torch.nonzero(train_mask.bool().any(dim=0)).flatten().tolist()]


def _slice_rows(sb: StepBatch, idx: torch.Tensor) -> StepBatch:
    return StepBatch(**{f.name: (None if getattr(sb, f.name) is None else getattr(sb, f.name)[idx])
                        for f in dataclasses.fields(StepBatch)})


def prepare_steps(loss: DiffusionStepLoss, rows: dict, *, velocity_fn: Optional[VelocityFn] = None,
                  generator: Optional[torch.Generator] = None) -> dict[str, torch.Tensor]:
    """θ-independent per-step pre-processing over the *whole* local batch, before mini-batching.

    * ``forward_noising`` losses: fresh states x_t = (1 − t)·x0 + t·ε at each trained step's grid time;
    * ``OLD_VELOCITY_FRESH``: v_old at those states with the weights in the module, no grad (the worker swaps θ_old
      in when ``actor.old_policy`` keeps a soft copy, else these are the pre-update weights), for the rows trained
      at each step (every row when the loss has a ``prepare`` hook, whose pool is the whole group);
    * the loss's ``prepare`` hook (e.g. path-space ĝ), once per trained step, complete groups.

    Returns new ``prep/<name>`` tensors [B, N, *] (zeros at untrained steps, and for v_old at untrained items) to
    add to the batch.
    """
    spec = loss.spec
    steps = trained_steps(rows["train_mask"])
    fresh = loss.state_source == StateSource.FORWARD_NOISING
    need_old = bool(loss.needs & StepNeeds.OLD_VELOCITY_FRESH)
    if not (fresh or need_old or spec.prepare is not None):
        return {}
    lat = rows["all_latents"]
    B, N = rows["train_mask"].shape
    out: dict[str, torch.Tensor] = {}

    def put(name: str, k: int, val: torch.Tensor) -> None:
        if name not in out:
            out[name] = torch.zeros((B, N) + tuple(val.shape[1:]), dtype=val.dtype)
        out[name][:, k] = val.detach()

    # Pool members of the prepare hook (KDE) carry their per-sample advantage A_j at every trained step, also where
    # their own item is not trained (per-sample step subsets, zero-advantage filtering): the estimator broadcasts
    # A onto train_mask only, so the column at k would read 0 for them.
    sample_adv = None
    if spec.prepare is not None and rows.get("advantages", None) is not None:
        m = rows["train_mask"].bool()
        first = m.to(torch.int8).argmax(dim=1)              # first trained step of each sample (0 if none)
        sample_adv = rows["advantages"].gather(1, first[:, None]).squeeze(1) * m.any(dim=1)

    for k in steps:
        st = step_tensors(rows, k)
        if sample_adv is not None:
            st["advantages"] = sample_adv
        if fresh:
            t = st["t"]
            noise = torch.randn(lat[:, -1].shape, generator=generator, dtype=lat.dtype)
            tt = t.reshape(-1, *([1] * (lat.dim() - 2))).to(lat.dtype)
            x_t = (1.0 - tt) * st["x0"] + tt * noise
            st["x_t"], st["noise"] = x_t, noise
            put(PREP_PREFIX + "x_t", k, x_t)
            put(PREP_PREFIX + "noise", k, noise)
        if need_old:
            if velocity_fn is None:
                raise ValueError(f"loss {loss.name!r} needs OLD_VELOCITY_FRESH but no velocity_fn was given")
            # Only the rows trained at k need v_old (the loss reads no other), unless a prepare hook pools whole
            # groups: per-sample step subsets (train_step_fraction 0.4 over 10 steps) would otherwise forward
            # 2.5x the rows the loss trains.
            idx = None if spec.prepare is not None else rows_trained_at(rows, k)
            with torch.no_grad():
                if idx is None:
                    v_old = velocity_fn(st["x_t"], st["t"], rows)
                else:
                    v_old = torch.zeros_like(st["x_t"])
                    v_old[idx] = velocity_fn(st["x_t"][idx], st["t"][idx], select_rows(rows, idx))
            st["fresh_old_velocity"] = v_old
            put(PREP_PREFIX + "fresh_old_velocity", k, v_old)
        if spec.prepare is not None:
            # Forward-noising: the state is the fresh x_t, so v_old must be the fresh one computed above (the stored
            # trajectory v_old belongs to a different state). Trajectory mode: the stored one, else the fresh one.
            v_old = st.get("fresh_old_velocity") if fresh else st.get("old_velocity")
            if v_old is None:
                v_old = st.get("fresh_old_velocity")
            sb = build_step_batch(loss, {**st, "old_velocity": v_old})
            sb = spec.prepare(sb, loss.cfg)
            if sb.value_direction is not None:
                put(PREP_PREFIX + "value_direction", k, sb.value_direction)
            if sb.step_advantages is not None:
                put(PREP_PREFIX + "step_advantages", k, sb.step_advantages)
    return out


def rows_trained_at(rows: Mapping[str, torch.Tensor], k: int) -> Optional[torch.Tensor]:
    """Indices of the rows trained at step ``k`` when they are a strict subset of ``rows``, else None (all rows).

    An empty index tensor means no row is trained at k."""
    mask = rows["train_mask"][:, k].bool()
    n = int(mask.sum())
    if n == mask.numel():
        return None
    return torch.nonzero(mask).flatten()


def select_rows(rows: Mapping[str, torch.Tensor], idx: Optional[torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The per-row tensors of ``rows`` at ``idx`` (rows unchanged when ``idx`` is None)."""
    if idx is None:
        return rows
    b = rows["train_mask"].shape[0]
    return {key: (v[idx] if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == b else v)
            for key, v in rows.items()}


def run_step_loss(loss: DiffusionStepLoss, rows: Mapping[str, torch.Tensor], k: int, *,
                  velocity_fn: VelocityFn, ref_velocity_fn: Optional[VelocityFn] = None
                  ) -> tuple[Optional[LossOutput], int, StepQuantities, dict]:
    """Forward the rows of the micro-batch ``rows`` trained at step ``k`` and apply the loss to them.

    Only the rows with ``train_mask[:, k] == 1`` are evaluated (a branched TempFlow micro-batch mixes rows whose
    only stochastic step differs, and τ_k = 0 rows have no log-prob); when every row is trained at k (ordinary
    rollouts: all rows share the window) the whole micro-batch is forwarded exactly as before, the same batch
    composition as the rollout, so the on-policy log-prob is bitwise the rollout's. No row trained at k: no
    forward at all.
    Returns (LossOutput or None when no row is trained at k, number of items n, quantities and step tensors of
    the n evaluated rows).
    """
    idx = rows_trained_at(rows, k)
    if idx is not None and idx.numel() == 0:
        return None, 0, StepQuantities(), step_tensors(select_rows(rows, idx), k)
    sub = select_rows(rows, idx)
    st = step_tensors(sub, k)
    q = compute_step_quantities(loss, st, velocity_fn=velocity_fn, rows=sub, ref_velocity_fn=ref_velocity_fn)
    n = int(sub["train_mask"].shape[0])
    batch = build_step_batch(loss, st)
    batch.check_shapes()
    return loss(q, batch), n, q, st
