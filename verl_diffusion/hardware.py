"""GPU guidance per recipe: memory per GPU and seconds per training step, **estimated** (no recipe of this project has
been timed on a GPU yet), from the architecture's public parameter counts and the work the composed recipe does
per step. What it counts, so that a reader can redo it:

* a transformer forward costs 2·P·T FLOPs (P parameters, T = image + text tokens; +15% for attention at ~1-1.5k
  tokens); a forward + backward with gradient checkpointing costs 4 forwards; classifier-free guidance doubles
  both (one batched [negative; conditional] forward);
* per GPU and step: its images × (sampling steps + trained steps × ppo_epochs × 4) forwards, at 35% of an H100's
  989 dense bf16 TFLOP/s; text encoding, VAE decoding, rewards, validation and weight sync are left out;
* memory: text encoders and VAE in bf16 on every GPU, the transformer's bf16 weights sharded by FSDP plus one
  gathered block, fp32 master weights and Adam moments of the trainable parameters (sharded; a LoRA taken as 1% of
  the transformer), the checkpointed block inputs of one micro-batch, reward models that sit on the GPU
  (:data:`REWARD_GB`), and 20% for the allocator and buffers.

Treat the numbers as ±50%; measured figures replace them in docs/benchmarks.md when a GPU run exists.
"""

from __future__ import annotations

from dataclasses import dataclass

# Public model-card figures: parameters in billions; blocks and width of the transformer; text tokens the pipeline
# feeds it at its defaults.
ARCHITECTURES = {
    "sd3": dict(name="SD3.5-Medium", transformer=2.5, text=5.5, blocks=24, hidden=1536, text_tokens=333),
    "qwen_image": dict(name="Qwen-Image", transformer=20.4, text=8.3, blocks=60, hidden=3072, text_tokens=128),
    "flux": dict(name="FLUX.1-dev", transformer=11.9, text=4.9, blocks=57, hidden=3072, text_tokens=512),
    "flux2_klein": dict(name="FLUX.2-klein-base-9B", transformer=9.0, text=8.0, blocks=32, hidden=4096,
                        text_tokens=512),
}
# Recipe-name prefixes → architecture (the recipes name their model first).
PREFIXES = (("sd35_", "sd3"), ("qwenimage_", "qwen_image"), ("flux1_", "flux"), ("flux2_klein_", "flux2_klein"))
# Reward models that run on the training GPUs (bf16 weights, GB); OCR runs on the CPU, GenEval and VLM judges are servers.
REWARD_GB = {"pickscore": 2.0, "hpsv3": 16.0, "aesthetic": 1.0, "clip_score": 1.0}
H100_BF16_FLOPS = 989e12
MFU = 0.35


@dataclass
class Estimate:
    architecture: str
    gpus: int
    memory_gb: float
    seconds_per_step: float
    images_per_gpu: int

    def short(self) -> str:
        return (f"≈{self.memory_gb:.0f} GB/GPU, ≈{self.seconds_per_step:.0f} s/step on {self.gpus}×H100 "
                f"(estimate)")


def architecture_of_recipe(name: str):
    return next((arch for prefix, arch in PREFIXES if name.startswith(prefix)), None)


def estimate(name: str, cfg) -> "Estimate | None":
    """The estimate for recipe ``name`` composed as ``cfg`` (None for the CPU demo)."""
    from verl_diffusion.algos.windows import window_steps
    from verl_diffusion.config.schema import RolloutSection

    arch = architecture_of_recipe(name)
    if arch is None:
        return None
    a = ARCHITECTURES[arch]
    arr = cfg.actor_rollout_ref
    section = RolloutSection.from_node(arr.rollout)
    rollout = section.sampler
    gpus = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    rows = section.rows_per_prompt
    images = int(cfg.data.train_batch_size) * rows // gpus
    mode = str(arr.actor.policy_loss.loss_mode)
    if mode in ("awm", "diffusion_nft", "path_space"):
        trained = rollout.num_steps          # training times drawn from the whole grid
    else:
        trained = len(window_steps(rollout.window, num_steps=rollout.num_steps)) if rollout.sampler != "ode" else 0
    trained = max(1, round(trained * float(arr.actor.get("train_step_fraction", 1.0) or 1.0)))
    cfg_factor = 2 if float(rollout.guidance_scale) != 1.0 else 1
    size = int(arr.rollout.resolution)
    tokens = (size // 16) ** 2 + a["text_tokens"]
    forward = 2 * a["transformer"] * 1e9 * tokens * 1.15
    epochs = int(arr.actor.ppo_epochs)
    forwards = images * cfg_factor * (rollout.num_steps + trained * epochs * 4)
    seconds = forwards * forward / (H100_BF16_FLOPS * MFU)
    lora = int(arr.model.get("lora_rank", 0) or 0) > 0
    p = a["transformer"] * 1e9
    trainable = 0.01 * p if lora else p
    weights = a["text"] * 1e9 * 2 + p * 2 / gpus + p * 2 / a["blocks"] + trainable * 12 / gpus
    micro = int(arr.actor.ppo_micro_batch_size_per_gpu) * cfg_factor
    activations = micro * tokens * a["hidden"] * 2 * (a["blocks"] + 30)
    rewards = sum(REWARD_GB.get(str(k), 0.0) for k in cfg.reward.components) * 2 ** 30
    memory = (weights + activations + rewards) * 1.2 / 2 ** 30
    return Estimate(a["name"], gpus, memory, seconds, images)
