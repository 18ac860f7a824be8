"""A diffusers engine in verl's ``EngineRegistry``: FSDP/FSDP2 around a flow-matching transformer.

``DiffusersFSDPEngine`` subclasses verl's ``FSDPEngine`` and reuses its device mesh, FSDP2 wrapping
(diffusers' ``_no_split_modules``), mixed precision, optimizer / LR-scheduler builders, gradient clipping,
offload and ``disable_adapter``. It replaces what is LLM-shaped:

* ``_build_module``: the transformer of a diffusers pipeline folder (class read from its config.json);
* ``_build_lora_module``: peft LoRA without ``TaskType.CAUSAL_LM``;
* ``forward_backward_batch``: the per-timestep loss of ``workers/step_loss.py`` with gradient accumulation
  over micro-batches × trained timesteps (rows = samples of the rollout batch, docs/data_flow.md);
* checkpointing: verl's FSDP manager calls the HF-only ``can_generate``; :class:`DiffusionCheckpointManager`
  writes the same per-rank shard files (model / optim / extra with RNG) without the HF parts.

Registered as ``model_type="diffusion_model"``, backends ``fsdp`` and ``fsdp2``, devices cuda / npu / cpu.
On CPU use ``fsdp2`` (FSDP1's ``sync_module_states`` needs accelerator params).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed

from verl.base_config import BaseConfig
from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager
from verl.utils.device import get_device_id, get_device_name
import warnings

with warnings.catch_warnings():
    # verl announces every optional engine it lacks (torchtitan, veomni, megatron, ...) in every process.
    warnings.filterwarnings("ignore", message=r".* engine is not available", category=UserWarning)
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

from verl_diffusion.models.base import transformer_class
from verl_diffusion.models.lora import inject_lora  # noqa: F401  (the engine and standalone replicas share it)
from verl_diffusion.workers.step_loss import (DiffusionStepLoss, rows_trained_at, run_step_loss, select_rows,
                                              step_log_probs, step_tensors)

logger = logging.getLogger(__name__)

MODEL_TYPE = "diffusion_model"

# LoRA targets of the SD3 / Flux joint-attention blocks (Flow-GRPO's choice).
DEFAULT_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")


@dataclass
class DiffusionModelConfig(BaseConfig):
    """Model config of the diffusion engine (the LLM ``HFModelConfig`` loads an HF causal-LM config).

    ``path`` is a diffusers pipeline folder; the engine trains its ``transformer_subfolder`` model.
    """

    _mutable_fields = {"model_type", "local_path"}

    # diffusers pipeline folder (model_index.json, transformer/, vae/, text encoders).
    path: str = ""
    local_path: Optional[str] = None
    # Sub-folder of the trained network inside the pipeline folder.
    transformer_subfolder: str = "transformer"
    model_type: str = MODEL_TYPE
    # LoRA (0 = full fine-tune). alpha / rank scaling as in peft.
    lora_rank: int = 0
    lora_alpha: int = 16
    target_modules: Any = DEFAULT_LORA_TARGETS
    # peft init: True (B = 0, the adapter starts as the identity) or "gaussian".
    init_lora_weights: Any = True
    lora_adapter_path: Optional[str] = None
    lora: dict = field(default_factory=dict)
    enable_gradient_checkpointing: bool = False
    enable_activation_offload: bool = False
    use_remove_padding: bool = False
    use_fused_kernels: bool = False
    use_liger: bool = False
    trust_remote_code: bool = False
    use_shm: bool = False

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("actor_rollout_ref.model.path is empty; give a diffusers pipeline folder")
        if self.local_path is None:
            self.local_path = self.path

    def get_processor(self):
        return None


def load_transformer(path: str, subfolder: str, dtype: torch.dtype):
    """The pipeline's transformer in ``dtype``, every parameter included."""
    module = transformer_class(path, subfolder).from_pretrained(path, subfolder=subfolder, torch_dtype=dtype)
    # from_pretrained(torch_dtype=) already casts; a blanket .to(dtype) only when something still differs, since
    # diffusers warns on every .to(dtype) call ("modules that should be kept in float32: []"), even an empty list.
    if any(p.dtype != dtype for p in module.parameters()):
        module.to(dtype)
    return module


@contextlib.contextmanager
def _cpu_offload_without_pinning():
    """verl's FSDP2 forward-only path builds ``CPUOffloadPolicy(pin_memory=True)``, which needs an
    accelerator; on the CPU platform build it with ``pin_memory=False`` (verl assumes an accelerator here)."""
    if get_device_name() != "cpu":
        yield
        return
    import verl.workers.engine.fsdp.transformer_impl as impl

    orig = impl.CPUOffloadPolicy

    def no_pin(*args, **kwargs):
        kwargs["pin_memory"] = False
        return orig(*args, **kwargs)

    impl.CPUOffloadPolicy = no_pin
    try:
        yield
    finally:
        impl.CPUOffloadPolicy = orig


class DiffusionCheckpointManager(BaseCheckpointManager):
    """Per-rank shards ``model/optim/extra_world_size_{W}_rank_{r}.pt`` (verl's file names), no HF parts. With
    ``trainable_only`` (LoRA runs) the model shards hold the trainable weights only.

    ``extra`` holds the LR scheduler, the RNG states and any ``extra_state_fn()`` dict (EMA).
    """

    def __init__(self, *args, extra_state_fn: Optional[Callable[[], dict]] = None,
                 load_extra_state_fn: Optional[Callable[[dict], None]] = None, trainable_only: bool = False,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.extra_state_fn = extra_state_fn
        self.load_extra_state_fn = load_extra_state_fn
        # LoRA runs: the frozen base is the model folder's own, reloaded at start; shards hold the adapter only.
        self.trainable_only = trainable_only

    def _model_state(self) -> dict:
        state = self.model.state_dict()
        if not self.trainable_only:
            return state
        trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
        return {k: v for k, v in state.items() if k in trainable}

    def _paths(self, local_path: str) -> tuple[str, str, str]:
        w, r = self.world_size, self.rank
        return tuple(os.path.join(local_path, f"{kind}_world_size_{w}_rank_{r}.pt")
                     for kind in ("model", "optim", "extra"))

    def save_checkpoint(self, local_path: str, hdfs_path: str = None, global_step: int = 0,
                        max_ckpt_to_keep=None):
        if local_path is None:
            return
        self.previous_global_step = global_step
        if self.rank == 0:
            self.ensure_checkpoint_capacity(max_ckpt_to_keep)
        os.makedirs(local_path, exist_ok=True)
        torch.distributed.barrier()
        model_path, optim_path, extra_path = self._paths(local_path)
        if self.should_save_model:
            torch.save(self._model_state(), model_path)
        if self.should_save_optimizer and self.optimizer is not None:
            torch.save(self.optimizer.state_dict(), optim_path)
        if self.should_save_extra:
            extra = {"lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
                     "rng": self.get_rng_state()}
            if self.extra_state_fn is not None:
                extra["user"] = self.extra_state_fn()
            torch.save(extra, extra_path)
        torch.distributed.barrier()
        if self.rank == 0:
            self.register_checkpoint(local_path, max_ckpt_to_keep)

    def load_checkpoint(self, local_path: str, hdfs_path: str = None, del_local_after_load=False):
        if local_path is None:
            return
        model_path, optim_path, extra_path = self._paths(local_path)
        if self.should_load_model:
            state = torch.load(model_path, weights_only=False)
            missing, unexpected = self.model.load_state_dict(state, strict=not self.trainable_only)
            trainable = {n for n, p in self.model.named_parameters() if p.requires_grad}
            if unexpected or set(missing) & trainable:
                raise ValueError(f"{model_path} does not match the model: {len(unexpected)} unknown keys "
                                 f"{sorted(unexpected)[:3]}, trainable weights missing {sorted(set(missing) & trainable)[:3]}")
        if self.should_load_optimizer and self.optimizer is not None and os.path.exists(optim_path):
            self.optimizer.load_state_dict(torch.load(optim_path, weights_only=False))
        if self.should_load_extra and os.path.exists(extra_path):
            extra = torch.load(extra_path, weights_only=False)
            if extra.get("lr_scheduler") is not None and self.lr_scheduler is not None:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
            if "rng" in extra:
                self.load_rng_state(extra["rng"])
            if extra.get("user") is not None and self.load_extra_state_fn is not None:
                self.load_extra_state_fn(extra["user"])
        torch.distributed.barrier()


def default_velocity_fn(module: torch.nn.Module) -> Callable:
    """v(x_t, t, rows) for an SD3-style transformer called directly (used until a model adapter is set)."""

    def velocity(x_t: torch.Tensor, t: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return module(hidden_states=x_t, timestep=t * 1000.0, encoder_hidden_states=rows["prompt_embeds"],
                      pooled_projections=rows["pooled_prompt_embeds"], return_dict=False)[0]

    return velocity


class DiffusersFSDPEngine(FSDPEngine):
    """verl's FSDP engine around a diffusers transformer, trained with a per-timestep loss."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        # velocity_fn(module) -> v(x_t, t, rows); the worker sets the model adapter's.
        self.velocity_fn_factory: Callable[[torch.nn.Module], Callable] = default_velocity_fn
        # Extra state saved with checkpoints (EMA); set by the worker.
        self.extra_state_fn: Optional[Callable[[], dict]] = None
        self.load_extra_state_fn: Optional[Callable[[dict], None]] = None
        # Optional frozen reference network for REF_VELOCITY when not LoRA (a no-grad velocity fn).
        self.ref_velocity_fn: Optional[Callable] = None
        # Optimizer steps taken so far (n of the old-policy schedules, docs/algorithms.md §8.2; saved by the worker).
        self.optimizer_steps = 0
        # Set by the worker before an update: the next training call records rollout/logprob_abs_diff (its first
        # mini-batch runs before any optimizer step, i.e. with the weights the rollout sampled with).
        self.consistency_probe = False

    # ------------------------------------------------------------------ build

    def initialize(self):
        self._build_model_optimizer()
        self.checkpoint_manager = DiffusionCheckpointManager(
            model=self.module, optimizer=self.optimizer, lr_scheduler=self.lr_scheduler,
            processing_class=None, checkpoint_config=self.checkpoint_config,
            extra_state_fn=lambda: self.extra_state_fn() if self.extra_state_fn else None,
            load_extra_state_fn=lambda s: self.load_extra_state_fn(s) if self.load_extra_state_fn else None,
            trainable_only=bool(self._is_lora),
        )
        self.to(device="cpu", model=self._is_offload_param, optimizer=self._is_offload_optimizer,
                grad=self._is_offload_param)

    def _build_module(self):
        from verl.utils.torch_dtypes import PrecisionType

        dtype = self.engine_config.model_dtype or "fp32"
        dtype = PrecisionType.to_dtype(dtype)
        module = load_transformer(self.model_config.local_path, self.model_config.transformer_subfolder, dtype)
        if self.model_config.enable_gradient_checkpointing and hasattr(module, "enable_gradient_checkpointing"):
            module.enable_gradient_checkpointing()
        return module

    def _build_lora_module(self, module):
        """peft LoRA injected in place (no ``PeftModel`` wrapper, no ``TaskType.CAUSAL_LM``): the module keeps
        its diffusers class, so FSDP2 still finds ``_no_split_modules`` and the model adapter's
        ``disable_adapter`` (``models.base.disable_lora_layers``) works on the wrapped module."""
        return inject_lora(module, self.model_config)

    def _build_fsdp_module(self, module):
        with _cpu_offload_without_pinning():
            return super()._build_fsdp_module(module)

    def optimizer_step(self):
        grad_norm = super().optimizer_step()
        self.optimizer_steps += 1
        return grad_norm

    # ------------------------------------------------------------------ model calls

    def velocity_fn(self) -> Callable:
        return self.velocity_fn_factory(self.module)

    def reference_velocity_fn(self) -> Optional[Callable]:
        """No-grad v_ref: the base model with the LoRA adapter disabled, else a frozen reference set by the worker."""
        if self.ref_velocity_fn is not None:
            return self.ref_velocity_fn
        if not self._is_lora:
            return None
        vel = self.velocity_fn()

        def ref(x_t, t, rows):
            with self.disable_adapter():
                return vel(x_t, t, rows)

        return ref

    def disable_adapter(self):
        if not self._is_lora:
            return contextlib.nullcontext()
        from verl_diffusion.models.base import disable_lora_layers

        return disable_lora_layers(self.module)

    # ------------------------------------------------------------------ forward / backward

    def _union_trained_steps(self, train_mask: torch.Tensor) -> list[int]:
        """Trained steps of this rank's rows, united over the DP group (every rank runs the same forwards,
        as FSDP collectives require)."""
        any_k = train_mask.bool().any(dim=0).to(torch.int32).to(get_device_id())
        if torch.distributed.is_initialized() and torch.distributed.get_world_size(self.get_data_parallel_group()) > 1:
            torch.distributed.all_reduce(any_k, op=torch.distributed.ReduceOp.MAX, group=self.get_data_parallel_group())
        return [int(k) for k in torch.nonzero(any_k.cpu()).flatten().tolist()]

    def _dp_size(self) -> int:
        if not torch.distributed.is_initialized():
            return 1
        return torch.distributed.get_world_size(self.get_data_parallel_group())

    def _micro_step_table(self, train_mask: torch.Tensor, micro: list) -> torch.Tensor:
        """[n_micro, N] bool: some rank has a row trained at step k in its micro-batch m (the ranks have the same
        number of micro-batches). A (micro-batch, step) that no rank trains is skipped everywhere; one that only
        other ranks train gets a one-row stand-in forward here, so FSDP collectives stay matched."""
        local = torch.stack([train_mask[idx].bool().any(dim=0) for idx in micro]).to(torch.int32).to(get_device_id())
        if self._dp_size() > 1:
            torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX, group=self.get_data_parallel_group())
        return local.cpu().bool()

    def forward_backward_batch(self, data, loss_function, forward_only=False) -> dict:
        """Rows = samples. Training: Σ over micro-batches × trained steps of the step loss, each weighted by
        its share of the mini-batch's items, one backward per (micro-batch, step). At step k only the rows of the
        micro-batch trained at k are forwarded (all of them for an ordinary rollout, whose rows share the window;
        one branch step's children for a branched TempFlow rollout).
        ``forward_only``: the log-probs ℓ_θ [B, N] at the trained steps (old-log-prob recompute), same rows.
        """
        from verl.utils import tensordict_utils as tu

        rows_all = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        dev = get_device_id()
        rows_all = {k: v.to(dev) for k, v in rows_all.items()}
        B = rows_all["all_latents"].shape[0]
        mbs = tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None) or B
        mbs = int(mbs)
        steps = self._union_trained_steps(rows_all["train_mask"])
        micro = [torch.arange(s, min(s + mbs, B), device=dev) for s in range(0, B, mbs)]
        table = self._micro_step_table(rows_all["train_mask"], micro)
        velocity = self.velocity_fn()
        metrics: dict[str, list] = {}

        if forward_only:
            convention = getattr(loss_function, "log_prob_convention", "exact")
            out = torch.zeros(rows_all["train_mask"].shape, dtype=torch.float32, device=dev)
            with torch.no_grad():
                for m, idx in enumerate(micro):
                    rows = {k: v[idx] for k, v in rows_all.items()}
                    for k in steps:
                        if not bool(table[m, k]):
                            continue
                        sel = rows_trained_at(rows, k)
                        if sel is not None and sel.numel() == 0:
                            # other ranks train here: a one-row forward keeps the FSDP collectives matched
                            one = select_rows(rows, torch.zeros(1, dtype=torch.long, device=dev))
                            velocity(one["all_latents"][:, k], one["sigmas"][:, k], one)
                            continue
                        sub = select_rows(rows, sel)
                        st = step_tensors(sub, k)
                        v = velocity(st["x_t"], st["t"], sub)
                        lp = step_log_probs(st, v, convention=convention).float()
                        if sel is None:
                            out[idx, k] = lp * rows["train_mask"][:, k].float()
                        else:
                            out[idx[sel], k] = lp
            return {"model_output": {"log_probs": out.cpu()}, "loss": [0.0], "metrics": {}}

        assert isinstance(loss_function, DiffusionStepLoss), "the diffusion engine needs a DiffusionStepLoss"
        ref_fn = self.reference_velocity_fn() if loss_function.needs_reference() else None
        total_items = max(int(rows_all["train_mask"][:, steps].sum()) if steps else 0, 1)
        probe, self.consistency_probe = self.consistency_probe, False
        losses = []
        todo = [(m, k) for m in range(len(micro)) for k in steps if bool(table[m, k])]
        for i_backward, (m, k) in enumerate(todo, start=1):
            rows = {key: v[micro[m]] for key, v in rows_all.items()}
            with self._gradient_sync_context(is_last_micro_batch=i_backward == len(todo)):
                out, n, q, st = run_step_loss(loss_function, rows, k, velocity_fn=velocity, ref_velocity_fn=ref_fn)
                if out is None:
                    # Other ranks train this (micro-batch, step): a zero loss on a one-row forward keeps the FSDP
                    # collectives (all-gather, reduce-scatter) in step across ranks.
                    one = select_rows(rows, torch.zeros(1, dtype=torch.long, device=dev))
                    loss = velocity(one["all_latents"][:, k], one["sigmas"][:, k], one).sum() * 0.0
                else:
                    loss = out.loss * (n / total_items)
                    for name, val in out.metrics.items():
                        metrics.setdefault(name, []).append(float(val))
                    if q.log_prob is not None and "old_log_prob" in loss_function.spec.batch_keys:
                        lr_ = q.log_prob.detach() - st["old_log_prob"]
                        metrics.setdefault("actor/log_ratio_abs_max", []).append(float(lr_.abs().max()))
                    if probe and q.log_prob is not None and st.get("rollout_log_prob") is not None:
                        # Train/rollout consistency: log π_train of this forward vs the
                        # rollout's log π at the same (x_t, x_next), mean over the rows; free, no extra forward.
                        gap = (q.log_prob.detach().float() - st["rollout_log_prob"].float()).abs().mean()
                        metrics.setdefault("rollout/logprob_abs_diff", []).append(float(gap))
                if self.scaler is not None:
                    self.scaler.scale(loss).backward()
                else:
                    loss.backward()
                losses.append(float(loss.detach()))
        return {"model_output": {}, "loss": losses or [0.0], "metrics": metrics}


_REGISTERED = False


def register_engines() -> list[str]:
    """Register :class:`DiffusersFSDPEngine` for ``diffusion_model`` × {fsdp, fsdp2} × {cuda, npu, cpu}."""
    global _REGISTERED
    if not _REGISTERED:
        EngineRegistry.register(model_type=MODEL_TYPE, backend=["fsdp", "fsdp2"], device=["cuda", "npu", "cpu"])(
            DiffusersFSDPEngine)
        _REGISTERED = True
    return [f"engine:{MODEL_TYPE}:fsdp,fsdp2:cuda,npu,cpu"]
