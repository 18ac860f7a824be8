"""Run every registered loss through the diffusion engine in one gloo process (no Ray).

Executed by tests/workers/test_engine_on_cpu.py in a subprocess (VERL_PLATFORM=cpu must be set before verl is
imported). Prints one JSON line per loss mode: finite loss, parameters changed, |ℓ_train − ℓ_rollout| at the
first micro-step.
"""

import json
import os
import socket
import sys
import tempfile


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(modes: list[str], lora: int) -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1)
    import verl  # noqa: F401  (loads the plugin: platform, engine)
    from tensordict import TensorDict
    from verl.trainer.config import CheckpointConfig
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig
    from verl.workers.engine import EngineRegistry

    from verl_diffusion.algos.advantages import group_advantages
    from verl_diffusion.algos.losses import LOSSES, load_builtin_losses
    from verl_diffusion.models.base import Conditioning
    from verl_diffusion.models.sd3 import SD3Adapter
    from verl_diffusion.models.tiny import save_tiny_sd3
    from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout, RolloutConfig
    from verl_diffusion.workers.engine import DiffusionModelConfig
    from verl_diffusion.workers.step_loss import make_step_loss, prepare_steps

    load_builtin_losses()
    modes = modes or sorted(LOSSES)
    path = os.path.join(tempfile.mkdtemp(prefix="vd_smoke_"), "tiny")
    save_tiny_sd3(path)
    for mode in modes:
        torch.manual_seed(0)
        loss = make_step_loss(mode)
        engine = EngineRegistry.new(
            model_type="diffusion_model", backend="fsdp2",
            model_config=DiffusionModelConfig(path=path, lora_rank=lora, lora_alpha=2 * max(lora, 1),
                                              init_lora_weights="gaussian" if lora else True),
            engine_config=FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, mixed_precision={
                "param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}),
            optimizer_config=FSDPOptimizerConfig(lr=1e-3, total_training_steps=4, clip_grad=1.0),
            checkpoint_config=CheckpointConfig())
        engine.initialize()
        adapter = SD3Adapter.from_pretrained(path)
        adapter.transformer = engine.module
        engine.velocity_fn_factory = lambda m: (lambda x, t, rows: adapter.velocity(x, t, Conditioning.from_dict(rows)))
        if loss.needs_reference() and not lora:
            ref = SD3Adapter.from_pretrained(path)   # frozen base model as the reference (full fine-tune)
            engine.ref_velocity_fn = lambda x, t, rows: ref.velocity(x, t, Conditioning.from_dict(rows))
        rollout = DiffusersRollout(adapter, RolloutConfig(num_steps=4, height=64, width=64, micro_batch_size=4,
                                                          window={"mode": "fixed", "size": 2, "lo": 0, "hi": 2}))
        store = bool({"old_velocity", "old_mean"} & set(loss.spec.batch_keys))
        group_ids = torch.tensor([0, 0, 1, 1])
        out = rollout.generate(["red apple"] * 2 + ["blue car"] * 2, group_ids, seed=0, store_velocities=store)
        rewards = out["images"].float().mean(dim=(1, 2, 3))
        adv = group_advantages(rewards, group_ids)
        rows = {k: v for k, v in out.items() if k != "images"}
        rows["advantages"] = adv[:, None].expand_as(rows["train_mask"]).float().contiguous()
        rows["old_log_probs"] = rows["rollout_log_probs"]
        rows["group_ids"] = group_ids
        with engine.eval_mode():
            rows.update(prepare_steps(loss, rows, velocity_fn=engine.velocity_fn(),
                                      generator=torch.Generator().manual_seed(0)))
        td = TensorDict(rows, batch_size=[4])
        tu.assign_non_tensor(td, micro_batch_size_per_gpu=4)
        before = [p.detach().full_tensor().clone() for p in engine.module.parameters() if p.requires_grad]
        with engine.train_mode():
            res = engine.train_batch(td, loss)
        after = [p.detach().full_tensor() for p in engine.module.parameters() if p.requires_grad]
        changed = max(float((a - b).abs().max()) for a, b in zip(after, before))
        losses = res["loss"]
        lr0 = res["metrics"].get("actor/log_ratio_abs_max", [None])[0]
        print(json.dumps({"mode": mode, "loss": sum(losses), "finite": all(map(lambda v: v == v and abs(v) < 1e30, losses)),
                          "param_change": changed, "grad_norm": res["metrics"]["grad_norm"], "lr0": lr0}), flush=True)


if __name__ == "__main__":
    lora = int(os.environ.get("SMOKE_LORA", "0"))
    main(sys.argv[1:], lora)
