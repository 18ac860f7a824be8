"""Why the shapes base plateaus: cheap checks on a saved shapes model, no training.

    python benchmarks/shapes_base_diagnostics.py [--model verl_diffusion/assets/shapes_sd3] [--prompts 128]

On the same prompts and noise as ``scripts/pretrain_shapes.py``'s evaluation (ODE, Euler on the model's grid),
strict accuracy and reward of each split under:

- the real prompts; the prompts shuffled within the split (scored against the *original* scenes' metadata);
  the empty prompt. If the transformer reads the text, shuffling must cost most of the accuracy;
- CFG at a few scales (the model was trained with 10 % empty prompts);
- more ODE steps (sampler discretisation at the last steps).

And, for the divergence (samples that turn into a full-frame texture): the per-sample std of the final latents
(the training latents have unit std after the VAE's scaling and shift), the fraction of samples with a latent std
above 1.5, and the fraction of images whose estimated background is not the grey one (the detector's sign of an
image mostly covered by something).

``--loss-models DIR [DIR ...]``: the held-out flow-matching loss of each model at five noise levels instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def sample(adapter, prompts, noise, steps, size, guidance=1.0):
    grid = adapter.sampling_grid(steps, size, size)
    cond = adapter.encode_prompt(prompts)
    neg = adapter.encode_prompt([""] * len(prompts)) if guidance != 1.0 else None
    x = noise.clone()
    for k in range(len(grid) - 1):
        v = adapter.velocity(x, grid[k].expand(x.shape[0]), cond, guidance_scale=guidance, negative_cond=neg)
        x = x + (grid[k + 1] - grid[k]) * v
    return x


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / "verl_diffusion" / "assets" / "shapes_sd3"))
    p.add_argument("--prompts", type=int, default=128, help="per split")
    p.add_argument("--seed", type=int, default=1, help="eval_sets seed (pretrain_shapes' final eval uses seed + 1)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--loss-models", nargs="+", default=None,
                   help="instead: the flow-matching loss per t of these model directories (same VAE)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.loss_models:
        return flow_loss_by_t(a.loss_models, threads=a.threads)

    from pretrain_shapes import World, eval_sets
    from verl_diffusion.models.sd3 import SD3Adapter
    from verl_diffusion.shapes import BACKGROUND
    from verl_diffusion.shapes.detect import estimate_background

    size = 32
    world = World("verl_diffusion.shapes", size)
    adapter = SD3Adapter.from_pretrained(a.model)
    sets = eval_sets(world, adapter, a.prompts, a.seed, size)
    perm = np.random.default_rng(0).permutation(a.prompts)
    results = {}

    def run(name, split, prompts, steps=20, guidance=1.0):
        t0 = time.time()
        _, mds, noise = sets[split]
        x = sample(adapter, prompts, noise, steps, size, guidance)
        imgs = adapter.decode(x).permute(0, 2, 3, 1).numpy()
        sc = [world.score(im, m) for im, m in zip(imgs, mds)]
        lat_std = x.detach().flatten(1).std(1)
        bg_off = np.mean([np.linalg.norm(estimate_background(im) - np.asarray(BACKGROUND, np.float32)) > 1.0
                          for im in imgs])
        r = {"strict": float(np.mean([s.strict for s in sc])), "reward": float(np.mean([s.reward for s in sc])),
             "latent_std_median": float(lat_std.median()), "latent_std_max": float(lat_std.max()),
             "frac_latent_std_gt_1.5": float((lat_std > 1.5).float().mean()),
             "frac_background_not_grey": float(bg_off)}
        results[f"{split}/{name}"] = r
        print(f"{split:8s} {name:22s} strict {r['strict']:.3f} reward {r['reward']:.3f}  latent std median "
              f"{r['latent_std_median']:.2f} max {r['latent_std_max']:.2f} >1.5: {r['frac_latent_std_gt_1.5']:.3f}"
              f"  bg off-grey {bg_off:.3f}  ({time.time() - t0:.0f}s)", flush=True)

    for split in ("train", "heldout"):
        prompts = sets[split][0]
        run("real", split, prompts)
        run("shuffled", split, [prompts[i] for i in perm])
        run("empty", split, [""] * len(prompts))
        for g in (2.0, 4.0):
            run(f"cfg{g:g}", split, prompts, guidance=g)
        run("ode50", split, prompts, steps=50)
    print(json.dumps(results, indent=1))



@torch.no_grad()
def flow_loss_by_t(model_dirs, n: int = 512, seed: int = 7, threads: int = 1):
    """Flow-matching loss (docs/algorithms.md §1: x_t = (1 − t)·x0 + t·ε, target ε − x0) of each model on the same ``n`` fresh
    scenes of pretraining prompts, the same ε, at t = 0.1, 0.3, 0.5, 0.7, 0.9. The models must share the VAE (the
    latents are encoded by the first model's VAE and scaled by each model's own factors)."""
    from pretrain_shapes import World
    from verl_diffusion.models.sd3 import SD3Adapter

    torch.set_num_threads(threads)
    world = World("verl_diffusion.shapes", 32)
    rng = np.random.default_rng(seed)
    samples = [world.pretrain_sample(rng) for _ in range(n)]
    x = world.images([m for _, m in samples], rng)
    gen = torch.Generator().manual_seed(seed)
    adapters = [SD3Adapter.from_pretrained(d) for d in model_dirs]
    raw = adapters[0].vae.encode(x).latent_dist.mode()
    eps = torch.randn(raw.shape, generator=gen)
    out = {}
    for d, ad in zip(model_dirs, adapters):
        cfg = ad.vae.config
        x0 = (raw - (cfg.shift_factor or 0.0)) * cfg.scaling_factor
        cond = ad.encode_prompt([p for p, _ in samples])
        row = {}
        for t in (0.1, 0.3, 0.5, 0.7, 0.9):
            xt = (1 - t) * x0 + t * eps
            v = torch.cat([ad.velocity(xt[i:i + 128], torch.full((len(xt[i:i + 128]),), t),
                                       type(cond)(cond.prompt_embeds[i:i + 128], cond.pooled_prompt_embeds[i:i + 128]))
                           for i in range(0, n, 128)])
            row[t] = float(((v - (eps - x0)) ** 2).mean())
        out[d] = row
        print(d, " ".join(f"t={t}: {l:.4f}" for t, l in row.items()), flush=True)
    return out


if __name__ == "__main__":
    main()
