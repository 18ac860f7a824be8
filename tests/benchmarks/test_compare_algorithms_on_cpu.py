"""benchmarks/compare_algorithms.py stays runnable: it races every registered policy loss, each algorithm's
config (base + its recipe's algorithm settings) passes the trainer's validation, and every algorithm gets
the same rollouts per step. The race itself (Ray, minutes per run) is not run here."""

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def race(load_benchmark):
    return load_benchmark("compare_algorithms")


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from verl_diffusion.models.tiny import save_tiny

    root = tmp_path_factory.mktemp("race")
    save_tiny("sd3", root / "model", seed=0, sample_size=16)
    sys.path.insert(0, str(REPO / "data_process"))
    spec = importlib.util.spec_from_file_location("dp_shapes", REPO / "data_process" / "shapes.py")
    dp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dp)
    assert dp.main(["--output", str(root / "data"), "--train-size", "16", "--test-per-tag", "1"]) == 0
    return root


def test_every_registered_policy_loss_is_raced(race):
    from verl_diffusion.algos.losses import LOSSES, load_builtin_losses

    load_builtin_losses()
    modes = {race.algorithm_settings(a)["actor_rollout_ref.actor.policy_loss"]["loss_mode"] for a in race.ALGORITHMS}
    assert set(LOSSES) <= modes
    assert set(race.MULTI_DEFAULT) <= set(race.ALGORITHMS)


def test_each_algorithm_config_validates_with_the_same_budget(race, tiny_setup):
    from verl_diffusion.main_flowgrpo import prepare_config, validate_config

    args = race.parse_args(["--model", str(tiny_setup / "model"), "--config-name", "tiny_cpu", "--data",
                            str(tiny_setup / "data"), "--reward", "shapes", "--steps", "3"])
    base_cfg = race.build_config(args, "awm", "single", 0, str(tiny_setup / "runs" / "b"))
    shared = race.build_config(args, "awm", "single", 0, str(tiny_setup / "runs" / "s"), skip_base_eval=True)
    assert base_cfg.trainer.val_before_train is True and shared.trainer.val_before_train is False
    multi_args = race.parse_args(["--model", str(tiny_setup / "model"), "--config-name", "tiny_cpu", "--data",
                                  str(tiny_setup / "data"), "--reward", "shapes", "--steps", "3", "--eval-every", "3",
                                  "--multi-steps", "2", "--multi-eval-every", "1", "--multi-epochs", "3"])
    m = race.build_config(multi_args, "flow_dppo", "multi", 0, str(tiny_setup / "runs" / "m"))
    s1 = race.build_config(multi_args, "flow_dppo", "single", 0, str(tiny_setup / "runs" / "s1"))
    assert (m.trainer.total_training_steps, m.trainer.test_freq, m.actor_rollout_ref.actor.ppo_epochs) == (2, 1, 3)
    assert (s1.trainer.total_training_steps, s1.trainer.test_freq, s1.actor_rollout_ref.actor.ppo_epochs) == (3, 3, 1)
    budgets = set()
    for algo in race.ALGORITHMS:
        for setting in ("single", "multi") if algo == "flow_dppo" else ("single",):
            cfg = race.build_config(args, algo, setting, 1, str(tiny_setup / "runs" / algo))
            prepare_config(cfg)
            validate_config(cfg)
            budgets.add(race.rollouts_per_step(cfg))
            assert cfg.actor_rollout_ref.actor.ppo_epochs == (1 if setting == "single" else 4)
            assert cfg.trainer.seed == 1 and cfg.data.seed == 1 and cfg.trainer.total_training_steps == 3
            assert dict(cfg.reward.components) == {"shapes": 1.0}
    assert len(budgets) == 1
    kde = race.build_config(args, "path_space_sto", "single", 0, str(tiny_setup / "runs" / "x"))
    assert kde.actor_rollout_ref.actor.policy_loss.preset == "ps_sto"
    assert kde.actor_rollout_ref.rollout.sde.noise_level == pytest.approx(0.671)


def test_summary_table_and_rollouts_to_target(race):
    def row(algo, seed, strict):
        return {"algorithm": algo, "setting": "single", "seed": seed, "rollouts_per_step": 32, "ppo_epochs": 1,
                "steps": [1, 2, 3, 4], "reward": [0.1, 0.2, 0.3, 0.4], "train_strict": [0.0] * 4,
                "step_s": [9.0, 1.0, 1.0, 1.0], "rss_gb": [0.5, 0.6, 0.6, 0.7], "diversity": [0.2, 0.2, 0.1, 0.1],
                "val_steps": [0, 2, 4], "val_strict": strict, "val_reward": [0.3, 0.4, 0.5],
                "log_ratio_max": [0.0, 0.1, 0.3, 0.2], "clip_frac": [0.0, 0.1, 0.2, 0.3 if seed else 0.6]}

    rows = [row("flow_grpo", 0, [0.2, 0.3, 0.5]), row("flow_grpo", 1, [0.2, 0.3, 0.25]), row("awm", 0, [0.2, 0.4, 0.4])]
    text, agg = race.summarise(rows, target_gain=0.15, target=None)
    assert "held-out strict 0.200" in text and "Target accuracy: 0.350" in text
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines() if ln.startswith("| flow_grpo") or ln.startswith("| awm")}
    assert "0.375 ± 0.177" in lines["flow_grpo"]        # strict at step 4 (128 rollouts): mean ± sd of 0.5, 0.25
    assert "128 (1/2)" in lines["flow_grpo"] and "64 (1/1)" in lines["awm"]
    assert "| 1.000 |" in lines["awm"] and "0.700" in lines["awm"]   # s/step without the first step; peak RSS
    assert "0.200 → 0.100" in lines["awm"]             # group diversity, first and last quarter
    assert "| 0.100 → 0.400 |" in lines["awm"]           # train reward, first and last quarter
    # max |log ratio|; clipped share (run means 0.225 and 0.15); approx KL not logged; drops 0 and 0.05
    assert lines["flow_grpo"].endswith("| 0.300 ± 0.000 | 0.19 ± 0.053 | — | 0.025 ± 0.035 |")


def test_rollouts_to_each_target_with_range_and_censored_seeds(race):
    def row(algo, seed, strict):
        return {"algorithm": algo, "setting": "single", "seed": seed, "rollouts_per_step": 32,
                "val_steps": [0, 2, 4], "val_strict": strict}

    rows = [row("awm", 0, [0.2, 0.26, 0.32]), row("awm", 1, [0.2, 0.2, 0.26]), row("awm", 2, [0.2, 0.18, 0.19]),
            row("flow_grpo", 0, [0.2, 0.19, 0.21])]
    text = race.targets_table(rows, [0.05, 0.10])
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines() if ln.startswith("| ")}
    assert "base 20.0%, budget 128 rollouts" in text
    # end gains +12, +6, -1 points: mean +5.7, sd 6.5; two seeds gained
    assert lines["awm"].startswith("| awm | 3 | +5.7 ± 6.5 | 2/3 |")
    # +5: seed 0 at step 2 (64 rollouts), seed 1 at step 4 (128); +10: seed 0 at step 4 only
    assert "| 96 [64–128] (2/3) | 128 [128–128] (1/3) |" in lines["awm"]
    assert lines["flow_grpo"].endswith("| not within 128 (0/1) | not within 128 (0/1) |")


def test_package_configs_compose_as_the_base(race):
    """The default base (shapes_cpu) is a package config, not a recipe: hydra must find it as primary."""
    cfg = race.compose("flowgrpo_trainer", [])   # in verl_diffusion/config only
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "flow_grpo"


def test_shards_share_one_jsonl_and_the_base_evaluation(race, tmp_path):
    """Shards merge their rows into one file (a run's row replaced, others kept); the shared step-0 validation
    comes only from a run that evaluated it itself."""
    path = str(tmp_path / "race.jsonl")
    r = lambda algo, seed, strict, **kw: {"algorithm": algo, "setting": "single", "seed": seed,  # noqa: E731
                                          "val_steps": [0, 4], "val_strict": [strict, 0.6], "val_reward": [0.4, 0.5], **kw}
    race.merge_row(path, r("awm", 0, 0.30, base_shared=True))
    race.merge_row(path, r("flow_grpo", 0, 0.52))
    race.merge_row(path, r("awm", 0, 0.52))                  # a rerun replaces its row
    rows = race.read_rows(path)
    assert [(x["algorithm"], x["val_strict"][0]) for x in rows] == [("flow_grpo", 0.52), ("awm", 0.52)]
    assert race.shared_base([r("a", 0, 0.30, base_shared=True), r("b", 0, 0.52)]) == {"strict": 0.52, "reward": 0.4}
    assert race.shared_base([r("a", 0, 0.30, base_shared=True), {**r("b", 0, 0.5), "error": "x"}]) is None
    argv = ["--seeds", "0", "1", "2", "--algorithms", "awm", "flow_grpo", "flow_dppo", "--multi-algorithms", "flow_dppo"]
    full = race.plan_runs(race.parse_args(argv))
    assert len(full) == 3 * 3 + 3 and full[:3] == [("awm", "single", 0), ("flow_grpo", "single", 0), ("flow_dppo", "single", 0)]
    shards = [race.plan_runs(race.parse_args(argv + ["--shard", f"{k}/2"])) for k in (0, 1)]
    assert sorted(shards[0] + shards[1]) == sorted(full) and not set(shards[0]) & set(shards[1])
    assert ("awm", "single", 0) not in race.plan_runs(race.parse_args(argv), done={("awm", "single", 0)})


def test_report_only_writes_the_title_and_a_command_that_splits_back(race, tmp_path):
    """``--report-only`` rebuilds the report from the JSONL alone; its heading is ``--title`` and its command line is
    shell-quoted, so a title with spaces or quotes copies back into a shell as the same arguments."""
    import shlex

    jsonl, out = tmp_path / "rows.jsonl", tmp_path / "report.md"
    race.merge_row(str(jsonl), {"algorithm": "awm", "setting": "single", "seed": 0, "rollouts_per_step": 32,
                                "ppo_epochs": 1, "steps": [1, 2], "reward": [0.1, 0.2], "train_strict": [0.0, 0.0],
                                "step_s": [2.0, 1.0], "rss_gb": [0.5, 0.5], "diversity": [0.2, 0.2],
                                "val_steps": [0, 2], "val_strict": [0.2, 0.3], "val_reward": [0.4, 0.5],
                                "log_ratio_max": [0.0, 0.0], "clip_frac": [0.0, 0.0]})
    argv = ["--report-only", "--title", "AWM's race, one row", "--algorithms", "awm", "--settings", "single",
            "--seeds", "0", "--jsonl", str(jsonl), "--out", str(out), "--png", ""]
    assert race.main(argv) == 0
    doc = out.read_text()
    assert doc.startswith("# AWM's race, one row\n")
    cmd = next(ln for ln in doc.splitlines() if ln.startswith("Command: `"))[len("Command: `"):-1]
    assert shlex.split(cmd)[2:] == argv


def test_default_run_with_another_algorithm_gets_the_race_settings(race, load_benchmark):
    """shapes_default_run.py --algorithm NAME: the default config plus the generated hydra overrides holds exactly
    the race's algorithm settings for NAME (leaves the recipe lacks deleted, not left over from AWM), and the rest
    (the learning-rate schedule, the budget) is the default's."""
    from omegaconf import OmegaConf

    from verl_diffusion.main_flowgrpo import prepare_config, validate_config

    default_run = load_benchmark("shapes_default_run")
    base = race.compose("shapes_cpu", [])
    for algo in ("diffusion_nft", "path_space_kde", "flow_grpo", "awm"):
        cfg = race.compose("shapes_cpu", default_run.algorithm_overrides(algo))
        for key, want in race.algorithm_settings(algo).items():
            got = race._select(cfg, key)
            got = OmegaConf.to_container(got, resolve=True) if OmegaConf.is_config(got) else got
            assert got == want, (algo, key)
        assert cfg.actor_rollout_ref.actor.optim == base.actor_rollout_ref.actor.optim
        assert cfg.trainer.total_training_steps == base.trainer.total_training_steps
        prepare_config(cfg)
        validate_config(cfg)
    nft = race.compose("shapes_cpu", default_run.algorithm_overrides("diffusion_nft"))
    assert "phi" not in nft.actor_rollout_ref.actor.policy_loss and nft.actor_rollout_ref.actor.policy_loss.beta == 0.1


def test_default_run_report_over_seeds_and_for_one_seed(load_benchmark):
    """The mean gain's ± is the sd over seeds; with one seed it is that run's paired s.e. (no nan)."""
    default_run = load_benchmark("shapes_default_run")

    def run(seed, final, se):
        tags = {"colors": {"before": 0.5, "gain": final - 0.25}, "all tags": {"before": 0.25, "gain": final - 0.25}}
        return {"seed": seed, "wall_s": 10.0, "vals": [(0, 0.25, 0.4), (40, final, 0.5)], "se": se, "by_tag": tags}

    three = default_run.report([run(0, 0.35, 0.02), run(1, 0.37, 0.02), run(2, 0.39, 0.03)])
    # gains +10, +12, +14: mean +12, sd 2 (6.0 sd); rms paired s.e. sqrt((4+4+9)/3) = 2.38
    assert "gain: +12.0 ± 2.0 points (mean ± sd over 3 seeds, 6.0 sd)" in three
    assert "(rms paired s.e.): 2.4 points" in three
    assert "| colors | 50.0% | +12.0 | 2.0 | 3/3 |" in three
    one = default_run.report([run(0, 0.35, 0.02)])
    assert "gain: +10.0 ± 2.0 points (one seed, ± its paired s.e.)" in one
    assert "| all tags | 25.0% | +10.0 | — | 1/1 |" in one and "nan" not in one
