"""Two Ray actors, one sender and one receiver, sync a tiny SD3 transformer through the ``diffusion_gloo``
checkpoint engine, driven step by step as verl's ``CheckpointEngineManager`` drives it (prepare, build_topology,
init_process_group, send / receive, finalize).

Executed by tests/rollout/test_checkpoint_engine_on_cpu.py in a subprocess (VERL_PLATFORM=cpu before verl is
imported; classes of a ``__main__`` script travel to Ray by value). Prints one ``RESULT {json}`` line.
"""

import json
import os
import sys

# A small bucket, so that the tiny model needs several buckets and some tensors are larger than one.
BUCKET = 16 << 10


def build(seed: int, lora: bool):
    import torch
    from peft import LoraConfig, inject_adapter_in_model

    from verl_diffusion.models.tiny import build_tiny_sd3_pipeline

    module = build_tiny_sd3_pipeline(seed=seed).transformer
    if lora:
        torch.manual_seed(seed + 100)
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v"],
                                           init_lora_weights="gaussian"), module, adapter_name="default")
    return module


def main() -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {
        "VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})

    @ray.remote(num_cpus=0)
    class Side:
        """One end of the sync: a tiny transformer and a checkpoint engine from verl's registry."""

        def __init__(self, seed: int, lora: bool, is_master: bool):
            import verl  # noqa: F401  (loads the plugin, which registers the backend)
            from verl.checkpoint_engine import CheckpointEngineRegistry

            self.module = build(seed, lora)
            self.engine = CheckpointEngineRegistry.new("diffusion_gloo", bucket_size=BUCKET, is_master=is_master)

        def call(self, method, *args, **kwargs):
            return getattr(self.engine, method)(*args, **kwargs)

        def perturb(self, scale: float, lora_only: bool):
            import torch

            gen = torch.Generator().manual_seed(int(scale * 1000))
            with torch.no_grad():
                for name, p in self.module.named_parameters():
                    if lora_only and "lora_" not in name:
                        continue
                    p.add_(scale * torch.randn(p.shape, generator=gen))

        def state(self):
            return {k: v.clone() for k, v in self.module.state_dict().items()}

        def send(self, lora_only: bool):
            from verl_diffusion.rollout.checkpoint_engine import actor_weights
            from verl_diffusion.workers.weight_sync import run_coroutine

            return run_coroutine(self.engine.send_weights(actor_weights(self.module, lora_only=lora_only)))

        async def receive(self):
            from verl_diffusion.rollout.checkpoint_engine import load_weights_into

            names = []

            async def collect():
                async for name, tensor in self.engine.receive_weights():
                    names.append(name)
                    yield name, tensor

            pairs = [p async for p in collect()]
            stats = load_weights_into(self.module, pairs)
            return {"names": names, **stats}

    def sync(sender, receiver, lora_only: bool):
        from verl_diffusion.rollout.checkpoint_engine import GlooCheckpointEngine

        meta = ray.get([sender.call.remote("prepare"), receiver.call.remote("prepare")])
        actor_kw, rollout_kw = GlooCheckpointEngine.build_topology(1, 1, meta)
        ray.get([sender.call.remote("init_process_group", **{k: v[0] for k, v in actor_kw.items()}),
                 receiver.call.remote("init_process_group", **{k: v[0] for k, v in rollout_kw.items()})])
        sent, got = ray.get([sender.send.remote(lora_only), receiver.receive.remote()])
        ray.get([sender.call.remote("finalize"), receiver.call.remote("finalize")])
        return sent, got

    def compare(a, b):
        return {"keys_equal": sorted(a) == sorted(b),
                "max_abs_diff": max(float((a[k] - b[k]).abs().max()) for k in a),
                "bitwise_equal": all(torch.equal(a[k], b[k]) for k in a)}

    import torch

    out = {}
    try:
        # One pair of actors with LoRA layers: two full syncs (every tensor), then two LoRA-only syncs.
        sender = Side.remote(seed=0, lora=True, is_master=True)
        receiver = Side.remote(seed=1, lora=True, is_master=False)   # different random weights to start
        s0, r0 = ray.get([sender.state.remote(), receiver.state.remote()])
        out["before"] = compare(s0, r0)
        sizes = {k: v.numel() * v.element_size() for k, v in s0.items()}
        out["state_bytes"] = sum(sizes.values())
        out["lora_bytes"] = sum(v for k, v in sizes.items() if "lora_" in k)
        out["largest_tensor_bytes"] = max(sizes.values())
        lora_keys = [k for k in s0 if "lora_" in k]
        out["lora_tensors"] = len(lora_keys)
        for i, perturb in enumerate((None, 0.01)):   # full: first sync, then after changing every tensor
            if perturb:
                ray.get(sender.perturb.remote(perturb, False))
            sent, got = sync(sender, receiver, lora_only=False)
            out[f"full_{i}"] = {"sent": sent, "received": got["bytes"], "tensors": got["tensors"],
                                **compare(*ray.get([sender.state.remote(), receiver.state.remote()]))}
        r_base = ray.get(receiver.state.remote())
        for i, perturb in enumerate((0.5, 0.02)):   # LoRA: the adapter changed, the base did not
            ray.get(sender.perturb.remote(perturb, True))
            sent, got = sync(sender, receiver, lora_only=True)
            s1, r1 = ray.get([sender.state.remote(), receiver.state.remote()])
            out[f"lora_{i}"] = {"sent": sent, "received": got["bytes"], "crossed": len(got["names"]),
                                "only_lora_crossed": all("lora_" in n for n in got["names"]),
                                "base_untouched": all(torch.equal(r_base[k], r1[k]) for k in r1 if "lora_" not in k),
                                **compare(s1, r1)}
    finally:
        ray.shutdown()
    print("RESULT " + json.dumps(out, default=float), flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
