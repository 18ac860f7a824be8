"""Bad input stops before Ray with one line naming the field (issue 12 items 4, 5, 11): optimiser and step counts,
prompt files (empty, null cells, non-UTF-8, malformed JSON / parquet, too few prompts for a step), unknown reward
keys and options, switching rewards on the command line, and a remote reward that does not answer."""

import os
import socket
import subprocess
import sys

import pandas as pd
import pytest
from hydra import compose, initialize_config_module

from verl_diffusion.run_setup import replace_components_override
from verl_diffusion.main_flowgrpo import ConfigError, add_search_path, build_reward_fn, prepare_config, validate_config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from verl_diffusion.models.tiny import save_tiny_sd3

    return str(save_tiny_sd3(tmp_path_factory.mktemp("m") / "tiny"))


def _cfg(tmp_path, tiny_model, *overrides):
    argv = ["x", *overrides]
    add_search_path(argv)
    replace_components_override(argv)  # what main() does to the command line
    with initialize_config_module(config_module="verl_diffusion.config", version_base=None):
        cfg = compose(config_name="tiny_cpu", overrides=[f"trainer.run_dir={tmp_path}", f"trainer.default_local_dir={tmp_path}/ckpt",
                                                        f"actor_rollout_ref.model.path={tiny_model}",
                                                        *(a for a in argv[1:] if not a.startswith("--"))])
    prepare_config(cfg)
    return cfg


def _refused(tmp_path, tiny_model, pattern, *overrides):
    cfg = _cfg(tmp_path, tiny_model, *overrides)
    with pytest.raises(ConfigError, match=pattern) as info:
        validate_config(cfg)
    assert "\n" not in str(info.value)
    return str(info.value)


# -- item 11: numbers that used to reach Ray, or be accepted silently
@pytest.mark.parametrize("override, pattern", [
    ("actor_rollout_ref.actor.optim.lr=-1e-4", r"^actor_rollout_ref\.actor\.optim\.lr=-0\.0001 must be a number > 0"),
    ("actor_rollout_ref.actor.optim.lr=0", r"^actor_rollout_ref\.actor\.optim\.lr=0 must be a number > 0 \(lr 0 trains nothing"),
    ("trainer.total_training_steps=0", r"^trainer\.total_training_steps=0 must be an integer >= 1, or null"),
    ("trainer.total_epochs=0", r"^trainer\.total_epochs=0 must be an integer >= 1"),
    ("data.train_batch_size=9", r"^data\.train_batch_size=9 is larger than the 8 training prompts"),
    ("data.train_batch_size=0", r"^data\.train_batch_size=0 must be an integer >= 1"),
])
def test_numbers_refused_before_ray(tmp_path, tiny_model, override, pattern):
    _refused(tmp_path, tiny_model, pattern, override)


def test_train_max_samples_counts_for_the_batch(tmp_path, tiny_model):
    _refused(tmp_path, tiny_model, r"train_batch_size=4 is larger than the 2 training prompts",
             "data.train_max_samples=2")


def _bad_files(tmp_path):
    d = tmp_path / "files"
    d.mkdir()
    (d / "empty.txt").write_text("")
    (d / "blank.jsonl").write_text("\n \n")
    (d / "latin1.txt").write_bytes("a red cup\ncaf\xe9 au lait\n".encode("latin-1"))
    (d / "broken.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "a dog"\n')
    (d / "nullcell.jsonl").write_text('{"prompt": "a cat"}\n\n{"prompt": null}\n')
    (d / "emptycell.jsonl").write_text('{"prompt": "a cat"}\n{"prompt": "   "}\n')
    (d / "list.jsonl").write_text('["a cat"]\n')
    (d / "notparquet.parquet").write_text("this is text")
    pd.DataFrame({"prompt": ["a cat", None]}).to_parquet(d / "nullcell.parquet")
    pd.DataFrame({"prompt": [[{"role": "user", "content": "a cat"}], []]}).to_parquet(d / "emptychat.parquet")
    return d


BAD_FILES = [
    ("empty.txt", r"empty\.txt' holds no prompts \(empty, or blank lines only\)"),
    ("blank.jsonl", r"blank\.jsonl' holds no prompts"),
    ("latin1.txt", r"latin1\.txt' line 2: not valid UTF-8 \(invalid continuation byte at byte 3\)"),
    ("broken.jsonl", r"broken\.jsonl' line 2: invalid JSON \(Expecting ',' delimiter at column 19\)"),
    ("nullcell.jsonl", r"nullcell\.jsonl' line 3: the 'prompt' cell is None; every row needs a non-empty prompt"),
    ("emptycell.jsonl", r"emptycell\.jsonl' line 2: the 'prompt' cell is '   '"),
    ("list.jsonl", r"list\.jsonl' line 1: expected a JSON object, got list"),
    ("notparquet.parquet", r"notparquet\.parquet' is not a readable parquet file"),
    ("nullcell.parquet", r"nullcell\.parquet' row 1: the 'prompt' cell is (None|nan)"),
    ("emptychat.parquet", r"emptychat\.parquet' row 1: the 'prompt' cell is"),
]


@pytest.mark.parametrize("name, pattern", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_prompt_files_name_file_and_line(tmp_path, tiny_model, name, pattern):
    from verl_diffusion.trainer.dataset import read_rows

    d = _bad_files(tmp_path)
    with pytest.raises(ValueError, match=rf"^prompt file '.*{pattern}"):
        read_rows(str(d / name))
    field = "val_files" if name.endswith(".parquet") else "train_files"  # both fields go through read_rows
    _refused(tmp_path, tiny_model, rf"^data\.{field}: prompt file '.*{pattern}", f"data.{field}=[{d / name}]")


# -- item 5: reward keys and options
def test_reward_kwargs_and_unknown_reward_keys_are_errors(tmp_path, tiny_model):
    msg = _refused(tmp_path, tiny_model, r"^reward\.reward_kwargs is not a key this trainer reads \(reward options go under "
                   r"reward\.options\.<reward>\.<option>\); valid keys: components, options, penalty",
                   "+reward.reward_kwargs.options.geneval.url=http://127.0.0.1:18085")
    assert "timeout, preflight_timeout" in msg
    _refused(tmp_path, tiny_model, r"^reward\.timout is not a key", "+reward.timout=5")


def test_unknown_reward_options_name_the_valid_ones(tmp_path, tiny_model):
    _refused(tmp_path, tiny_model, r"^reward\.options\.jpeg_compressibility\.qualty is not an option of reward "
             r"'jpeg_compressibility'; valid options: quality, unit$", "+reward.options.jpeg_compressibility.qualty=90")
    _refused(tmp_path, tiny_model, r"^reward\.options\.genevl: no reward is named 'genevl'; rewards: .*geneval",
             "+reward.options.genevl.url=http://x")
    _refused(tmp_path, tiny_model, r"^reward\.preflight_timeout=0 must be a positive number", "reward.preflight_timeout=0")


def test_components_on_the_command_line_replace_the_recipes(tmp_path, tiny_model):
    """The validator says `reward.components={ocr: 1.0}`: that now selects exactly these rewards (hydra alone
    refuses it, or with `++` merges it with the recipe's jpeg_compressibility)."""
    cfg = _cfg(tmp_path, tiny_model, "reward.components={jpeg_incompressibility: 2.0, geneval: 1.0}",
               "+reward.options.geneval.url=http://127.0.0.1:1")
    validate_config(cfg)
    assert dict(cfg.reward.components) == {"jpeg_incompressibility": 2.0, "geneval": 1.0}
    reward = build_reward_fn(cfg)
    assert reward.names == ["jpeg_incompressibility", "geneval"] and reward.rewards["geneval"].url == "http://127.0.0.1:1"


def test_documented_url_override_is_the_key_the_trainer_reads():
    """docs/rewards.md and scripts/reward_server.py used to document reward.reward_kwargs.options.geneval.url,
    which the trainer never reads (with `+` it was silently ignored)."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for rel in ("docs/rewards.md", "scripts/reward_server.py"):
        text = open(os.path.join(repo, rel)).read()
        assert "reward.options.geneval.url=http://HOST" in text, rel
        assert "reward_kwargs.options.geneval" not in text, rel


def test_options_of_a_switched_off_reward_are_dropped_with_a_note(tmp_path, tiny_model, capsys):
    cfg = _cfg(tmp_path, tiny_model, "+reward.options.geneval.url=${oc.env:NO_SUCH_VARIABLE_H12E}")
    validate_config(cfg)
    assert build_reward_fn(cfg).names == ["jpeg_compressibility"]
    assert "note: reward.options for geneval ignored: not in reward.components (jpeg_compressibility)" in capsys.readouterr().out


# -- item 4: the CLI stops before Ray with one line naming the URL of a remote reward that does not answer
def _closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_cli_dead_reward_server_and_bad_lr_stop_before_ray(tmp_path):
    env = dict(os.environ, VERL_DIFFUSION_RUN_ROOT=str(tmp_path))
    url = f"http://127.0.0.1:{_closed_port()}"
    res = subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "reward.components={geneval: 1.0}",
                          f"+reward.options.geneval.url={url}", "reward.preflight_timeout=3"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("config error:")]
    assert len(lines) == 1 and lines[0].startswith(f"config error: reward 'geneval': {url} does not answer ("), lines
    assert "before the first step" in lines[0] and "reward.options.geneval.url" in lines[0]
    assert "Started a local Ray instance" not in res.stdout + res.stderr
