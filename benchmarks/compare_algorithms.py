#!/usr/bin/env python
"""The algorithm race on the shapes world: every registered policy loss with its recipe's
algorithm settings, the same model, prompts, rollout budget and seeds; held-out strict accuracy and reward
at fixed budgets, rollouts to a target accuracy, s/step, peak memory and within-group diversity.

    python benchmarks/compare_algorithms.py                                   # all algorithms, 3 seeds, both settings
    python benchmarks/compare_algorithms.py --algorithms flow_grpo awm --seeds 0 --steps 20
    python benchmarks/compare_algorithms.py --model /tmp/tiny_sd3 --config-name tiny_cpu --data /tmp/shapes \\
        --algorithms flow_grpo --seeds 0 --steps 2 --eval-every 1 --settings single   # plumbing check

Each run is the real trainer (``run_flowgrpo``: Ray, verl's workers) in this process, all runs in one Ray
session. The base is ``--config-name`` (default ``shapes_cpu``, the default run: model, prompts, batch, group
size, steps, resolution, learning rate, guidance); each algorithm replaces only its algorithm settings by
those of its recipe (``ALGORITHMS``; the keys in ``ALGO_KEYS``: the loss and its knobs, the old-policy
schedule, the trained-step fraction, the sampler, its noise level and window, the advantage settings).
Learning rate, guidance, batch and group size stay the base's, so every algorithm gets the same rollouts
per step and the same steps. The window is clipped to the base's number of steps; TempFlow's branched
rollout gets ``n / num_children`` evenly spaced branch steps so it too draws ``n`` images per prompt.

Settings: ``single`` (ppo_epochs 1: one update per rollout batch, on-policy) and ``multi``
(``--multi-epochs`` updates per rollout batch, where ratio clipping is tested; by default only the ratio
losses run it: ``--multi-algorithms``).

Metrics come from the trainer: validation (``trainer.test_freq``, ODE, fixed seeds, the base's held-out
prompts) gives the held-out strict accuracy (the first of ``VAL_STRICT_KEYS`` present) and reward
(``val/reward_mean``); training steps give ``timing_s/step``, ``perf/worker_max_rss_gb`` and
``rollout/group_image_std`` (within-group pixel std: 0 = mode collapse) and ``actor/log_ratio_abs_max``; the
"strict drop from peak" column (best held-out accuracy minus the final one) shows training that collapses. Raw rows go to ``--jsonl`` (runs
already there are skipped, so an interrupted race resumes); the table to ``--out`` and the curves to ``--png``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"

# name -> (recipe whose algorithm settings it uses, extra overrides on top of them)
ALGORITHMS: dict[str, tuple[str, list[str]]] = {
    "flow_grpo": ("sd35_ocr_flowgrpo", []),
    "flow_cps": ("sd35_ocr_flow_cps", []),
    "grpo_guard": ("sd35_ocr_grpo_guard", []),
    "flow_dppo": ("sd35_ocr_flow_dppo", []),
    "flow_dppo_first_order": ("sd35_ocr_flow_dppo", ["actor_rollout_ref.actor.policy_loss.mask=first_order"]),
    "flow_dppo_predictive": ("sd35_ocr_flow_dppo", ["actor_rollout_ref.actor.policy_loss.mask=predictive"]),
    "dance_grpo": ("sd35_pickscore_dance_grpo", []),
    "tempflow_grpo": ("sd35_pickscore_tempflow_grpo", []),
    "diffusion_nft": ("sd35_ocr_diffusion_nft", []),
    "awm": ("sd35_pickscore_awm", []),
    "path_space_kde": ("sd35_pickscore_path_space", []),
    # The other estimators take their preset's whole row (docs/algorithms.md §7.7): clear the recipe's explicit kde-row knobs.
    "path_space_det": ("sd35_pickscore_path_space", [
        "actor_rollout_ref.actor.policy_loss.preset=ps_det", "actor_rollout_ref.actor.policy_loss.estimator=null",
        "actor_rollout_ref.actor.policy_loss.w1_family=null", "actor_rollout_ref.actor.policy_loss.w2_family=null",
        "actor_rollout_ref.actor.policy_loss.xt_source=null"]),
    # P-S ran the stochastic estimator at η = 0.225 (a = √(2η) = 0.671, docs/algorithms.md §9), the others at η = 0.005.
    "path_space_sto": ("sd35_pickscore_path_space", [
        "actor_rollout_ref.rollout.sde.noise_level=0.671", "actor_rollout_ref.actor.policy_loss.preset=ps_sto", "actor_rollout_ref.actor.policy_loss.estimator=null",
        "actor_rollout_ref.actor.policy_loss.w1_family=null", "actor_rollout_ref.actor.policy_loss.w2_family=null",
        "actor_rollout_ref.actor.policy_loss.xt_source=null"]),
}
MULTI_DEFAULT = ["flow_grpo", "grpo_guard", "flow_dppo", "flow_dppo_first_order", "flow_dppo_predictive"]

# The algorithm settings a recipe contributes (everything else is the base's). Not the evaluation EMA
# (actor.ema): it only changes which weights validation samples, and a slow EMA would delay every curve.
ALGO_KEYS = (
    "actor_rollout_ref.actor.policy_loss",
    "actor_rollout_ref.actor.old_policy",
    "actor_rollout_ref.actor.train_step_fraction",
    "actor_rollout_ref.rollout.sde",
    "actor_rollout_ref.rollout.branched",
    "actor_rollout_ref.rollout.same_noise_per_group",
    "algorithm.adv_estimator",
    "algorithm.flow_grpo",
)
VAL_STRICT_KEYS = ("val/shapes/strict/by_composition", "val/shapes/strict", "val/strict", "val/shapes/strict_accuracy", "val/strict_accuracy")
VAL_REWARD_KEYS = ("val/shapes/mean", "val/reward_mean")
CLIP_KEYS = ("actor/clipfrac", "actor/dppo_mask_frac", "actor/awm_clipfrac")


# ---------------------------------------------------------------------------------------------------
# configs
# ---------------------------------------------------------------------------------------------------
def compose(name: str, overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from verl_diffusion.main_flowgrpo import add_search_path

    argv = ["main_flowgrpo"]
    add_search_path(argv)
    search = [a for a in argv if a.startswith("hydra.searchpath")]
    # hydra finds a primary config only in the config dir: the package's (shapes_cpu, tiny_cpu) or recipes/
    import verl_diffusion.config

    package = Path(verl_diffusion.config.__file__).resolve().parent
    config_dir = package if (package / f"{name}.yaml").is_file() else RECIPES
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
        return hydra_compose(config_name=name, overrides=[*search, *overrides])


def _select(cfg, key: str):
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, key, default=None, throw_on_missing=False)


@functools.lru_cache(maxsize=None)
def _algorithm_settings(algo: str) -> str:
    from omegaconf import OmegaConf

    recipe, extra = ALGORITHMS[algo]
    rc = compose(recipe, extra)
    out = {}
    for key in ALGO_KEYS:
        v = _select(rc, key)
        if v is not None:
            out[key] = OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
    return json.dumps(out)


def algorithm_settings(algo: str) -> dict:
    """{key: value} of ALGO_KEYS from the algorithm's recipe with its extra overrides (a fresh copy)."""
    return json.loads(_algorithm_settings(algo))


@functools.lru_cache(maxsize=None)
def _composed(name: str, overrides: tuple[str, ...]) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose(name, list(overrides)), resolve=False)


def build_config(args, algo: str, setting: str, seed: int, run_root: str, skip_base_eval: bool = False):
    """The base config with the algorithm's recipe settings, this seed and setting, sized to the base's budget.
    ``skip_base_eval``: no validation before training (the step-0 evaluation is the same for every run: the base
    model, the ODE sampler, fixed seeds and prompts; ``run_one`` takes it from an earlier run)."""
    from omegaconf import OmegaConf, open_dict

    base = ["trainer.save_freq=-1", "trainer.val_before_train=true", "trainer.logger=[]"]
    if args.model:
        base.append(f"actor_rollout_ref.model.path={args.model}")
    if args.data:
        base += [f"data.train_files=[{os.path.join(args.data, 'train.parquet')}]",
                 f"data.val_files=[{os.path.join(args.data, 'test.parquet')}]"]
    steps = (args.multi_steps or args.steps) if setting == "multi" else args.steps
    eval_every = (args.multi_eval_every or args.eval_every) if setting == "multi" else args.eval_every
    if steps:
        base.append(f"trainer.total_training_steps={steps}")
    if eval_every:
        base.append(f"trainer.test_freq={eval_every}")
    if skip_base_eval:
        base[1] = "trainer.val_before_train=false"
    cfg = OmegaConf.create(_composed(args.config_name, tuple([*base, *args.override])))
    with open_dict(cfg):
        cfg.trainer.seed, cfg.data.seed = int(seed), int(seed)
        cfg.trainer.run_dir, cfg.trainer.default_local_dir = f"{run_root}/run", f"{run_root}/ckpt"
        cfg.trainer.experiment_name = f"race_{algo}_{setting}_s{seed}"
    with open_dict(cfg):
        for key, value in algorithm_settings(algo).items():
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
        if args.reward:
            cfg.reward.components = {args.reward: 1.0}
            cfg.reward.options = {}
        arr = cfg.actor_rollout_ref
        num_steps = int(arr.rollout.num_steps)
        w = arr.rollout.sde.window
        if str(w.get("mode", "none")) != "none":  # recipes size windows for their own step count
            hi = num_steps if w.get("hi") is None else min(int(w.hi), num_steps)
            lo = min(int(w.get("lo", 0) or 0), hi - 1)
            w.hi = None if w.get("hi") is None else hi
            w.lo = lo
            w.size = max(1, min(int(w.size), hi - lo))
        br = arr.rollout.get("branched", None)
        if br is not None and bool(br.get("enabled", False)):
            k = max(1, int(arr.rollout.n) // int(br.num_children))
            br.branch_steps = sorted({int(round(x)) for x in np.linspace(0, num_steps - 2, k)})
        arr.actor.ppo_epochs = 1 if setting == "single" else int(args.multi_epochs)
        # the policy-loss configs read the sampler's noise level from the rollout (they are one recipe)
    return cfg


def rollouts_per_step(cfg) -> int:
    arr = cfg.actor_rollout_ref
    br = arr.rollout.get("branched", None)
    if br is not None and bool(br.get("enabled", False)):
        rows = len(br.branch_steps) * int(br.num_children)
    else:
        rows = int(arr.rollout.n)
    return int(cfg.data.train_batch_size) * rows


# ---------------------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------------------
def first_key(d: dict, keys) -> float:
    for k in keys:
        if k in d and d[k] is not None:
            return float(d[k])
    for k in d:  # a validation that logs strict under another name
        if k.startswith("val/") and k.endswith("strict") and keys is VAL_STRICT_KEYS:
            return float(d[k])
    return float("nan")


def shared_base(rows: list[dict]) -> dict | None:
    """The step-0 validation of a run that evaluated it itself (every such run gives the same numbers)."""
    for r in rows:
        if "error" not in r and not r.get("base_shared") and r.get("val_steps", [None])[0] == 0:
            return {"strict": r["val_strict"][0], "reward": r["val_reward"][0]}
    return None


def run_one(args, algo: str, setting: str, seed: int, base: dict | None = None) -> dict:
    """One training run; with ``base`` (a step-0 validation from an earlier run) it skips its own."""
    from verl_diffusion.main_flowgrpo import run_flowgrpo

    row = {"algorithm": algo, "setting": setting, "seed": seed}
    t0 = time.time()
    try:
        cfg = build_config(args, algo, setting, seed, tempfile.mkdtemp(prefix=f"race_{algo}_"),
                           skip_base_eval=base is not None)
        rps = rollouts_per_step(cfg)
        summary = run_flowgrpo(cfg, finalize=False)
        hist = summary["history"]
        val_history = list(summary["val_history"])
        if base is not None and not (val_history and int(val_history[0]["step"]) == 0):
            val_history.insert(0, {"step": 0, VAL_STRICT_KEYS[0]: base["strict"], VAL_REWARD_KEYS[0]: base["reward"]})
            row["base_shared"] = True
        row.update(
            rollouts_per_step=rps,
            loss_mode=str(cfg.actor_rollout_ref.actor.policy_loss.loss_mode),
            ppo_epochs=int(cfg.actor_rollout_ref.actor.ppo_epochs),
            steps=[int(h["step"]) for h in hist],
            reward=[float(h.get("reward/mean", math.nan)) for h in hist],
            train_strict=[float(h.get("reward/shapes/strict", math.nan)) for h in hist],
            step_s=[float(h.get("timing_s/step", math.nan)) for h in hist],
            rss_gb=[float(h.get("perf/worker_max_rss_gb", math.nan)) for h in hist],
            diversity=[float(h.get("rollout/group_image_std", math.nan)) for h in hist],
            log_ratio_max=[float(h.get("actor/log_ratio_abs_max", math.nan)) for h in hist],
            # the trust region at work: the share of samples a ratio clip or a divergence mask cut off, and the
            # policy's drift from the rollout policy (½·mean(log ρ)²) over the epochs of a batch
            clip_frac=[first_key(h, CLIP_KEYS) for h in hist],
            approx_kl=[float(h.get("actor/approx_kl", math.nan)) for h in hist],
            # the learning signal and the step taken: groups with no strict / no reward variance, the advantage
            # spread, the gradient norm (before clipping) and the relative size of the update |Δθ| / |θ|
            strict_zero_std=[float(h.get("reward/shapes/strict/zero_std_ratio", math.nan)) for h in hist],
            reward_zero_std=[float(h.get("reward/zero_std_ratio", math.nan)) for h in hist],
            adv_std=[float(h.get("advantages/std", math.nan)) for h in hist],
            grad_norm=[float(h.get("grad_norm", math.nan)) for h in hist],
            update_rel_norm=[float(h.get("actor/update_rel_norm", math.nan)) for h in hist],
            val_by_tag=[{k.rsplit("/", 1)[-1]: float(v[k]) for k in v if "/by_composition/" in k} for v in val_history],
            val_steps=[int(v["step"]) for v in val_history],
            val_strict=[first_key(v, VAL_STRICT_KEYS) for v in val_history],
            val_reward=[first_key(v, VAL_REWARD_KEYS) for v in val_history],
            val_keys=sorted({k for v in val_history for k in v if k.startswith("val/")}),
        )
    except Exception as e:  # one failed algorithm must not stop the race; its row says why
        row["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    row["wall_s"] = time.time() - t0
    return row


# ---------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------
def _ms(values, fmt: str = "{:.3f}") -> str:
    v = np.asarray([x for x in values if np.isfinite(x)], dtype=np.float64)
    if v.size == 0:
        return "—"
    return f"{fmt.format(v.mean())} ± {fmt.format(v.std(ddof=1))}" if v.size > 1 else fmt.format(v.mean())


def _first_last(runs: list[dict], key: str) -> str:
    """Mean of ``key`` over the first and the last quarter of each run's steps, averaged over runs."""
    n = lambda xs: max(1, len(xs) // 4)  # noqa: E731
    first = np.nanmean([np.nanmean(r[key][: n(r[key])]) for r in runs])
    last = np.nanmean([np.nanmean(r[key][-n(r[key]):]) for r in runs])
    return f"{first:.3f} → {last:.3f}"


def summarise(rows: list[dict], target_gain: float, target: float | None) -> tuple[str, dict]:
    """Markdown table per setting; returns (text, per-(setting, algorithm) aggregates for the plot)."""
    ok = [r for r in rows if "error" not in r]
    lines = []
    base_vals = [r["val_strict"][0] for r in ok if r["val_steps"] and r["val_steps"][0] == 0]
    base = float(np.nanmean(base_vals)) if base_vals and np.isfinite(base_vals).any() else float("nan")
    tgt = target if target is not None else base + target_gain
    lines.append(f"Base model (step 0, all runs): held-out strict {base:.3f}. Target accuracy: {tgt:.3f}.\n")
    agg = {}
    for setting in sorted({r["setting"] for r in ok}, key=lambda s: s != "single"):
        srows = [r for r in ok if r["setting"] == setting]
        epochs = sorted({r["ppo_epochs"] for r in srows})
        evals = sorted(set.intersection(*[set(r["val_steps"]) for r in srows])) if srows else []
        shown = [s for s in evals if s > 0]
        if len(shown) > 3:
            shown = [shown[len(shown) // 3 - 1], shown[2 * len(shown) // 3 - 1], shown[-1]]
        rps = sorted({r["rollouts_per_step"] for r in srows})
        lines.append(f"### Setting `{setting}` (ppo_epochs {epochs}; {rps} rollouts per step)\n")
        head = ["algorithm", "seeds"] + [f"strict @ {s * rps[0]} rollouts" for s in shown] + [
            f"reward @ {shown[-1] * rps[0] if shown else 0}", "train reward first→last quarter", "rollouts to target (seeds reaching)", "s/step",
            "peak RSS GB", "group diversity first→last", "max abs log-ratio", "clipped/masked share",
            "approx KL", "strict drop from peak"]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + "---|" * len(head))
        for algo in [a for a in ALGORITHMS if any(r["algorithm"] == a for r in srows)]:
            ar = [r for r in srows if r["algorithm"] == algo]
            cells = [algo, str(len(ar))]
            for s in shown:
                cells.append(_ms([r["val_strict"][r["val_steps"].index(s)] for r in ar]))
            if shown:
                cells.append(_ms([r["val_reward"][r["val_steps"].index(shown[-1])] for r in ar]))
            else:
                cells.append("—")
            # the train prompts' reward, first against last quarter of the run. Every loss of a seed draws the
            # same batches, so read it against the other rows (the batch mix moves them all), not on its own
            cells.append(_first_last(ar, "reward"))
            reach = []
            for r in ar:
                hit = [s for s, v in zip(r["val_steps"], r["val_strict"]) if s > 0 and np.isfinite(v) and v >= tgt]
                if hit:
                    reach.append(hit[0] * r["rollouts_per_step"])
            cells.append(f"{np.mean(reach):.0f} ({len(reach)}/{len(ar)})" if reach else f"— (0/{len(ar)})")
            cells.append(_ms([float(np.nanmean(r["step_s"][1:] or r["step_s"])) for r in ar]))
            cells.append(_ms([float(np.nanmax(r["rss_gb"])) if np.isfinite(r["rss_gb"]).any() else math.nan for r in ar]))
            cells.append(_first_last(ar, "diversity"))
            lr = [np.asarray(r.get("log_ratio_max") or [math.nan], dtype=np.float64) for r in ar]
            cells.append(_ms([float(np.nanmax(v)) if np.isfinite(v).any() else math.nan for v in lr]))
            for key in ("clip_frac", "approx_kl"):  # mean over the run's steps (rows before these were kept: —)
                vals = [np.asarray(r.get(key) or [math.nan], dtype=np.float64) for r in ar]
                cells.append(_ms([float(np.nanmean(v)) if np.isfinite(v).any() else math.nan for v in vals],
                                 fmt="{:.2g}"))
            # instability (e.g. ratio clipping failing over several epochs) shows as a final accuracy below the peak
            cells.append(_ms([float(np.nanmax(r["val_strict"]) - r["val_strict"][-1]) for r in ar
                              if np.isfinite(r["val_strict"]).any()]))
            lines.append("| " + " | ".join(cells) + " |")
            agg[(setting, algo)] = ar
        lines.append("")
    failed = [r for r in rows if "error" in r]
    if failed:
        lines.append("Failed runs:\n")
        for r in failed:
            lines.append(f"- {r['algorithm']} / {r['setting']} / seed {r['seed']}: {r['error'].splitlines()[0]}")
        lines.append("")
    return "\n".join(lines), agg


def targets_table(rows: list[dict], gains) -> str:
    """Markdown table per setting: each algorithm's held-out gain at the end of its runs (points, mean ± sd over
    seeds, and how many seeds gained) and, for each target gain (fractions: 0.05 = +5 points over the shared base),
    the rollouts at the first validation that reached it: mean over the seeds that did, their range, and how many
    did (a seed that never reached it within the run's budget is censored, not averaged in)."""
    ok = [r for r in rows if "error" not in r]
    base_vals = [r["val_strict"][0] for r in ok if r["val_steps"] and r["val_steps"][0] == 0]
    base = float(np.nanmean(base_vals)) if base_vals else float("nan")
    lines = []
    for setting in sorted({r["setting"] for r in ok}, key=lambda s: s != "single"):
        srows = [r for r in ok if r["setting"] == setting]
        budget = max(r["val_steps"][-1] * r["rollouts_per_step"] for r in srows)
        head = ["algorithm", "seeds", "held-out gain at the end (points)", "seeds with a gain"] + [
            f"rollouts to +{100 * g:.0f} points (mean [range], seeds reaching)" for g in gains]
        lines += [f"Setting `{setting}`: base {100 * base:.1f}%, budget {budget} rollouts per run.\n",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for algo in [a for a in ALGORITHMS if any(r["algorithm"] == a for r in srows)]:
            ar = [r for r in srows if r["algorithm"] == algo]
            end = [100 * (r["val_strict"][-1] - base) for r in ar]
            sd = f" ± {np.std(end, ddof=1):.1f}" if len(end) > 1 else ""
            cells = [algo, str(len(ar)), f"{np.mean(end):+.1f}{sd}", f"{sum(e > 0 for e in end)}/{len(end)}"]
            for g in gains:
                reach = []
                for r in ar:
                    hit = [st for st, v in zip(r["val_steps"], r["val_strict"])
                           if st > 0 and np.isfinite(v) and v >= base + g]
                    if hit:
                        reach.append(hit[0] * r["rollouts_per_step"])
                cells.append(f"{np.mean(reach):.0f} [{min(reach)}–{max(reach)}] ({len(reach)}/{len(ar)})" if reach
                             else f"not within {budget} (0/{len(ar)})")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(agg: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({s for s, _ in agg}, key=lambda s: s != "single")
    if not settings:
        return
    fig, axes = plt.subplots(2, len(settings), figsize=(6.5 * len(settings), 8), squeeze=False)
    for j, setting in enumerate(settings):
        for algo in [a for a in ALGORITHMS if (setting, a) in agg]:
            ar = agg[(setting, algo)]
            steps = sorted(set.intersection(*[set(r["val_steps"]) for r in ar]))
            x = [s * ar[0]["rollouts_per_step"] for s in steps]
            ys = np.asarray([[r["val_strict"][r["val_steps"].index(s)] for s in steps] for r in ar])
            line, = axes[0, j].plot(x, np.nanmean(ys, 0), marker="o", ms=3, label=algo)
            if len(ar) > 1:
                sd = np.nanstd(ys, 0, ddof=1)
                axes[0, j].fill_between(x, np.nanmean(ys, 0) - sd, np.nanmean(ys, 0) + sd, alpha=0.15,
                                        color=line.get_color())
            n = min(len(r["reward"]) for r in ar)
            rw = np.asarray([r["reward"][:n] for r in ar])
            xr = [s * ar[0]["rollouts_per_step"] for s in ar[0]["steps"][:n]]
            axes[1, j].plot(xr, np.nanmean(rw, 0), label=algo, color=line.get_color())
        axes[0, j].set_title(f"held-out strict accuracy ({setting})")
        axes[1, j].set_title(f"train reward ({setting})")
        for i in range(2):
            axes[i, j].set_xlabel("rollouts (images)")
            axes[i, j].grid(alpha=0.3)
        axes[0, j].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="diffusers model directory (default: the base config's model)")
    ap.add_argument("--config-name", default="shapes_cpu", help="base config (default: %(default)s)")
    ap.add_argument("--data", help="directory with train.parquet / test.parquet (data_process/shapes.py); "
                                   "default: the base config's prompt files")
    ap.add_argument("--reward", help="reward name replacing the base's components (default: the base's)")
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS))
    ap.add_argument("--multi-algorithms", nargs="+", default=MULTI_DEFAULT, choices=list(ALGORITHMS),
                    help="algorithms of the multi-epoch setting (default: the ratio losses)")
    ap.add_argument("--settings", nargs="+", default=["single", "multi"], choices=["single", "multi"])
    ap.add_argument("--multi-epochs", type=int, default=4, help="ppo_epochs of the multi setting (default: %(default)s)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, help="training steps per run (default: the base's)")
    ap.add_argument("--eval-every", type=int, help="validation every N steps (default: the base's test_freq)")
    ap.add_argument("--multi-steps", type=int, help="training steps per run of the multi setting (default: --steps)")
    ap.add_argument("--multi-eval-every", type=int, help="validation interval of the multi setting (default: --eval-every)")
    ap.add_argument("--base-eval", choices=["once", "every"], default="once",
                    help="validate the base model (step 0) in the first run only and share it (it is the same for "
                         "every run: fixed prompts, seeds and ODE sampler), or in every run (default: %(default)s)")
    ap.add_argument("--shard", default="0/1", help="K/N: run every N-th planned run from the K-th, so that N "
                                                   "processes share one --jsonl (default: %(default)s)")
    ap.add_argument("--target", type=float, help="held-out strict accuracy target (default: base + --target-gain)")
    ap.add_argument("--target-gain", type=float, default=0.10)
    ap.add_argument("--target-gains", type=float, nargs="+", default=[0.05, 0.10],
                    help="gains over the base of the rollouts-to-target table (default: %(default)s: +5 and +10 points)")
    ap.add_argument("--override", nargs="*", default=[], help="extra hydra overrides for every run")
    ap.add_argument("--jsonl", default=str(REPO / "benchmarks" / "results" / "compare_algorithms.jsonl"),
                    help="raw rows; runs already in it are skipped (default: %(default)s)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "compare_algorithms.md"))
    ap.add_argument("--png", default=str(REPO / "docs" / "images" / "compare_algorithms.png"))
    ap.add_argument("--report-only", action="store_true", help="rebuild the table and curves from --jsonl")
    ap.add_argument("--preamble", help="a markdown file whose text goes between the title and the command "
                                       "(how the runs were made, what the table says)")
    ap.add_argument("--title", default="Algorithm race on the shapes world",
                    help="the report's heading (default: %(default)s)")
    return ap.parse_args(argv)


def plan_runs(args, done=frozenset()) -> list[tuple[str, str, int]]:
    """(algorithm, setting, seed) still to run, this shard's share (``--shard K/N``: every N-th from the K-th).
    Seed-major, so that an interrupted race has every algorithm at its first seeds."""
    plan = [(a, s, seed) for s in args.settings for seed in args.seeds
            for a in (args.algorithms if s == "single" else [m for m in args.multi_algorithms if m in args.algorithms])
            if (a, s, seed) not in done]
    k, n = (int(x) for x in args.shard.split("/"))
    if not 0 <= k < n:
        raise SystemExit(f"--shard {args.shard}: want K/N with 0 <= K < N")
    return plan[k::n]


def main(argv=None) -> int:
    args = parse_args(argv)
    from verl_diffusion.main_flowgrpo import select_platform

    select_platform()  # VERL_PLATFORM=cpu without an accelerator, before verl is first imported
    rows = read_rows(args.jsonl)
    done = {(r["algorithm"], r["setting"], r["seed"]) for r in rows if "error" not in r}
    plan = plan_runs(args, done)
    if plan and not args.report_only:
        import ray

        env = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "VERL_LOGGING_LEVEL": "WARN"}
        if os.environ.get("VERL_PLATFORM"):
            env["VERL_PLATFORM"] = os.environ["VERL_PLATFORM"]
        ray.init(include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env},
                 **({"num_cpus": max(2, os.cpu_count() or 1)} if env.get("VERL_PLATFORM") == "cpu" else {}))
        os.makedirs(os.path.dirname(os.path.abspath(args.jsonl)), exist_ok=True)
        try:
            for i, (algo, setting, seed) in enumerate(plan):
                base = shared_base(read_rows(args.jsonl)) if args.base_eval == "once" else None
                row = run_one(args, algo, setting, seed, base)
                msg = row.get("error", "").splitlines()[0] if "error" in row else (
                    f"held-out strict {row['val_strict'][0]:.3f} -> {row['val_strict'][-1]:.3f}, "
                    f"reward {row['reward'][0]:.3f} -> {row['reward'][-1]:.3f}")
                print(f"[{i + 1}/{len(plan)}] {algo} {setting} seed {seed} ({row['wall_s']:.0f}s): {msg}", flush=True)
                rows = merge_row(args.jsonl, row)
        finally:
            ray.shutdown()
    rows = read_rows(args.jsonl) or rows
    wanted = [r for r in rows if r["algorithm"] in args.algorithms and r["setting"] in args.settings
              and r["seed"] in args.seeds]
    text, agg = summarise(wanted, args.target_gain, args.target)
    text += "\n### Rollouts to target\n\n" + targets_table(wanted, args.target_gains)
    cmd = "python benchmarks/compare_algorithms.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    preamble = Path(args.preamble).read_text().strip() + "\n\n" if args.preamble else ""
    doc = (f"# {args.title}\n\n{preamble}Command: `{cmd.strip()}`\n\n"
           f"Base config `{args.config_name}`{' with model ' + args.model if args.model else ''}; seeds {args.seeds}; "
           f"curves: `{_shown_path(args.png)}`.\n\n{text}")
    print(doc)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        Path(args.out).write_text(doc)
    if args.png and agg:
        plot(agg, args.png)
    return 0 if all("error" not in r for r in wanted) else 1


def read_rows(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def merge_row(path: str, row: dict) -> list[dict]:
    """Replace the row's (algorithm, setting, seed) in ``path`` under a file lock (shards share the file)."""
    import fcntl

    key = (row["algorithm"], row["setting"], row["seed"])
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = [r for r in read_rows(path) if (r["algorithm"], r["setting"], r["seed"]) != key] + [row]
        with open(path + ".tmp", "w") as f:
            for r in rows:
                f.write(json.dumps(r, default=float) + "\n")
        os.replace(path + ".tmp", path)
    return rows


def _shown_path(path: str | None) -> str:
    if not path:
        return "-"
    p = Path(path).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


if __name__ == "__main__":
    sys.exit(main())
