"""How much of each loss's gradient is signal: the agreement of two independent half-batch gradients.

    python benchmarks/gradient_snr.py [--algorithms flow_grpo awm diffusion_nft path_space_kde] [--batches 3]
    python benchmarks/gradient_snr.py --algorithms flow_grpo --prompts 64                       # 4× the images
    python benchmarks/gradient_snr.py --algorithms flow_grpo \
        --set actor_rollout_ref.rollout.sde.noise_level=1.2 actor_rollout_ref.rollout.sde.window.mode=fixed \
              actor_rollout_ref.rollout.sde.window.size=3                                     # another setting

On the shapes base with the default run's batch (16 train prompts × 8 images, the shapes reward), each algorithm
with its race settings (benchmarks/compare_algorithms.py: the recipe's loss knobs, sampler, noise level and window;
the base's model, batch and resolution) draws a rollout batch, computes advantages (the algorithm's std mode) and, in
one process with the project's rollout and step-loss code, the gradient of its loss over the trained steps of

- half A (the first half of the groups) and half B (the second half) separately: g_A, g_B;
- the same halves with the advantages shuffled within each group (which image earned which reward is lost; each
  group keeps its advantages and their zero sum, so the loss keeps its form): the null.

cos(g_A, g_B) estimates the share of the gradient that is signal: for g = s + noise with noise of variance σ²/n per
half, E[cos] ≈ |s|² / (|s|² + σ²/n). A loss whose cos is at the null's level follows noise; an optimizer with a
normalised step (Adam) then walks at random at the learning rate's pace, whatever the step size. Also printed: the
gradient norm per half, and the norm ratio to the null (how much larger the reward makes the gradient).

Every algorithm sees the same prompts and initial noise per batch (its own sampler noise). The driver's per-sample
step subsampling (AWM's train_step_fraction) is not applied: all trained steps count (it changes the cost, not the
expected gradient).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _race():
    spec = importlib.util.spec_from_file_location("compare_algorithms", REPO / "benchmarks" / "compare_algorithms.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def flat_grad(params):
    import torch

    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def half_gradient(loss, rows: dict, idx, adapter, ref, params, micro: int = 16):
    """The gradient of the mean loss over the trained (sample, step) items of rows[idx]."""
    from verl_diffusion.models.base import Conditioning
    from verl_diffusion.workers.step_loss import run_step_loss, trained_steps

    vel = lambda a: (lambda x, t, r: a.velocity(x, t, Conditioning.from_dict(r)))  # noqa: E731
    sub = {k: v[idx] for k, v in rows.items()}
    steps = trained_steps(sub["train_mask"])
    total = int(sub["train_mask"][:, steps].sum())
    for p in params:
        p.grad = None
    for lo in range(0, len(idx), micro):
        mb = {k: v[lo:lo + micro] for k, v in sub.items()}
        for k in steps:
            out, n, _, _ = run_step_loss(loss, mb, k, velocity_fn=vel(adapter),
                                         ref_velocity_fn=vel(ref) if ref is not None else None)
            if out is not None and n:
                (out.loss * (n / total)).backward()
    return flat_grad(params).detach().clone()


def cosine(a, b) -> float:
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-30))


def measure(algo: str, args, race, prompts_meta: list, batch: int) -> dict:
    import torch
    import yaml
    from omegaconf import OmegaConf

    from verl_diffusion.algos.advantages import group_advantages
    from verl_diffusion.models.base import Conditioning
    from verl_diffusion.models.sd3 import SD3Adapter
    from verl_diffusion.rewards import build_reward
    from verl_diffusion.rollout.diffusers_rollout import DiffusersRollout
    from verl_diffusion.config.schema import ActorRolloutRefSection
    from verl_diffusion.workers.step_loss import prepare_steps, step_loss_for

    ns = race.parse_args(["--model", args.model, "--algorithms", algo, "--seeds", "0"])
    cfg = race.build_config(ns, algo, "single", 0, tempfile.mkdtemp(prefix="snr_"))
    for item in args.set:
        key, _, value = item.partition("=")
        OmegaConf.update(cfg, key, yaml.safe_load(value) if value else None, merge=False, force_add=True)
    settings = ActorRolloutRefSection.from_node(cfg.actor_rollout_ref)
    loss = step_loss_for(settings)
    rcfg = settings.rollout.sampler
    adapter = SD3Adapter.from_pretrained(args.model)
    ref = SD3Adapter.from_pretrained(args.model) if loss.needs_reference() else None
    params = [p for p in adapter.transformer.parameters() if p.requires_grad]
    rollout = DiffusersRollout(adapter, rcfg)
    reward = build_reward({"shapes": 1.0})
    std_mode = str(OmegaConf.select(cfg, "algorithm.flow_grpo.std_mode", default="global") or "global")
    n = settings.rollout.n
    groups = int(args.prompts)
    rng = np.random.default_rng(1000 + batch)
    pick = rng.choice(len(prompts_meta), groups, replace=False)
    texts = [prompts_meta[i][0] for i in pick for _ in range(n)]
    metas = [prompts_meta[i][1] for i in pick for _ in range(n)]
    gids = torch.arange(groups).repeat_interleave(n)
    store = bool({"old_velocity", "old_mean"} & set(loss.spec.batch_keys))
    with torch.no_grad():
        out = rollout.generate(texts, gids, seed=batch, store_velocities=store)
    images = out.pop("images")
    res = reward(images, texts, metas)
    adv = group_advantages(res.scores.float(), gids, std_mode=std_mode)
    rows = dict(out)
    rows["old_log_probs"] = rows["rollout_log_probs"]
    rows["group_ids"] = gids
    half = groups // 2 * n
    half_a, half_b = torch.arange(0, half), torch.arange(half, 2 * half)
    from verl_diffusion.workers.step_loss import trained_steps

    result = {"algorithm": algo, "batch": batch, "prompts": groups, "set": list(args.set),
              "trained_steps": [int(k) for k in trained_steps(rows["train_mask"])],
              "reward_mean": float(res.scores.float().mean()),
              "zero_std_groups": float(np.mean([float(res.scores[gids == g].float().std()) < 1e-8
                                                for g in range(groups)]))}
    # the null: advantages shuffled within each group (every group keeps its advantages and their zero sum, but
    # which image got which reward is lost)
    prng = np.random.default_rng(7 + batch)
    perm = torch.cat([g * n + torch.from_numpy(prng.permutation(n)) for g in range(groups)])
    for label, a in (("real", adv), ("null", adv[perm])):
        r = dict(rows)
        r["advantages"] = a[:, None].expand_as(r["train_mask"]).float().contiguous()
        with torch.no_grad():
            r.update(prepare_steps(loss, r, generator=torch.Generator().manual_seed(batch),
                                   velocity_fn=lambda x, t, rr: adapter.velocity(x, t, Conditioning.from_dict(rr))))
        ga = half_gradient(loss, r, half_a, adapter, ref, params)
        gb = half_gradient(loss, r, half_b, adapter, ref, params)
        result[f"{label}_cos"] = cosine(ga, gb)
        result[f"{label}_norm"] = float(0.5 * (ga.norm() + gb.norm()))
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(REPO / "verl_diffusion" / "assets" / "shapes_sd3"))
    p.add_argument("--algorithms", nargs="+", default=["flow_grpo", "awm", "diffusion_nft", "path_space_kde"])
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompts", type=int, default=16, help="groups per batch, even (default: %(default)s, the default run's)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config values replacing the algorithm's race settings (e.g. the SDE noise level or window)")
    p.add_argument("--jsonl", default=None, help="append raw rows here")
    a = p.parse_args(argv)
    if a.prompts < 2 or a.prompts % 2:
        p.error(f"--prompts {a.prompts}: want an even number of groups >= 2 (two halves)")
    import torch

    torch.set_num_threads(a.threads)
    os.environ.setdefault("VERL_PLATFORM", "cpu")
    from verl_diffusion.shapes.world import sample_prompt

    race = _race()
    rng = np.random.default_rng(0)
    prompts_meta = [sample_prompt(rng, "train") for _ in range(512)]
    rows = []
    for algo in a.algorithms:
        for b in range(a.batches):
            row = measure(algo, a, race, prompts_meta, b)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if a.jsonl:
                with open(a.jsonl, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(f"\n{a.prompts} prompts × 8 images per batch; settings: {' '.join(a.set) or 'the race settings'}")
    print("\n| algorithm | batches | cos(g_A, g_B) real | cos null (advantages permuted) | |g| real / null |")
    print("|---|---|---|---|---|")
    for algo in a.algorithms:
        rs = [r for r in rows if r["algorithm"] == algo]
        c = np.array([r["real_cos"] for r in rs])
        c0 = np.array([r["null_cos"] for r in rs])
        ratio = np.mean([r["real_norm"] / max(r["null_norm"], 1e-30) for r in rs])
        se = lambda x: x.std(ddof=1) / math.sqrt(len(x)) if len(x) > 1 else float("nan")  # noqa: E731
        print(f"| {algo} | {len(rs)} | {c.mean():.3f} ± {se(c):.3f} | {c0.mean():.3f} ± {se(c0):.3f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
