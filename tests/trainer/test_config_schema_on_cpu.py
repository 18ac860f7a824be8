"""The typed run config (verl_diffusion/config/schema.py): the composed YAML read once into frozen sections whose
values are the YAML's, a missing or bad key refused with one line naming it, and no default stated outside the YAML."""

import dataclasses

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf, open_dict

from verl_diffusion.config import schema
from verl_diffusion.main_flowgrpo import add_search_path, prepare_config, validate_config


def _compose(tmp_path, name="shapes_cpu", *overrides):
    with initialize_config_module(config_module="verl_diffusion.config", version_base=None):
        argv = ["x"]
        add_search_path(argv)
        search = [a for a in argv if a.startswith("hydra.searchpath")]
        cfg = compose(config_name=name, overrides=[*search, f"trainer.run_dir={tmp_path}",
                                                   f"trainer.default_local_dir={tmp_path}/ckpt", *overrides])
    prepare_config(cfg)
    return cfg


def test_the_default_run_typed_once(tmp_path):
    cfg = _compose(tmp_path)
    run = validate_config(cfg)
    assert isinstance(run, schema.RunConfig)
    arr = run.actor_rollout_ref
    s = arr.rollout.sampler
    assert (s.num_steps, s.val_num_steps, s.height, s.width, s.grid, s.sampler, s.noise_level) == \
        (10, 10, 32, 32, "scheduler", "flow_sde", 0.7)
    assert s.window.mode == "none" and arr.rollout.n == 8 and arr.rollout.rows_per_prompt == 8
    assert arr.rollout.branched is None and arr.rollout.placement == "colocated"
    assert arr.model.architecture == "sd3" and arr.model.lora.lora_rank == 0 and arr.model.dtype == "fp32"
    a = arr.actor
    assert a.loss_mode == "awm" and type(a.loss).__name__.lower().startswith("awm")
    assert (a.loss.kl_coef, a.loss.phi, a.lr, a.train_step_fraction) == (0.01, "uniform", 1e-4, 1.0)
    assert a.loss.off_policy is False
    assert (a.lr_scheduler_type, a.min_lr_ratio) == ("cosine", 0.1)
    assert (a.old_policy.schedule, a.old_policy.decay_max, a.old_policy.use_for_rollout) == ("awm_linear", 0.3, True)
    assert run.data.train_batch_size == 8 and run.data.num_val_prompts == 572 and run.data.num_train_prompts >= 8
    assert run.reward.components == {"shapes": 1.0} and run.adv_estimator == "flow_grpo"
    assert run.trainer.num_workers == 2 and run.trainer.trainer_mode == "diffusion_sync"
    assert not run.trainer.samples_ahead and run.trainer.total_training_steps == 92


def test_sections_are_frozen_and_read_as_mappings(tmp_path):
    run = validate_config(_compose(tmp_path))
    rollout = run.actor_rollout_ref.rollout
    with pytest.raises(dataclasses.FrozenInstanceError):
        rollout.n = 4
    assert rollout["n"] == rollout.get("n") == 8 and dict(rollout)["name"] == "diffusers"
    assert set(run) == {"data", "actor_rollout_ref", "adv_estimator", "reward", "trainer"}
    with pytest.raises(KeyError):
        rollout["nope"]


def test_a_missing_key_is_one_line_naming_it(tmp_path):
    cfg = _compose(tmp_path)
    with open_dict(cfg):
        del cfg.actor_rollout_ref.rollout["micro_batch_size"]
    with pytest.raises(schema.ConfigError) as e:
        validate_config(cfg)
    assert str(e.value).startswith("actor_rollout_ref.rollout.micro_batch_size is missing") and "\n" not in str(e.value)


@pytest.mark.parametrize("override, pattern", [
    ("actor_rollout_ref.rollout.n=0", r"^actor_rollout_ref\.rollout\.n=0 must be an integer >= 1"),
    ("actor_rollout_ref.model.dtype=fp8", r"^actor_rollout_ref\.model\.dtype='fp8' is unknown"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0", r"ppo_micro_batch_size_per_gpu=0 must be an integer"),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type=linear",
     r"^actor_rollout_ref\.actor\.optim\.lr_scheduler_type='linear': want one of \['constant', 'cosine'\]"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio=1.5", r"^actor_rollout_ref\.actor\.optim\.min_lr_ratio=1\.5 must be"),
    ("actor_rollout_ref.actor.ema.enable=true actor_rollout_ref.rollout.placement=standalone "
     "actor_rollout_ref.actor.old_policy.use_for_rollout=false", r"^actor_rollout_ref\.actor\.ema\.enable=true"),
])
def test_bad_values_are_refused_with_the_field(tmp_path, override, pattern):
    with pytest.raises(schema.ConfigError, match=pattern) as e:
        validate_config(_compose(tmp_path, "shapes_cpu", *override.split()))
    assert "\n" not in str(e.value)


def test_no_default_outside_the_yaml():
    """Every field of a typed section comes from the YAML (no dataclass default to drift from it); the sampler's own
    RolloutConfig, θ_old's and the failure budget's keep defaults for code that runs without a config, and the
    typed reading passes every one of their fields explicitly (checked on the default run above)."""
    sections = [c for c in vars(schema).values() if isinstance(c, type) and issubclass(c, schema.Section)
                and c is not schema.Section]
    assert len(sections) >= 10
    for cls in sections:
        with_default = [f.name for f in dataclasses.fields(cls)
                        if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]
        assert not with_default, (cls.__name__, with_default)


def test_yaml_section_is_the_shipped_defaults():
    rollout = schema.yaml_section("actor_rollout_ref.rollout")
    assert rollout["num_steps"] == 10 and rollout["sde"]["type"] == "flow_sde"
    assert rollout["log_prob_micro_batch_size_per_gpu"] is None      # interpolates the actor section: detached
    node = OmegaConf.merge(rollout, {"n": 3, "resolution": 64})
    typed = schema.RolloutSection.from_node(node)
    assert typed.n == 3 and typed.sampler.height == 64 and typed.sampler.val_num_steps == 40
