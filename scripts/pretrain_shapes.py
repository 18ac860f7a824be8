"""Pretrain the tiny SD3 model of the shapes world: a VAE, then the transformer, on rendered scenes.

    python scripts/pretrain_shapes.py --out verl_diffusion/assets/shapes_sd3

Seeded from ``--seed`` (torch and numpy; every random draw comes from a seeded generator, so the same command on the
same torch build and thread count should give the same weights: two runs printed the same VAE losses, a full
re-run was not compared). Two stages, both on scenes rendered by ``verl_diffusion.shapes``:

1. the VAE (``AutoencoderKL``, 2 blocks: 32 px → 16 × 16 × 4 latents) on renders of pretraining prompts, L1 + a
   small KL; its scaling and shift factors are then set to the latents' std and mean so the transformer sees
   unit-variance latents (the decode path of the adapter undoes them, as with SD3's constants);
2. the transformer (``SD3Transformer2DModel``) by flow matching with docs/algorithms.md §1's conventions: x_t = (1 − t)·x0 + t·ε,
   the network predicts the velocity ε − x0, t ~ logit-normal (SD3's training density); the prompts of
   ``pretrain_sample`` (rare compositions downweighted), 10 % of them replaced by the empty prompt so CFG is
   available; AdamW with warmup and cosine decay; an EMA of the weights is what is saved.

The text encoders (CLIP-L/G and T5 of the tiny builder, word-level tokenizers over the prompt vocabulary) stay
frozen at their seeded random init: the transformer's own context embedder learns to read them, and the RL
trainer keeps them frozen as well. Every ``--eval-every`` steps the EMA model samples a fixed set of train and
held-out prompts with the ODE sampler (the adapter's own grid and Euler steps, as the trainer validates) and the
``shapes`` score prints their strict accuracy.

Writes a diffusers directory (``save_pretrained``, loaded by the trainer's ``from_pretrained`` path) and
``MANIFEST.json`` (SHA-256 of every file, the command, the measured accuracies).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=str(REPO / "verl_diffusion" / "assets" / "shapes_sd3"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=32, help="image side in pixels")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: robust on a shared machine)")
    p.add_argument("--world", default="verl_diffusion.shapes", help="module with the world and score API")
    # VAE
    p.add_argument("--vae-steps", type=int, default=2500)
    p.add_argument("--vae-batch", type=int, default=32)
    p.add_argument("--vae-lr", type=float, default=2e-3)
    p.add_argument("--vae-channels", type=int, default=16)
    p.add_argument("--latent-channels", type=int, default=4)
    p.add_argument("--vae-kl", type=float, default=1e-6)
    p.add_argument("--vae-check", type=int, default=256, help="renders scored before/after the VAE round trip")
    # transformer
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--ema", type=float, default=0.998)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8, help="width = heads × head-dim (128)")
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--text-width", type=int, default=32)
    p.add_argument("--text-seq-len", type=int, default=12)
    p.add_argument("--caption-dropout", type=float, default=0.1)
    p.add_argument("--pool", type=int, default=32768, help="rendered scenes encoded once and sampled per step")
    p.add_argument("--shift", type=float, default=1.0, help="the saved scheduler's shift (the sampling grid)")
    # evaluation
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--eval-prompts", type=int, default=64, help="per split")
    p.add_argument("--eval-steps", type=int, default=20, help="ODE steps")
    p.add_argument("--final-eval-prompts", type=int, default=256, help="per split, for the manifest")
    p.add_argument("--skip-vae", default=None, help="reuse a trained VAE from this pipeline directory")
    p.add_argument("--eval-only", default=None, help="only evaluate this saved model directory (per tag, grid PNG)")
    # continued pretraining and the data mix
    p.add_argument("--init-from", default=None,
                   help="continue from this saved pipeline directory (all components, the VAE's scaling kept)")
    p.add_argument("--tag-weights", default=None,
                   help="pretraining tag mix, e.g. single_object=1,colors=1,... (default: the world's)")
    p.add_argument("--count-weights", default=None, help="counting's counts, e.g. 2=1,3=1,4=1 (default: the world's)")
    return p.parse_args(argv)


def parse_weights(text: str | None, key=str) -> dict | None:
    """"a=1,b=2" -> {a: 1.0, b: 2.0}; None stays None."""
    if not text:
        return None
    out = {}
    for item in text.split(","):
        k, _, v = item.partition("=")
        out[key(k.strip())] = float(v)
    return out


# ------------------------------------------------------------------------------------------------ world

class World:
    """The shapes world API used here: prompts, scenes, renders and the strict score."""

    def __init__(self, module: str, size: int, tag_weights: dict | None = None, count_weights: dict | None = None):
        self.size = size
        mod = importlib.import_module(module)
        get = lambda name: getattr(mod, name, None) or getattr(importlib.import_module(module + ".world"), name)
        base_sample = get("pretrain_sample")
        mix = {k: v for k, v in (("tag_weights", tag_weights), ("count_weights", count_weights)) if v}
        self.pretrain_sample = (lambda rng: base_sample(rng, **mix)) if mix else base_sample
        self.sample_prompt = get("sample_prompt")
        self.scene_for = get("scene_for")
        self.render = get("render")
        self.score = getattr(mod, "score", None) or importlib.import_module(module + ".detect").score

    def images(self, metadatas, rng) -> torch.Tensor:
        """Render one random scene per metadata → float [B, 3, H, W] in [−1, 1]."""
        arr = np.stack([self.render(self.scene_for(m, rng, self.size), self.size) for m in metadatas])
        return torch.from_numpy(arr).permute(0, 3, 1, 2).float() / 127.5 - 1.0

    def vocabulary(self, rng, n: int = 6000) -> list[str]:
        words = set()
        for i in range(n):
            prompt, _ = (self.pretrain_sample(rng) if i % 3 == 0 else
                         self.sample_prompt(rng, "train" if i % 3 == 1 else "heldout"))
            words.update(prompt.lower().split())
        return sorted(words)


# ------------------------------------------------------------------------------------------------ stages

def cosine_lr(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def train_vae(vae, world, args, rng):
    vae.train()
    opt = torch.optim.AdamW(vae.parameters(), lr=args.vae_lr, weight_decay=0.0)
    t0 = time.time()
    for step in range(args.vae_steps):
        for g in opt.param_groups:
            g["lr"] = args.vae_lr * cosine_lr(step, args.vae_steps, 100)
        mds = [world.pretrain_sample(rng)[1] for _ in range(args.vae_batch)]
        x = world.images(mds, rng)
        post = vae.encode(x).latent_dist
        rec = vae.decode(post.sample()).sample
        l1 = (rec - x).abs().mean()
        kl = post.kl().mean() / x[0].numel()
        loss = l1 + args.vae_kl * kl * x[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.vae_steps - 1:
            print(f"vae step {step:5d}  l1 {l1.item():.4f}  kl/dim {kl.item():.3f}  {time.time() - t0:6.0f}s", flush=True)
    vae.eval()


@torch.no_grad()
def vae_check(vae, world, rng, n: int = 256):
    """Strict accuracy of the score on renders and on their VAE reconstructions (ground truth)."""
    mds = [world.sample_prompt(rng, "heldout" if i % 2 else "train")[1] for i in range(n)]
    x = world.images(mds, rng)
    rec = vae.decode(vae.encode(x).latent_dist.mode()).sample
    to_u8 = lambda t: ((t.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).numpy()
    gt = np.mean([world.score(im, m).strict for im, m in zip(to_u8(x), mds)])
    rc = np.mean([world.score(im, m).strict for im, m in zip(to_u8(rec), mds)])
    return float(gt), float(rc)


@torch.no_grad()
def build_pool(vae, world, args, rng):
    """``--pool`` scenes of pretraining prompts: their prompts and unscaled VAE latent means."""
    prompts, lats = [], []
    for i in range(0, args.pool, 256):
        samples = [world.pretrain_sample(rng) for _ in range(min(256, args.pool - i))]
        x = world.images([m for _, m in samples], rng)
        lats.append(vae.encode(x).latent_dist.mode())
        prompts += [p for p, _ in samples]
    return prompts, torch.cat(lats)


class EMA:
    def __init__(self, module, decay):
        self.decay = decay
        self.shadow = {k: v.detach().clone() for k, v in module.state_dict().items()}

    @torch.no_grad()
    def update(self, module, step):
        d = min(self.decay, (1 + step) / (10 + step))
        for k, v in module.state_dict().items():
            if v.dtype.is_floating_point:
                self.shadow[k].mul_(d).add_(v.detach(), alpha=1 - d)
            else:
                self.shadow[k].copy_(v)


class PromptCache:
    """Frozen text encoders: each prompt's (embeds, pooled) computed once by the pipeline's own encode_prompt."""

    def __init__(self, adapter):
        self.adapter, self.cache = adapter, {}

    def __call__(self, prompts):
        new = sorted({p for p in prompts if p not in self.cache})
        for i in range(0, len(new), 256):
            cond = self.adapter.encode_prompt(new[i:i + 256])
            for j, p in enumerate(new[i:i + 256]):
                self.cache[p] = (cond.prompt_embeds[j], cond.pooled_prompt_embeds[j])
        e = torch.stack([self.cache[p][0] for p in prompts])
        pooled = torch.stack([self.cache[p][1] for p in prompts])
        return e, pooled


@torch.no_grad()
def evaluate(adapter, world, eval_sets, args, *, guidance_scale: float = 1.0, images_out: dict | None = None):
    """Strict accuracy and mean reward per split (and strict accuracy per tag), ODE sampler (Euler on the
    adapter's grid), fixed noise. ``images_out`` receives each split's uint8 images."""
    out = {}
    for split, (prompts, mds, noise) in eval_sets.items():
        grid = adapter.sampling_grid(args.eval_steps, args.size, args.size)
        cond = adapter.encode_prompt(prompts)
        neg = adapter.encode_prompt([""] * len(prompts)) if guidance_scale != 1.0 else None
        x = noise.clone()
        for k in range(len(grid) - 1):
            t = grid[k].expand(x.shape[0])
            v = adapter.velocity(x, t, cond, guidance_scale=guidance_scale, negative_cond=neg)
            x = x + (grid[k + 1] - grid[k]) * v
        imgs = adapter.decode(x).permute(0, 2, 3, 1).numpy()
        scores = [world.score(im, m) for im, m in zip(imgs, mds)]
        tags = sorted({m["tag"] for m in mds})
        out[split] = {"strict": float(np.mean([s.strict for s in scores])),
                      "reward": float(np.mean([s.reward for s in scores])),
                      "strict_per_tag": {t: float(np.mean([s.strict for s, m in zip(scores, mds) if m["tag"] == t]))
                                         for t in tags}}
        if images_out is not None:
            images_out[split] = imgs
    return out


def eval_sets(world, adapter, n, seed, size):
    rng = np.random.default_rng(10_000 + seed)
    gen = torch.Generator().manual_seed(10_000 + seed)
    shape = adapter.latent_shape(size, size)
    sets = {}
    for split in ("train", "heldout"):
        pairs = [world.sample_prompt(rng, split) for _ in range(n)]
        sets[split] = ([p for p, _ in pairs], [m for _, m in pairs], torch.randn((n, *shape), generator=gen))
    return sets


def eval_only(args):
    """``--eval-only DIR``: the saved model's accuracy per split and tag on ``--final-eval-prompts`` prompts per
    split, and a grid PNG of the first 32 held-out samples (DIR/../<name>_heldout.png)."""
    from verl_diffusion.models.sd3 import SD3Adapter
    from verl_diffusion.trainer.validation import save_grid

    world = World(args.world, args.size)
    adapter = SD3Adapter.from_pretrained(args.eval_only)
    sets = eval_sets(world, adapter, args.final_eval_prompts, args.seed + 1, args.size)
    images = {}
    res = evaluate(adapter, world, sets, args, images_out=images)
    print(json.dumps(res, indent=1))
    path = Path(args.eval_only).resolve()
    grid = save_grid(torch.from_numpy(images["heldout"][:32]).permute(0, 3, 1, 2),
                     str(path.parent / f"{path.name}_heldout.png"), cols=8, scale=3)
    print("prompts:", sets["heldout"][0][:32])
    print("grid:", grid)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.eval_only:
        return eval_only(args)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    world = World(args.world, args.size, parse_weights(args.tag_weights), parse_weights(args.count_weights, int))

    from verl_diffusion.models.sd3 import SD3Adapter
    from verl_diffusion.models.tiny import build_tiny_sd3_pipeline

    if args.init_from:
        from diffusers import StableDiffusion3Pipeline

        pipe = StableDiffusion3Pipeline.from_pretrained(args.init_from)
        print(f"continuing from {args.init_from}", flush=True)
    else:
        vocab = world.vocabulary(np.random.default_rng(args.seed))
        print(f"vocabulary: {len(vocab)} words", flush=True)
        pipe = build_tiny_sd3_pipeline(
            seed=args.seed, sample_size=args.size // 2, num_layers=args.layers, attention_head_dim=args.head_dim,
            num_attention_heads=args.heads, text_width=args.text_width, text_seq_len=args.text_seq_len,
            latent_channels=args.latent_channels, vae_channels=args.vae_channels, vae_blocks=2, vocab=vocab,
            shift=args.shift)
    for tok in (pipe.tokenizer, pipe.tokenizer_3):
        longest = max((world.sample_prompt(rng, s)[0] for s in ("train", "heldout") for _ in range(500)),
                      key=lambda p: len(tok(p).input_ids))
        assert len(tok(longest).input_ids) <= args.text_seq_len, (longest, tok(longest).input_ids)
    t_start = time.time()

    # ---- stage 1: VAE
    vae = pipe.vae
    if args.init_from:
        pass
    elif args.skip_vae:
        from diffusers import AutoencoderKL

        vae = pipe.vae = AutoencoderKL.from_pretrained(args.skip_vae, subfolder="vae")
    else:
        train_vae(vae, world, args, rng)
    gt, rc = vae_check(vae, world, np.random.default_rng(args.seed + 1), args.vae_check)
    print(f"VAE: strict on renders {gt:.3f}, on reconstructions {rc:.3f}  ({time.time() - t_start:.0f}s)", flush=True)
    for p in vae.parameters():
        p.requires_grad_(False)

    prompts, lat = build_pool(vae, world, args, rng)
    mean, std = lat.mean().item(), lat.std().item()
    if args.init_from:  # the transformer was trained on latents normalised by the saved factors: keep them
        mean, std = vae.config.shift_factor, 1.0 / vae.config.scaling_factor
    vae.register_to_config(shift_factor=mean, scaling_factor=1.0 / std)
    lat = (lat - mean) / std
    print(f"pool: {len(prompts)} scenes, latent mean {mean:.3f} std {std:.3f}  ({time.time() - t_start:.0f}s)",
          flush=True)

    # ---- stage 2: transformer
    adapter = SD3Adapter(pipe)
    cache = PromptCache(adapter)
    cache(sorted(set(prompts)) + [""])
    tr = pipe.transformer
    tr.train()
    ema = EMA(tr, args.ema)
    opt = torch.optim.AdamW(tr.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.99))
    sets = eval_sets(world, adapter, args.eval_prompts, args.seed, args.size)
    live = {k: v.detach().clone() for k, v in tr.state_dict().items()}
    history = []
    gen = torch.Generator().manual_seed(args.seed + 2)
    t0 = time.time()
    run_loss = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * cosine_lr(step, args.steps, args.warmup)
        idx = torch.randint(0, len(prompts), (args.batch,), generator=gen)
        batch_prompts = [prompts[i] if torch.rand((), generator=gen) >= args.caption_dropout else ""
                         for i in idx.tolist()]
        emb, pooled = cache(batch_prompts)
        x0 = lat[idx]
        eps = torch.randn(x0.shape, generator=gen)
        t = torch.sigmoid(torch.randn(args.batch, generator=gen))
        tb = t.view(-1, 1, 1, 1)
        xt = (1 - tb) * x0 + tb * eps
        pred = tr(hidden_states=xt, encoder_hidden_states=emb, pooled_projections=pooled, timestep=t * 1000,
                  return_dict=False)[0]
        loss = F.mse_loss(pred, eps - x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.parameters(), 1.0)
        opt.step()
        ema.update(tr, step)
        run_loss = loss.item() if run_loss is None else 0.98 * run_loss + 0.02 * loss.item()
        if step % 100 == 0:
            print(f"step {step:5d}  loss {run_loss:.4f}  lr {opt.param_groups[0]['lr']:.2e}  "
                  f"{(time.time() - t0) / (step + 1):.3f}s/step", flush=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            live = {k: v.detach().clone() for k, v in tr.state_dict().items()}
            tr.load_state_dict(ema.shadow)
            tr.eval()
            res = evaluate(adapter, world, sets, args)
            history.append({"step": step + 1, **res})
            print(f"eval step {step + 1}: train strict {res['train']['strict']:.3f} reward "
                  f"{res['train']['reward']:.3f} | heldout strict {res['heldout']['strict']:.3f} reward "
                  f"{res['heldout']['reward']:.3f}  ({time.time() - t_start:.0f}s)", flush=True)
            tr.load_state_dict(live)
            tr.train()

    tr.load_state_dict(ema.shadow)
    tr.eval()
    train_seconds = time.time() - t_start
    final_sets = eval_sets(world, adapter, args.final_eval_prompts, args.seed + 1, args.size)
    final = evaluate(adapter, world, final_sets, args)
    print(f"final ({args.final_eval_prompts} prompts per split, {args.eval_steps} ODE steps): {final}", flush=True)
    save(pipe, args, argv, {"vae_strict_renders": gt, "vae_strict_reconstructions": rc, "final": final,
                            "history": history, "train_seconds": round(train_seconds)})


def save(pipe, args, argv, results):
    out = Path(args.out)
    pipe.save_pretrained(str(out), safe_serialization=True)
    files = sorted(p for p in out.rglob("*") if p.is_file() and p.name != "MANIFEST.json")
    cmd = "python scripts/pretrain_shapes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    manifest = {
        "command": cmd.strip(),
        **({"vae_source": str(args.skip_vae)} if args.skip_vae else {}),
        **({"init_from": str(args.init_from)} if args.init_from else {}),
        "torch": torch.__version__,
        "results": results,
        "files": {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
        "total_bytes": sum(p.stat().st_size for p in files),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"saved {out} ({manifest['total_bytes'] / 1e6:.2f} MB)", flush=True)


if __name__ == "__main__":
    main()
