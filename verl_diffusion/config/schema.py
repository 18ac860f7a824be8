"""The run's configuration, typed: :meth:`RunConfig.from_omegaconf` reads the composed YAML once, top down, into
frozen dataclasses in the style of verl's ``BaseConfig`` (attribute and mapping access, immutable; :class:`Section`),
and
each section checks its own fields where it is built, with one line naming the field, the value and what is
accepted (:class:`ConfigError`). Defaults live in the YAML (``config/flowgrpo_trainer.yaml``); a key missing from a
config node is an error, not a silent default. The workers, the rollout replicas and the trainer read these objects;
verl's own parts (engine, optimizer, checkpoints, Ray pools) keep reading the DictConfig they were written for.

Sections, in the order they are read: ``data`` (:class:`DataSection`: the prompt files, counted), the actor-rollout
group (:class:`ActorRolloutRefSection`: ``model`` → :class:`ModelSection`, ``rollout`` → :class:`RolloutSection`,
``actor`` → :class:`ActorSection`), ``algorithm.adv_estimator``, ``reward`` (:class:`RewardSection`) and ``trainer``
(:class:`TrainerSection`); :class:`RunConfig` then checks what spans sections (batch sizes against workers and groups,
the placement against the trainer mode, the branched rollout against the loss).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from verl_diffusion.algos.checks import check_choice
from verl_diffusion.algos.ema import NFT_SCHEDULE_TYPES, awm_kl_ema_decay, nft_old_policy_decay
from verl_diffusion.algos.sde import LOG_PROB_CONVENTIONS, SAMPLERS
from verl_diffusion.algos.windows import SdeWindowConfig, resolve_branch_steps, window_steps

__all__ = ["ConfigError", "RunConfig", "DataSection", "ActorRolloutRefSection", "ModelSection", "RolloutSection",
           "ActorSection", "RewardSection", "TrainerSection", "RolloutConfig", "LoraSettings", "BranchedSettings",
           "EmaSettings", "OldPolicyConfig", "RewardFailureBudget", "GRIDS", "PLACEMENTS", "OLD_POLICY_SCHEDULES",
           "REWARD_KEYS", "VERL_POLICY_LOSS_KEYS", "torch_dtype", "plain", "yaml_section", "placement",
           "num_standalone_replicas", "check_placement"]

# rollout.grid choices (docs/algorithms.md §1.1).
GRIDS = ("scheduler", "formula")
# actor_rollout_ref.rollout.placement: where the diffusers sampler runs (docs/replica_modes.md).
PLACEMENTS = ("colocated", "standalone")
OLD_POLICY_SCHEDULES = ("none", "nft", "awm_linear", "awm_constant", "constant")
# Keys of the `reward` section that this trainer reads; verl's own RewardConfig fields are accepted next to them
# (ppo_trainer composes them in, our trainer does not use them).
REWARD_KEYS = ("components", "options", "penalty", "executor", "max_workers", "timeout", "preflight_timeout")
# ``actor.policy_loss`` keys that are verl's own (its token losses read them); the rest are our loss's knobs.
VERL_POLICY_LOSS_KEYS = ("_target_", "loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio",
                         "ppo_kl_coef", "rollout_correction")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16}


class ConfigError(ValueError):
    """A config problem found before any Ray worker starts; the message names the field."""


class Section(Mapping):
    """Base of the typed sections (frozen dataclasses): fields read as attributes or as mapping keys
    (``section["n"]``, ``section.get("n")``, ``dict(section)``), as verl's ``BaseConfig`` configs are read. Not verl's
    class itself: this module is imported while verl loads its plugins, before verl can be imported from here."""

    def __getitem__(self, key: str) -> Any:
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(f.name for f in dataclasses.fields(self))

    def __len__(self) -> int:
        return len(dataclasses.fields(self))


def plain(node) -> Any:
    """A config node as plain Python (dicts, lists), interpolations resolved; plain values pass through."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(node, resolve=True) if isinstance(node, (DictConfig, ListConfig)) else node


def yaml_section(dotted: str) -> dict:
    """A section of ``config/flowgrpo_trainer.yaml`` as shipped, e.g. ``"actor_rollout_ref.rollout"``: the defaults a
    hand-built node (a test's, a script's) is merged onto. Values that interpolate other sections are None here."""
    import importlib.resources

    from omegaconf import OmegaConf

    node = OmegaConf.create(importlib.resources.files("verl_diffusion.config").joinpath(
        "flowgrpo_trainer.yaml").read_text())
    for key in dotted.split("."):
        node = node[key]

    def detach(value):
        if isinstance(value, dict):
            return {k: detach(v) for k, v in value.items()}
        return None if isinstance(value, str) and value.startswith("${") else value

    return detach(OmegaConf.to_container(node, resolve=False))


def torch_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r} is unknown; choose one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def _need(d: Mapping, key: str, where: str) -> Any:
    if key not in d:
        raise ConfigError(f"{where}.{key} is missing: set it (config/flowgrpo_trainer.yaml gives every key its default)")
    return d[key]


def _int(value: Any, where: str, *, low: int, hint: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{where}={value!r} must be an integer >= {low}{hint}")
    return value


def _finite(value: Any) -> Optional[float]:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _scoped(prefix: str, section: str, e: Exception) -> ConfigError:
    """A ValueError of a lower layer as one line under ``prefix``: messages that already name a field relative to
    ``actor_rollout_ref`` (``rollout.…``, ``actor.…``) get the prefix, others the section's name."""
    msg = str(e).strip("'\"")
    return ConfigError(f"{prefix}.{msg}" if msg.startswith(("rollout.", "actor.", "model.")) else f"{prefix}.{section}: {msg}")


# ---------------------------------------------------------------------------------------------------- rollout


@dataclass
class RolloutConfig:
    """Sampling knobs of the diffusers rollout (docs/algorithms.md §1). Built from ``actor_rollout_ref.rollout`` by
    :meth:`RolloutSection.from_node`; the defaults here serve tests and scripts that sample without a config."""

    # Sampling steps N of a training rollout.
    num_steps: int = 10
    # Sampling grid (docs/algorithms.md §1.1): "scheduler" = the model's own scheduler sigmas at this N and image size
    # (adapter.sampling_grid: static or dynamic shift, what the stock pipeline samples with); "formula" =
    # t_k = S·u_k / (1 + (S−1)·u_k) with ``shift`` (the model-free default of tests and tiny models).
    grid: str = "formula"
    # Grid shift S of the formula grid (docs/algorithms.md §1.1; SD3/SD3.5: 3). Unused with grid "scheduler".
    shift: float = 3.0
    # Stochastic sampler inside the window: flow_sde | cps | dance | ode.
    sampler: str = "flow_sde"
    # a (flow_sde, cps) or η_D (dance).
    noise_level: float = 0.7
    # Which steps are stochastic and trained (docs/algorithms.md §1.8).
    window: SdeWindowConfig = field(default_factory=SdeWindowConfig)
    # Log-prob convention stored in rollout_log_probs: exact | unnormalized (docs/algorithms.md §1.2, §1.4).
    log_prob_convention: str = "exact"
    # One initial noise per group instead of per sample (docs/algorithms.md §1.8).
    same_noise_per_group: bool = False
    # CFG scale; 1 disables CFG (the trained velocity is then the conditional one).
    guidance_scale: float = 1.0
    # The negative prompt of CFG (Qwen-Image's examples and verl PR #5951 use " ").
    negative_prompt: str = ""
    # Image size in pixels.
    height: int = 512
    width: int = 512
    # Samples per transformer forward.
    micro_batch_size: int = 8
    # Store v_old at the trained steps (old_velocities) for losses that read it.
    store_velocities: bool = False
    # Steps of the ODE validation sampler (docs/algorithms.md §1.6: 40 for SD3.5).
    val_num_steps: int = 40

    def __post_init__(self):
        check_choice("rollout.sde.type", self.sampler, SAMPLERS)
        check_choice("rollout.grid", self.grid, GRIDS)
        check_choice("rollout.log_prob_convention", self.log_prob_convention, LOG_PROB_CONVENTIONS)
        for name in ("num_steps", "micro_batch_size", "val_num_steps", "height", "width"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"rollout.{name}={value!r} is invalid; pass an int >= 1")
        if isinstance(self.window, dict):
            self.window = SdeWindowConfig(**self.window)


def placement(rollout_cfg) -> str:
    """``rollout.placement`` (default colocated), checked."""
    value = str(rollout_cfg.get("placement", "colocated") or "colocated")
    if value not in PLACEMENTS:
        raise ValueError(f"actor_rollout_ref.rollout.placement={value!r} is unknown; choose one of {list(PLACEMENTS)}")
    return value


def num_standalone_replicas(rollout_cfg) -> int:
    """``rollout.standalone.num_replicas`` (default 1): standalone replica processes, one device each."""
    node = rollout_cfg.get("standalone", None) or {}
    n = node.get("num_replicas", 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"actor_rollout_ref.rollout.standalone.num_replicas={n!r} must be an int >= 1")
    return n


def check_placement(arr_cfg, *, asynchronous: bool = False) -> str:
    """``rollout.placement`` and what it needs, checked before Ray starts; returns the placement. ``asynchronous``:
    the trainer samples ahead (diffusion_async), which only a standalone replica can do."""
    rollout = arr_cfg.rollout
    where = placement(rollout)
    if asynchronous and where != "standalone":
        raise ValueError(f"trainer.v1.trainer_mode=diffusion_async samples the next batch while the actor trains; "
                         f"it needs actor_rollout_ref.rollout.placement=standalone (got {where!r})")
    if where != "standalone":
        return where
    num_standalone_replicas(rollout)
    name = str(rollout.get("name", "diffusers"))
    if name != "diffusers":
        raise ValueError(f"actor_rollout_ref.rollout.placement=standalone is the diffusers sampler's; "
                         f"rollout.name={name!r} is not supported there (use name=diffusers)")
    old = arr_cfg.actor.get("old_policy", None) or {}
    if str(old.get("schedule", "none")) != "none" and bool(old.get("use_for_rollout", True)):
        raise ValueError("actor_rollout_ref.actor.old_policy.use_for_rollout=true samples with θ_old, which lives in "
                         "the actor workers; a standalone replica receives θ only. Set use_for_rollout=false or "
                         "rollout.placement=colocated")
    if bool((arr_cfg.actor.get("ema", None) or {}).get("enable", False)):
        raise ValueError("actor_rollout_ref.actor.ema.enable=true validates with the EMA weights, which live in the "
                         "actor workers; a standalone replica receives θ only. Set ema.enable=false or "
                         "rollout.placement=colocated")
    return where


@dataclass(frozen=True, kw_only=True)
class BranchedSettings(Section):
    """``rollout.branched`` when enabled (TempFlow-GRPO, docs/algorithms.md §3.3): children per (prompt, k) and the
    sorted branch steps k."""

    num_children: int
    branch_steps: list

    @property
    def rows_per_prompt(self) -> int:
        return len(self.branch_steps) * self.num_children


@dataclass(frozen=True, kw_only=True)
class RolloutSection(Section):
    """``actor_rollout_ref.rollout``: the replica (name, placement, standalone replicas), the group size, the sampler's
    :class:`RolloutConfig` and the branched rollout (None when off)."""

    name: str
    placement: str
    num_replicas: int
    n: int
    keep_trajectories_in_worker: bool
    sampler: RolloutConfig
    branched: Optional[BranchedSettings]

    @classmethod
    def from_node(cls, node, where: str = "actor_rollout_ref.rollout") -> "RolloutSection":
        d = plain(node)
        sde = dict(_need(d, "sde", where) or {})
        res = _need(d, "resolution", where)
        try:
            sampler = RolloutConfig(
                num_steps=_need(d, "num_steps", where), grid=str(_need(d, "grid", where)),
                shift=float(_need(d, "shift", where)), sampler=str(_need(sde, "type", f"{where}.sde")),
                noise_level=float(_need(sde, "noise_level", f"{where}.sde")),
                window=dict(_need(sde, "window", f"{where}.sde") or {}),
                log_prob_convention=str(_need(sde, "log_prob_convention", f"{where}.sde")),
                same_noise_per_group=bool(_need(d, "same_noise_per_group", where)),
                guidance_scale=float(_need(d, "guidance_scale", where)),
                negative_prompt=str(_need(d, "negative_prompt", where) or ""),
                height=res, width=res, micro_batch_size=_need(d, "micro_batch_size", where), store_velocities=False,
                val_num_steps=_need(d, "val_num_steps", where))
            window_steps(sampler.window, num_steps=sampler.num_steps)
        except ConfigError:
            raise
        except (KeyError, ValueError, TypeError) as e:
            raise _scoped("actor_rollout_ref", "rollout", e) from None
        _need(d, "placement", where)
        try:
            where_placed, replicas = placement(d), num_standalone_replicas(d)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        n = _int(_need(d, "n", where), f"{where}.n", low=1)
        return cls(name=str(_need(d, "name", where)), placement=where_placed, num_replicas=replicas, n=n,
                   keep_trajectories_in_worker=bool(_need(d, "keep_trajectories_in_worker", where)), sampler=sampler,
                   branched=cls._branched(d.get("branched", None), sampler.num_steps, where))

    @staticmethod
    def _branched(br, num_steps: int, where: str) -> Optional[BranchedSettings]:
        br = dict(br or {})
        if not bool(br.get("enabled", False)):
            return None
        kb = _need(br, "num_children", f"{where}.branched")
        if isinstance(kb, bool) or not isinstance(kb, int) or kb < 2:
            raise ConfigError(f"{where}.branched.num_children={kb!r} must be an int >= 2 (the process advantages are "
                              "normalised across the children of one (prompt, k); one child gets 0)")
        try:
            steps = resolve_branch_steps(br.get("branch_steps", None), num_steps)
        except ValueError as e:
            raise ConfigError(f"{where}.branched.{e}") from None
        return BranchedSettings(num_children=kb, branch_steps=steps)

    @property
    def rows_per_prompt(self) -> int:
        """Rows a prompt yields per step: rollout.n, or |branch steps| × num_children for a branched rollout."""
        return self.branched.rows_per_prompt if self.branched is not None else self.n


# ---------------------------------------------------------------------------------------------------- model


@dataclass(frozen=True, kw_only=True)
class LoraSettings(Section):
    """The LoRA layout of ``actor_rollout_ref.model`` (what ``models.lora.inject_lora`` reads): the actor's engine and a
    standalone replica inject exactly the same layers. ``target_modules`` unset or "all-linear": the architecture's own
    list (every attention / feed-forward projection for Qwen-Image and FLUX, Flow-GRPO's joint-attention projections
    for SD3)."""

    lora_rank: int
    lora_alpha: int
    target_modules: Union[list, str]
    init_lora_weights: Any
    lora_adapter_path: Optional[str]


@dataclass(frozen=True, kw_only=True)
class ModelSection(Section):
    """``actor_rollout_ref.model``: a local diffusers pipeline folder, its architecture (``architecture``, or the one
    ``model_index.json`` names), the adapter's options, dtype and LoRA layout."""

    path: str
    architecture: str
    dtype: str
    transformer_subfolder: str
    adapter_kwargs: dict
    lora: LoraSettings
    enable_gradient_checkpointing: bool

    @classmethod
    def from_node(cls, node, where: str = "actor_rollout_ref.model") -> "ModelSection":
        from verl_diffusion.models import adapter_for_path, get_adapter_cls
        from verl_diffusion.models.base import pipeline_class_name

        d = plain(node)
        path = d.get("path", None)
        if not path:
            raise ConfigError(f"{where}.path is not set: give a diffusers pipeline folder "
                              "(model_index.json), or set actor_rollout_ref.model.tiny for a tiny random model")
        if not os.path.isfile(os.path.join(str(path), "model_index.json")):
            raise ConfigError(f"{where}.path={path!r} has no model_index.json: give a local diffusers "
                              "pipeline folder (save_pretrained output)")
        named = d.get("architecture", None)
        try:
            adapter_cls = get_adapter_cls(str(named)) if named else adapter_for_path(str(path))
        except (KeyError, ValueError) as e:
            raise ConfigError(f"{where}: {str(e).strip(chr(39) + chr(34))}") from None
        found = pipeline_class_name(path)
        if found != adapter_cls.architecture:
            raise ConfigError(f"{where}.architecture={named!r} wraps a {adapter_cls.architecture}, but model.path holds "
                              f"a {found}; drop the architecture key (it is read from model_index.json) or point "
                              "model.path at a matching model")
        kwargs = dict(_need(d, "adapter_kwargs", where) or {})
        params = inspect.signature(adapter_cls.__init__).parameters
        accepted = sorted(n for n, p in params.items() if p.kind == p.KEYWORD_ONLY)
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise ConfigError(f"{where}: model.adapter_kwargs has {unknown}, which {adapter_cls.__name__} does not "
                              f"take; accepted: {accepted}")
        dtype = str(_need(d, "dtype", where))
        try:
            torch_dtype(dtype)
        except ValueError as e:
            raise ConfigError(f"{where}.{e}") from None
        targets = _need(d, "target_modules", where)
        if targets in (None, "all-linear"):
            targets = adapter_cls.LORA_TARGETS
        lora = LoraSettings(lora_rank=int(_need(d, "lora_rank", where) or 0), lora_alpha=int(_need(d, "lora_alpha", where)),
                            target_modules=targets if isinstance(targets, str) else list(targets),
                            init_lora_weights=_need(d, "init_lora_weights", where),
                            lora_adapter_path=d.get("lora_adapter_path", None))
        return cls(path=str(path), architecture=adapter_cls.name, dtype=dtype,
                   transformer_subfolder=str(_need(d, "transformer_subfolder", where)), adapter_kwargs=kwargs, lora=lora,
                   enable_gradient_checkpointing=bool(_need(d, "enable_gradient_checkpointing", where)))

    @property
    def adapter_cls(self):
        from verl_diffusion.models import get_adapter_cls

        return get_adapter_cls(self.architecture)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)


# ---------------------------------------------------------------------------------------------------- actor


@dataclass(frozen=True)
class OldPolicyConfig:
    """``actor_rollout_ref.actor.old_policy``: the soft old-policy copy θ_old (docs/algorithms.md §8.2)."""

    # none | nft | awm_linear | awm_constant | constant.
    schedule: str = "none"
    # DiffusionNFT schedule type (docs/algorithms.md §8.2): 0 | 1 (default) | 2 (OCR).
    nft_type: int = 1
    # d_max of the AWM schedules (AWM's 0.3).
    decay_max: float = 0.3
    # d of the ``constant`` schedule.
    decay: Optional[float] = None
    # Sample the training rollouts with θ_old (DiffusionNFT's sampling adapter; AWM off_policy's KL-EMA adapter).
    use_for_rollout: bool = True

    def __post_init__(self):
        if self.schedule not in OLD_POLICY_SCHEDULES:
            raise ValueError(f"actor.old_policy.schedule={self.schedule!r} is unknown; choose one of "
                             f"{list(OLD_POLICY_SCHEDULES)}")
        if isinstance(self.nft_type, bool) or self.nft_type not in NFT_SCHEDULE_TYPES:
            raise ValueError(f"actor.old_policy.nft_type={self.nft_type!r} is invalid; choose one of "
                             f"{list(NFT_SCHEDULE_TYPES)}")
        if not 0.0 <= float(self.decay_max) <= 1.0:
            raise ValueError(f"actor.old_policy.decay_max={self.decay_max!r} must be in [0, 1]")
        if self.schedule == "constant" and (self.decay is None or not 0.0 <= float(self.decay) <= 1.0):
            raise ValueError(f"actor.old_policy.schedule=constant needs decay in [0, 1] (got {self.decay!r})")

    @property
    def enabled(self) -> bool:
        return self.schedule != "none"

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]]) -> "OldPolicyConfig":
        d = dict(d or {})
        known = {"schedule", "nft_type", "decay_max", "decay", "use_for_rollout"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"actor.old_policy has unknown keys {unknown}; accepted: {sorted(known)}")
        kw: dict[str, Any] = {}
        if d.get("schedule") is not None:
            kw["schedule"] = str(d["schedule"])
        if d.get("nft_type") is not None:
            kw["nft_type"] = int(d["nft_type"])
        if d.get("decay_max") is not None:
            kw["decay_max"] = float(d["decay_max"])
        if d.get("decay") is not None:
            kw["decay"] = float(d["decay"])
        if d.get("use_for_rollout") is not None:
            kw["use_for_rollout"] = bool(d["use_for_rollout"])
        return cls(**kw)

    def decay_at(self, n: int) -> float:
        """d after n optimizer steps (docs/algorithms.md §8.2)."""
        if self.schedule == "nft":
            return nft_old_policy_decay(self.nft_type, n)
        if self.schedule == "awm_linear":
            return awm_kl_ema_decay("linear", n, decay_max=self.decay_max)
        if self.schedule == "awm_constant":
            return awm_kl_ema_decay("constant", n, decay_max=self.decay_max)
        if self.schedule == "constant":
            return float(self.decay)
        raise ValueError("schedule none keeps no θ_old copy")


@dataclass(frozen=True, kw_only=True)
class EmaSettings(Section):
    """``actor.ema``: the evaluation EMA of the trainable parameters (validation samples with it)."""

    enable: bool
    decay_max: float
    interval: int


LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True, kw_only=True)
class ActorSection(Section):
    """``actor_rollout_ref.actor``: the loss (its name and its config dataclass, built from ``policy_loss``), the
    learning rate and its schedule, the share of trained steps, θ_old and the evaluation EMA, the batch split, whether each update's
    size is logged."""

    loss_mode: str
    loss: Any
    lr: float
    lr_scheduler_type: str
    min_lr_ratio: float
    train_step_fraction: float
    old_policy: OldPolicyConfig
    ema: EmaSettings
    ppo_mini_batch_size: int
    ppo_micro_batch_size_per_gpu: int
    log_update_size: bool

    @classmethod
    def from_node(cls, node, rollout: RolloutSection, where: str = "actor_rollout_ref.actor") -> "ActorSection":
        from verl_diffusion.algos.losses import get_loss_spec

        d = plain(node)
        optim = dict(_need(d, "optim", where) or {})
        lr = optim.get("lr", None)
        x = _finite(lr)
        if x is None or x <= 0:
            raise ConfigError(f"{where}.optim.lr={lr!r} must be a number > 0 (lr 0 trains nothing; "
                              "the recipes use 1e-4 to 3e-4)")
        # verl's FSDP engine builds the schedule inside each worker; a bad name would fail there, after Ray started.
        schedule = str(_need(optim, "lr_scheduler_type", f"{where}.optim"))
        if schedule not in LR_SCHEDULES:
            raise ConfigError(f"{where}.optim.lr_scheduler_type={schedule!r}: want one of {list(LR_SCHEDULES)} "
                              "(verl's FSDP engine: constant after warm-up, or cosine decay to lr·min_lr_ratio)")
        min_lr_ratio = optim.get("min_lr_ratio", None)
        ratio = _finite(min_lr_ratio)
        if ratio is None or not 0.0 <= ratio <= 1.0:
            raise ConfigError(f"{where}.optim.min_lr_ratio={min_lr_ratio!r} must be a number in [0, 1] "
                              "(the cosine schedule's final lr over lr)")
        frac = float(_need(d, "train_step_fraction", where))
        if not 0.0 < frac <= 1.0:
            raise ConfigError(f"{where}.train_step_fraction={frac} must be in (0, 1] "
                              "(1.0 trains every window step; DanceGRPO uses 0.6)")
        try:
            old_policy = OldPolicyConfig.from_dict(_need(d, "old_policy", where))
        except (KeyError, ValueError, TypeError) as e:
            raise _scoped("actor_rollout_ref", "actor.old_policy", e) from None
        policy_loss = dict(_need(d, "policy_loss", where) or {})
        loss_mode = str(_need(policy_loss, "loss_mode", f"{where}.policy_loss"))
        try:
            spec = get_loss_spec(loss_mode)
            knobs = {k: v for k, v in policy_loss.items() if k not in VERL_POLICY_LOSS_KEYS and v is not None}
            accepted = {f.name for f in dataclasses.fields(spec.config)}
            # The KL formula of flow_grpo_legacy depends on the sampler: rollout.sde.type unless the loss sets it.
            if "sampler" in accepted and "sampler" not in knobs:
                knobs["sampler"] = rollout.sampler.sampler
            unknown = sorted(set(knobs) - accepted)
            if unknown:
                raise ValueError(f"actor_rollout_ref.actor.policy_loss has knobs {unknown} that loss_mode={loss_mode!r} "
                                 f"does not take; accepted: {sorted(accepted)}")
            loss = spec.config(**knobs)
        except (KeyError, ValueError, TypeError) as e:
            raise ConfigError(str(e).strip("'\"")) from None
        ema = dict(_need(d, "ema", where) or {})
        return cls(loss_mode=loss_mode, loss=loss, lr=x, lr_scheduler_type=schedule, min_lr_ratio=ratio,
                   train_step_fraction=frac, old_policy=old_policy,
                   ema=EmaSettings(enable=bool(ema.get("enable", False)), decay_max=float(_need(ema, "decay_max", f"{where}.ema")),
                                   interval=int(_need(ema, "interval", f"{where}.ema"))),
                   ppo_mini_batch_size=_int(_need(d, "ppo_mini_batch_size", where), f"{where}.ppo_mini_batch_size", low=1),
                   ppo_micro_batch_size_per_gpu=_int(_need(d, "ppo_micro_batch_size_per_gpu", where),
                                                     f"{where}.ppo_micro_batch_size_per_gpu", low=1),
                   log_update_size=bool(_need(d, "log_update_size", where)))


@dataclass(frozen=True, kw_only=True)
class ActorRolloutRefSection(Section):
    """``actor_rollout_ref``: what one actor worker (and a standalone replica) needs."""

    model: ModelSection
    rollout: RolloutSection
    actor: ActorSection

    @classmethod
    def from_node(cls, node) -> "ActorRolloutRefSection":
        model = ModelSection.from_node(node.model)
        rollout = RolloutSection.from_node(node.rollout)
        actor = ActorSection.from_node(node.actor, rollout)
        return cls(model=model, rollout=rollout, actor=actor)


# ---------------------------------------------------------------------------------------------------- data, reward, trainer


@dataclass(frozen=True, kw_only=True)
class DataSection(Section):
    """``data``: the prompt files (each one read once here, so a bad file is named before Ray starts), the prompt
    column, prompts per step and the number of training prompts after ``train_max_samples``."""

    train_files: list
    val_files: list
    prompt_key: str
    train_batch_size: int
    num_train_prompts: int
    num_val_prompts: int

    @classmethod
    def from_node(cls, node, where: str = "data") -> "DataSection":
        from verl_diffusion.prompt_files import read_rows

        d = plain(node)
        bs = d.get("train_batch_size", None)
        _int(bs, f"{where}.train_batch_size", low=1, hint=" (prompts per step)")
        key = str(_need(d, "prompt_key", where))
        counts = {}
        for name in ("train_files", "val_files"):
            files = d.get(name, None)
            if not files:
                raise ConfigError(f"{where}.{name} is empty: give prompt files (.parquet/.jsonl/.txt)")
            counts[name] = 0
            for f in files:
                try:
                    counts[name] += len(read_rows(str(f), prompt_key=key))
                except (FileNotFoundError, ValueError) as e:
                    raise ConfigError(f"{where}.{name}: {e}") from None
        n_train = counts["train_files"]
        limit = d.get("train_max_samples", -1)
        if limit is not None and int(limit) > 0:
            n_train = min(n_train, int(limit))
        if bs > n_train:
            raise ConfigError(f"{where}.train_batch_size={bs} is larger than the {n_train} training prompts of "
                              f"data.train_files (after data.train_max_samples); lower it to <= {n_train} or add prompts")
        return cls(train_files=list(d["train_files"]), val_files=list(d["val_files"]), prompt_key=key,
                   train_batch_size=bs, num_train_prompts=n_train, num_val_prompts=counts["val_files"])


def _verl_reward_keys() -> set[str]:
    """The keys of verl's own ``reward`` group (verl/trainer/config/reward/reward.yaml), which ppo_trainer composes
    in next to ours."""
    import importlib.resources

    from omegaconf import OmegaConf

    text = importlib.resources.files("verl.trainer.config").joinpath("reward/reward.yaml").read_text()
    return set(OmegaConf.create(text).keys()) | {"_target_"}


def reward_option_names(name: str) -> list[str]:
    """The keyword options a registered reward's constructor takes."""
    from verl_diffusion.rewards import get_reward_cls

    params = inspect.signature(get_reward_cls(name).__init__).parameters.values()
    return [p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


@dataclass(frozen=True, kw_only=True)
class RewardSection(Section):
    """``reward``: the weighted components, the options of those in use (checked against each reward's constructor),
    the failure penalty, the executor and the pre-flight timeout of remote rewards (None: no probe)."""

    components: dict
    options: dict
    penalty: float
    executor: str
    max_workers: Optional[int]
    timeout: Optional[float]
    preflight_timeout: Optional[float]

    @classmethod
    def from_node(cls, node, where: str = "reward") -> "RewardSection":
        from omegaconf import DictConfig

        from verl_diffusion.rewards import REWARDS

        keys = list(node.keys()) if isinstance(node, (DictConfig, dict)) else []
        verl_keys = _verl_reward_keys()
        for key in keys:
            if key not in REWARD_KEYS and key not in verl_keys:
                hint = " (reward options go under reward.options.<reward>.<option>)" if key == "reward_kwargs" else ""
                raise ConfigError(f"{where}.{key} is not a key this trainer reads{hint}; valid keys: "
                                  f"{', '.join(REWARD_KEYS)}")
        components = plain(node.get("components", None)) or {}
        if not components:
            raise ConfigError(f"{where}.components is empty: give {{name: weight}}, e.g. reward.components={{ocr: 1.0}}")
        raw_options = node.get("options", None) or {}
        for name in raw_options.keys():
            if name not in REWARDS:
                raise ConfigError(f"{where}.options.{name}: no reward is named {name!r}; rewards: "
                                  f"{', '.join(sorted(REWARDS))}")
            valid = reward_option_names(name)
            for key in (raw_options[name] or {}).keys():
                if key not in valid:
                    raise ConfigError(f"{where}.options.{name}.{key} is not an option of reward {name!r}; valid options: "
                                      f"{', '.join(valid) if valid else '(none)'}")
        # A recipe's options for a reward the command line switched off are dropped unresolved (their
        # ${oc.env:...} may name a variable this host does not set), with a note.
        unused = sorted(k for k in raw_options.keys() if k not in components)
        if unused:
            print(f"note: reward.options for {', '.join(unused)} ignored: not in reward.components "
                  f"({', '.join(sorted(components))})")
        options = {k: plain(raw_options[k]) if raw_options[k] is not None else {}
                   for k in raw_options.keys() if k in components}
        pf = node.get("preflight_timeout", None)
        if pf is not None and ((_finite(pf) or 0) <= 0):
            raise ConfigError(f"{where}.preflight_timeout={pf!r} must be a positive number of seconds, or null to skip "
                              "the check of remote rewards")
        timeout = node.get("timeout", None)
        return cls(components={k: float(v) for k, v in components.items()}, options=options,
                   penalty=float(node.get("penalty", 0.0)), executor=str(node.get("executor", "sync")),
                   max_workers=node.get("max_workers", None), timeout=None if timeout is None else float(timeout),
                   preflight_timeout=None if pf is None else float(pf))


@dataclass
class RewardFailureBudget:
    """``trainer.reward_failure_budget``: stop after ``max_consecutive_steps`` consecutive steps in which some
    reward failed on more than ``max_fraction`` of the samples. ``max_consecutive_steps`` null or 0: never stop."""

    max_fraction: float = 0.5
    max_consecutive_steps: Optional[int] = 10

    @classmethod
    def from_dict(cls, d: Optional[Mapping]) -> "RewardFailureBudget":
        d = dict(d or {})
        unknown = set(d) - {"max_fraction", "max_consecutive_steps"}
        if unknown:
            raise ValueError(f"trainer.reward_failure_budget: unknown keys {sorted(unknown)}; "
                             "accepted: max_fraction, max_consecutive_steps")
        frac = float(d.get("max_fraction", 0.5))
        if not 0.0 <= frac < 1.0:
            raise ValueError(f"trainer.reward_failure_budget.max_fraction={frac} must be in [0, 1) "
                             "(0.5: more than half the samples failed)")
        steps = d.get("max_consecutive_steps", 10)
        steps = None if steps in (None, 0) else int(steps)
        if steps is not None and steps < 0:
            raise ValueError(f"trainer.reward_failure_budget.max_consecutive_steps={steps} must be >= 0 "
                             "(0 or null: never stop)")
        return cls(max_fraction=frac, max_consecutive_steps=steps)


@dataclass(frozen=True, kw_only=True)
class TrainerSection(Section):
    """``trainer``: the V1 trainer (``v1.trainer_mode``; whether it samples ahead), the length of the run, the
    workers (nodes × devices per node) and the reward-failure budget."""

    trainer_mode: str
    samples_ahead: bool
    total_training_steps: Optional[int]
    total_epochs: int
    nnodes: int
    n_gpus_per_node: int
    reward_failure_budget: RewardFailureBudget

    @classmethod
    def from_node(cls, node, where: str = "trainer") -> "TrainerSection":
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

        d = plain(node)
        mode = str((_need(d, "v1", where) or {}).get("trainer_mode", "diffusion_sync"))
        ours = sorted(k for k in TRAINER_REGISTRY if k.startswith("diffusion"))
        if mode not in ours:
            raise ConfigError(f"{where}.v1.trainer_mode={mode!r} is not a diffusion trainer; choose one of {ours} "
                              "(verl's own sync/async trainers train language models)")
        steps = _need(d, "total_training_steps", where)
        if steps is not None:
            _int(steps, f"{where}.total_training_steps", low=1,
                 hint=", or null (= trainer.total_epochs passes over the training prompts)")
        epochs = _int(_need(d, "total_epochs", where), f"{where}.total_epochs", low=1)
        try:
            budget = RewardFailureBudget.from_dict(d.get("reward_failure_budget", None))
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None
        return cls(trainer_mode=mode, samples_ahead=bool(getattr(TRAINER_REGISTRY[mode], "samples_ahead", False)),
                   total_training_steps=steps, total_epochs=epochs, nnodes=int(_need(d, "nnodes", where)),
                   n_gpus_per_node=int(_need(d, "n_gpus_per_node", where)), reward_failure_budget=budget)

    @property
    def num_workers(self) -> int:
        return self.nnodes * self.n_gpus_per_node


# ---------------------------------------------------------------------------------------------------- the run


@dataclass(frozen=True, kw_only=True)
class RunConfig(Section):
    """The whole run, typed and checked (module docstring); :meth:`from_omegaconf` builds it from the composed
    config after ``prepare_config`` has resolved its paths."""

    data: DataSection
    actor_rollout_ref: ActorRolloutRefSection
    adv_estimator: str
    reward: RewardSection
    trainer: TrainerSection

    @classmethod
    def from_omegaconf(cls, cfg) -> "RunConfig":
        """Every section in one pass, top down; raises :class:`ConfigError` with one line."""
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY

        data = DataSection.from_node(cfg.data)
        arr = ActorRolloutRefSection.from_node(cfg.actor_rollout_ref)
        est = str(cfg.algorithm.adv_estimator)
        if est not in ADV_ESTIMATOR_REGISTRY:
            raise ConfigError(f"algorithm.adv_estimator={est!r} is unknown; choose one of "
                              f"{sorted(k for k in ADV_ESTIMATOR_REGISTRY if str(k).startswith('flow_grpo'))}")
        trainer = TrainerSection.from_node(cfg.trainer)
        try:
            check_placement(cfg.actor_rollout_ref, asynchronous=trainer.samples_ahead)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return cls(data=data, actor_rollout_ref=arr, adv_estimator=est, reward=RewardSection.from_node(cfg.reward),
                   trainer=trainer)

    def __post_init__(self):
        self._check_rollout_placement()
        self._check_groups_and_batches()

    def _check_rollout_placement(self) -> None:
        from verl.workers.rollout.replica import RolloutReplicaRegistry

        rollout = self.actor_rollout_ref.rollout
        if rollout.name not in RolloutReplicaRegistry._registry:
            raise ConfigError(f"actor_rollout_ref.rollout.name={rollout.name!r} is not a registered rollout replica; "
                              f"choose one of {sorted(RolloutReplicaRegistry._registry)}")

    def _check_groups_and_batches(self) -> None:
        from verl_diffusion.algos.losses import get_loss_spec

        arr = self.actor_rollout_ref
        rollout, actor, est = arr.rollout, arr.actor, self.adv_estimator
        bs, workers = self.data.train_batch_size, self.trainer.num_workers
        if rollout.branched is not None:
            # TempFlow-GRPO (docs/algorithms.md §3.3): rows per step = prompts × |branch steps| × num_children;
            # rollout.n is unused.
            s = rollout.sampler
            if s.sampler not in ("flow_sde", "cps", "dance") or s.noise_level <= 0:
                raise ConfigError(f"actor_rollout_ref.rollout.branched.enabled=true needs a Flow-SDE-type sampler with "
                                  f"noise_level > 0 for the children (got rollout.sde.type={s.sampler}, "
                                  f"noise_level={s.noise_level}); docs/algorithms.md §3.3 uses flow_sde")
            if actor.loss_mode != "tempflow_grpo":
                raise ConfigError(f"actor_rollout_ref.rollout.branched.enabled=true is the TempFlow-GRPO rollout: use "
                                  f"actor_rollout_ref.actor.policy_loss.loss_mode=tempflow_grpo (got {actor.loss_mode})")
            if bs % workers:
                raise ConfigError(f"data.train_batch_size={bs} prompts do not split over {workers} workers; a branched "
                                  "rollout keeps each prompt's trunk and (prompt, k) groups on one worker")
        elif rollout.n == 1 and est in ("flow_grpo", "flow_grpo_gdpo"):
            raise ConfigError(f"actor_rollout_ref.rollout.n=1 with algorithm.adv_estimator={est}: a group of one "
                              "sample has advantage 0 and nothing trains; use n >= 2 or adv_estimator=flow_grpo_batch")
        n = rollout.rows_per_prompt
        samples = bs * n
        rows_name = "|branch steps| × num_children" if rollout.branched is not None else "rollout.n"
        if samples % workers:
            raise ConfigError(f"data.train_batch_size × {rows_name} = {samples} samples do not split over {workers} "
                              "workers (trainer.nnodes × trainer.n_gpus_per_node)")
        if get_loss_spec(actor.loss_mode).prepare is not None and bs % workers:
            raise ConfigError(f"data.train_batch_size={bs} prompts do not split over {workers} workers; "
                              f"loss_mode={actor.loss_mode} pre-processes whole groups on one worker")
        mini = actor.ppo_mini_batch_size * n
        if samples % mini or mini % workers:
            raise ConfigError(f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} prompts "
                              f"({mini} samples) must divide the {samples} samples of a step and split over {workers} "
                              "workers")
