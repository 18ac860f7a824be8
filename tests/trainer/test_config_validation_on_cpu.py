"""main_flowgrpo validates the config before any Ray worker starts: one line naming the field."""

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_module

from verl_diffusion.main_flowgrpo import ConfigError, add_search_path, prepare_config, validate_config
from verl_diffusion.trainer.dataset import PromptDataset, collate_prompts, prompt_text


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from verl_diffusion.models.tiny import save_tiny_sd3

    return str(save_tiny_sd3(tmp_path_factory.mktemp("m") / "tiny"))


def _cfg(tmp_path, *overrides):
    with initialize_config_module(config_module="verl_diffusion.config", version_base=None):
        argv = ["x"]
        add_search_path(argv)
        search = [a for a in argv if a.startswith("hydra.searchpath")]
        cfg = compose(config_name="tiny_cpu", overrides=[*search, f"trainer.run_dir={tmp_path}",
                                                        f"trainer.default_local_dir={tmp_path}/ckpt", *overrides])
    return cfg


def _check(cfg):
    prepare_config(cfg)
    validate_config(cfg)


def test_tiny_default_is_valid(tmp_path, tiny_model):
    _check(_cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}"))


def test_the_shapes_run_passes_the_pre_ray_checks(tmp_path):
    """--config-name shapes_cpu: the packaged pretrained shapes model (pkg:// resolved to the installed package)
    and packaged prompts with ground truth, the shapes reward, 32 px, every held-out prompt of all six tags validated
    once; it passes the pre-Ray checks as is."""
    with initialize_config_module(config_module="verl_diffusion.config", version_base=None):
        argv = ["x"]
        add_search_path(argv)
        search = [a for a in argv if a.startswith("hydra.searchpath")]
        cfg = compose(config_name="shapes_cpu", overrides=[*search, f"trainer.run_dir={tmp_path}",
                                                          f"trainer.default_local_dir={tmp_path}/ckpt"])
    _check(cfg)
    assert os.path.isfile(os.path.join(cfg.actor_rollout_ref.model.path, "model_index.json"))
    assert dict(cfg.reward.components) == {"shapes": 1.0} and cfg.actor_rollout_ref.rollout.resolution == 32
    rows = PromptDataset(list(cfg.data.val_files))
    assert cfg.trainer.val_num_images is None and "ground_truth" in rows[0]["reward_model"]
    from verl_diffusion.shapes.world import TAGS

    assert {rows[i]["extra_info"]["tag"] for i in range(len(rows))} == set(TAGS)


def test_missing_model_path(tmp_path):
    with pytest.raises(ConfigError, match=r"^actor_rollout_ref\.model\.path is not set"):
        _check(_cfg(tmp_path, "actor_rollout_ref.model.tiny=null"))


def test_model_path_without_pipeline(tmp_path):
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path=.*model_index\.json"):
        _check(_cfg(tmp_path, f"actor_rollout_ref.model.path={tmp_path}"))


def test_dataset_without_prompt_column(tmp_path, tiny_model):
    f = tmp_path / "p.jsonl"
    f.write_text('{"text": "a cat"}\n')
    with pytest.raises(ConfigError, match=r"data\.train_files: .*no 'prompt' column"):
        _check(_cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}", f"data.train_files=[{f}]"))


def test_unknown_loss_and_estimator(tmp_path, tiny_model):
    m = f"actor_rollout_ref.model.path={tiny_model}"
    with pytest.raises(ConfigError, match=r"loss_mode='nope' is unknown"):
        _check(_cfg(tmp_path, m, "actor_rollout_ref.actor.policy_loss.loss_mode=nope"))
    with pytest.raises(ConfigError, match=r"algorithm\.adv_estimator='nope' is unknown"):
        _check(_cfg(tmp_path, m, "algorithm.adv_estimator=nope"))
    with pytest.raises(ConfigError, match=r"clip_rnage"):
        _check(_cfg(tmp_path, m, "+actor_rollout_ref.actor.policy_loss.clip_rnage=0.1"))


def test_group_of_one_with_flow_grpo(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match=r"rollout\.n=1 with algorithm\.adv_estimator=flow_grpo"):
        _check(_cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}", "actor_rollout_ref.rollout.n=1",
                    "data.train_batch_size=4"))


def test_empty_reward(tmp_path, tiny_model):
    with pytest.raises(ConfigError, match=r"^reward\.components is empty"):
        _check(_cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}", "~reward.components.jpeg_compressibility"))


def test_cli_prints_one_line_starts_no_ray_and_hydra_writes_nothing(tmp_path):
    """One command-line run stopped by the pre-Ray checks, started in an empty working directory: exit 2, one line
    naming the field, no Ray. Hydra's own outputs/<date>/<time>/ (.hydra copy, main_flowgrpo.log) would sit beside
    ./outputs/<experiment> in every working directory; the base config turns it off. A run stopped by the pre-Ray
    checks still starts the hydra job, so it shows what hydra writes (issue 12; one subprocess for both claims, each
    costs a verl import)."""
    env = dict(os.environ)
    env.pop("VERL_DIFFUSION_RUN_ROOT", None)
    res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "algorithm.adv_estimator=nope"],
                         cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "config error: algorithm.adv_estimator='nope' is unknown" in res.stderr
    assert "Started a local Ray instance" not in res.stdout + res.stderr
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert not [p for p in written if ".hydra" in p or p.endswith(".log") or p.startswith("outputs/20")], written


def test_prompt_dataset_reads_txt_jsonl_and_chat(tmp_path):
    (tmp_path / "a.txt").write_text("red apple\n\nblue car\n")
    (tmp_path / "b.jsonl").write_text('{"prompt": [{"role": "user", "content": "a dog"}], "data_source": "x"}\n')
    ds = PromptDataset([str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")])
    assert [ds[i]["prompt"] for i in range(len(ds))] == ["red apple", "blue car", "a dog"]
    batch = collate_prompts([ds[0], ds[2]])
    assert list(batch["prompt"]) == ["red apple", "a dog"] and batch["data_source"][1] == "x"
    assert prompt_text("plain") == "plain"


@pytest.mark.parametrize("override, field", [
    ("actor_rollout_ref.rollout.sde.type=euler", "sde.type"),
    ("actor_rollout_ref.rollout.sde.window.size=9", "window"),
    ("actor_rollout_ref.rollout.sde.window.mode=sliding", "window"),
    ("actor_rollout_ref.actor.train_step_fraction=1.5", "train_step_fraction"),
    ("actor_rollout_ref.actor.old_policy.schedule=ema", "old_policy.schedule"),
])
def test_sampler_window_and_step_fraction_refused_before_ray(tmp_path, tiny_model, override, field):
    with pytest.raises(ConfigError) as e:
        _check(_cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}", override))
    msg = str(e.value)
    assert "\n" not in msg and field.split(".")[-1] in msg, msg


_BRANCHED = ["actor_rollout_ref.actor.policy_loss.loss_mode=tempflow_grpo", "actor_rollout_ref.rollout.branched.enabled=true",
             "actor_rollout_ref.rollout.num_steps=4", "actor_rollout_ref.rollout.sde.window.size=2",
             "actor_rollout_ref.rollout.sde.window.hi=3", "actor_rollout_ref.rollout.branched.branch_steps=[0,1]",
             "data.train_batch_size=2", "actor_rollout_ref.rollout.n=1"]


def test_branched_config_defaults_and_a_valid_tempflow_setup(tmp_path, tiny_model):
    cfg = _cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}")
    br = cfg.actor_rollout_ref.rollout.branched
    assert (br.enabled, br.num_children, br.branch_steps) == (False, 2, None)
    cfg = _cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}", *_BRANCHED)
    _check(cfg)   # rollout.n=1 is not a group of one here: the groups are (prompt, k) × num_children
    from verl_diffusion.config.schema import RolloutSection

    def branched(c):
        return RolloutSection.from_node(c.actor_rollout_ref.rollout).branched

    assert dict(branched(cfg)) == {"num_children": 2, "branch_steps": [0, 1]}
    assert branched(_cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}")) is None
    none = _cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}", *_BRANCHED,
                "actor_rollout_ref.rollout.branched.branch_steps=null")
    assert branched(none).branch_steps == [0, 1, 2]


@pytest.mark.parametrize("override, pattern", [
    ("actor_rollout_ref.rollout.sde.type=ode", r"branched\.enabled=true needs a Flow-SDE-type sampler"),
    ("actor_rollout_ref.rollout.branched.num_children=1", r"rollout\.branched\.num_children=1 must be an int >= 2"),
    ("actor_rollout_ref.rollout.branched.branch_steps=[0,3]", r"rollout\.branched\.branch_steps=\[0, 3\] is invalid"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=flow_grpo", r"use actor_rollout_ref\.actor\.policy_loss\.loss_mode=tempflow_grpo"),
    ("data.train_batch_size=3", r"data\.train_batch_size=3 prompts do not split over 2 workers"),
])
def test_branched_refused_before_ray(tmp_path, tiny_model, override, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        _check(_cfg(tmp_path, f"actor_rollout_ref.model.path={tiny_model}", *_BRANCHED, override))
    assert "\n" not in str(e.value) and str(e.value).startswith("actor_rollout_ref.") or "data." in str(e.value)
