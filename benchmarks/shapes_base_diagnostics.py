"""Why the shapes base plateaus (issue 9): cheap checks on a saved shapes model, no training.

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
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)

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


if __name__ == "__main__":
    main()
