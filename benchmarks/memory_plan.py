"""GPU memory and throughput plan of the Qwen-Image / FLUX recipes at the real model sizes (docs/recipes.md).

Builds each transformer on the meta device from its published config (no weights, no GPU), counts parameters and
the LoRA parameters the adapter's default targets add (rank from the recipe), and estimates per-GPU memory and
FLOPs per image from the recipe's settings. Printed as a markdown table. Estimates, not measurements:

* weights bf16 (2 B/param); the frozen text encoder and VAE replicated on every GPU; the transformer FSDP2-sharded
  over the node's GPUs (or whole on one GPU); LoRA weights bf16, their grads and AdamW moments fp32 (2 + 4 + 8 B);
* activations with gradient checkpointing: the block inputs of every block (seq × dim × 2 B per block and sequence)
  plus one block's intermediates (≈ 24 × seq × dim × 2 B), per trained sequence of the micro-batch (CFG doubles
  the sequences);
* FLOPs: 2 · params · tokens per forward (+ attention 4 · blocks · seq² · dim); rollout N forwards (× 2 with CFG),
  training per trained step forward + backward + recompute ≈ 4 forwards (× 2 with CFG).

    python benchmarks/memory_plan.py [--mfu 0.4] [--peak-tflops 989]
"""

from __future__ import annotations

import argparse
import re

import torch

# Published transformer configs (diffusers' defaults are Qwen-Image's and FLUX.1-dev's; FLUX.2-klein-9B from its
# model card: 8 double + 24 single blocks of width 32×128, Qwen3-8B text (3 × 4096 = 12288), guidance off).
MODELS = {
    "Qwen-Image (20B)": ("QwenImageTransformer2DModel", {}, "qwen_image", 8.29e9, 0.13e9, 3072),
    "FLUX.2-klein-base-9B": ("Flux2Transformer2DModel", dict(num_layers=8, num_single_layers=24, num_attention_heads=32,
                                                              joint_attention_dim=12288, guidance_embeds=False),
                             "flux2_klein", 8.19e9, 0.08e9, 4096),
    "FLUX.1-dev (12B)": ("FluxTransformer2DModel", dict(guidance_embeds=True, num_layers=19, num_single_layers=38),
                         "flux", 4.88e9, 0.08e9, 3072),
}
# recipe -> (model, LoRA rank, image tokens at 512 px, text tokens, N, trained steps, CFG, micro-batch, GPUs, TE name)
RECIPES = {
    "qwenimage_ocr_flowgrpo": ("Qwen-Image (20B)", 64, 1024, 256, 10, 2, True, 8, 4),
    "qwenimage_hpsv3_path_space": ("Qwen-Image (20B)", 64, 1024, 256, 10, 10, False, 4, 8),
    "qwenimage_hpsv3_diffusion_nft": ("Qwen-Image (20B)", 64, 1024, 256, 10, 9, False, 4, 8),
    "flux2_klein_ocr_flow_dppo": ("FLUX.2-klein-base-9B", 64, 1024, 512, 14, 3, False, 8, 8),
    "flux1_dev_pickscore_flow_dppo": ("FLUX.1-dev (12B)", 64, 1024, 512, 10, 3, False, 8, 8),
}
GB = 1024 ** 3


def count(model_name: str, rank: int):
    import diffusers
    from accelerate import init_empty_weights

    from verl_diffusion.models import get_adapter_cls

    cls_name, kwargs, arch, te, vae, dim = MODELS[model_name]
    with init_empty_weights():
        model = getattr(diffusers, cls_name)(**kwargs)
    params = sum(p.numel() for p in model.parameters())
    targets = get_adapter_cls(arch).LORA_TARGETS
    lora = 0
    blocks = 0
    for name, m in model.named_modules():
        if re.fullmatch(r"(single_)?transformer_blocks\.\d+", name):
            blocks += 1
        hit = re.fullmatch(targets, name) if isinstance(targets, str) else any(
            name == t or name.endswith("." + t) for t in targets)
        if hit and isinstance(m, torch.nn.Linear):
            lora += rank * (m.in_features + m.out_features)
    return params, lora, te, vae, dim, blocks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed for the estimate")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of one GPU (H100/H800/H200)")
    ap.add_argument("--write", default=None, help="also write the table (and the command) to this markdown file")
    args = ap.parse_args()
    rows = []
    for recipe, (model, rank, img, txt, n, trained, cfg, mb, gpus) in RECIPES.items():
        params, lora, te, vae, dim, blocks = count(model, rank)
        seq = img + txt
        mult = 2 if cfg else 1
        frozen = (te + vae) * 2 / GB
        tr_shard = params * 2 / GB / gpus
        lora_state = lora * (2 + 4 + 8) / GB / gpus
        act = mb * mult * (blocks * seq * dim * 2 + 24 * seq * dim * 2) / GB
        per_gpu = frozen + tr_shard + lora_state + act + 2 * params * 2 / GB / blocks   # + 2 gathered blocks
        one_gpu = frozen + params * 2 / GB + lora * 14 / GB + act
        fwd = 2 * params * seq + 4 * blocks * seq * seq * dim
        flops = fwd * mult * (n + 4 * trained)
        img_s = args.mfu * args.peak_tflops * 1e12 / flops
        rows.append((recipe, model, params / 1e9, lora / 1e6, (te + vae) / 1e9, gpus, per_gpu, one_gpu, flops / 1e15,
                     img_s))
    lines = [f"Estimates (no GPU): {args.mfu:.0%} MFU of {args.peak_tflops:.0f} dense bf16 TFLOPS per GPU; parameter "
             "and LoRA counts exact for the configs in the script.", "",
             "| recipe | model | transformer params (B) | LoRA params (M) | text enc + VAE (B) | GPUs | est. GB/GPU "
             "(FSDP2 over the node) | est. GB on 1 GPU (no offload) | PFLOP / image | est. images/s/GPU |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]:.2f} | {r[3]:.0f} | {r[4]:.2f} | {r[5]} | {r[6]:.1f} | {r[7]:.1f} | "
              f"{r[8]:.2f} | {r[9]:.2f} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if args.write:
        with open(args.write, "w") as f:
            f.write(f"Command: `python benchmarks/memory_plan.py --mfu {args.mfu} --peak-tflops {args.peak_tflops:g} "
                    f"--write {args.write}`\n\n{text}\n")


if __name__ == "__main__":
    main()
