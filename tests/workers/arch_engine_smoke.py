"""Each architecture's tiny model through the diffusion engine (FSDP2, gloo, 1 process, no Ray) with guidance on.

Executed by tests/workers/test_arch_engine_on_cpu.py in a subprocess (VERL_PLATFORM=cpu must be set before verl is
imported). Per architecture: LoRA on the adapter's default targets, a Flow-SDE rollout on the scheduler grid with
CFG (and FLUX.1's distilled guidance), one flow_grpo update through ``engine.train_batch``. Prints one JSON line:
|ℓ_train − ℓ_rollout| at the first micro-step (0 when training recomputes exactly what was sampled), the LoRA
layers whose weights changed, and the off-policy recompute of the old log-probs (``infer_batch``).
"""

import json
import os
import socket
import sys
import tempfile

# Guided settings per architecture: (CFG scale, negative prompt, adapter kwargs).
GUIDANCE = {"qwen_image": (4.0, " ", {}), "flux": (2.0, "", {"distilled_guidance_scale": 3.5}),
            "flux2_klein": (4.0, "", {})}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(archs: list[str]) -> None:
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
    from verl_diffusion.models import get_adapter_cls
    from verl_diffusion.models.base import Conditioning
    from verl_diffusion.models.tiny import save_tiny
    from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout, RolloutConfig
    from verl_diffusion.workers.engine import DiffusionModelConfig
    from verl_diffusion.workers.step_loss import make_step_loss

    root = tempfile.mkdtemp(prefix="vd_arch_")
    for arch in archs:
        torch.manual_seed(0)
        scale, negative, kwargs = GUIDANCE[arch]
        path = str(save_tiny(arch, os.path.join(root, arch)))
        cls = get_adapter_cls(arch)
        loss = make_step_loss("flow_grpo")
        engine = EngineRegistry.new(
            model_type="diffusion_model", backend="fsdp2",
            model_config=DiffusionModelConfig(path=path, lora_rank=4, lora_alpha=8, init_lora_weights="gaussian",
                                              target_modules=cls.LORA_TARGETS),
            engine_config=FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, mixed_precision={
                "param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}),
            optimizer_config=FSDPOptimizerConfig(lr=1e-2, total_training_steps=4, clip_grad=1.0),
            checkpoint_config=CheckpointConfig())
        engine.initialize()
        adapter = cls.from_pretrained(path, **kwargs)
        adapter.transformer = engine.module

        def velocity(x, t, rows):
            neg = Conditioning.from_dict({k[len("negative_"):]: v for k, v in rows.items() if k.startswith("negative_")})
            return adapter.velocity(x, t, Conditioning.from_dict(rows), guidance_scale=scale, negative_cond=neg)

        engine.velocity_fn_factory = lambda m: velocity
        rollout = DiffusersRollout(adapter, RolloutConfig(
            num_steps=4, grid="scheduler", height=64, width=64, micro_batch_size=4, guidance_scale=scale,
            negative_prompt=negative, noise_level=1.0, window={"mode": "fixed", "size": 2, "lo": 0, "hi": 2}))
        group_ids = torch.tensor([0, 0, 1, 1])
        out = rollout.generate(['a sign "ok"'] * 2 + ["blue car"] * 2, group_ids, seed=0)
        rewards = out["images"].float().mean(dim=(1, 2, 3))
        rows = {k: v for k, v in out.items() if k != "images"}
        rows["advantages"] = group_advantages(rewards, group_ids)[:, None].expand_as(rows["train_mask"]).float().contiguous()
        rows["old_log_probs"] = rows["rollout_log_probs"]
        rows["group_ids"] = group_ids
        td = TensorDict(rows, batch_size=[4])
        tu.assign_non_tensor(td, micro_batch_size_per_gpu=4)
        with engine.eval_mode():
            recomputed = engine.infer_batch(td, loss)["model_output"]["log_probs"]
        before = {n: p.detach().full_tensor().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
        with engine.train_mode():
            res = engine.train_batch(td, loss)
        changed = sorted({n.rsplit(".lora_", 1)[0] for n, p in engine.module.named_parameters()
                          if "lora_B" in n and not torch.equal(p.detach().full_tensor(), before[n])})
        mask = rows["train_mask"].bool()
        print(json.dumps({
            "arch": arch, "lr0": res["metrics"]["actor/log_ratio_abs_max"][0],
            "recompute_abs_max": float((recomputed - rows["rollout_log_probs"])[mask].abs().max()),
            "negative_keys": sorted(k for k in rows if k.startswith("negative_")),
            "grad_norm": res["metrics"]["grad_norm"], "changed_lora_layers": changed,
            "trained_items": int(mask.sum())}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(GUIDANCE))
