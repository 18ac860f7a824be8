"""Every GPU recipe against its published source (verl_diffusion/recipe_sources.py, docs/recipes.md).

The tables in docs/recipes.md are rendered from the composed recipes and their sources files: this test fails when
the page is stale (a recipe value changed and its table was not regenerated), when a row differs from its source or
the source is silent without a reason, when a sources key does not exist in the composed recipe, and it checks the
fixes the tables record (flow_grpo's 48 groups and 2 optimizer steps, zero-advantage samples dropped)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from verl_diffusion.main_flowgrpo import add_search_path, recipes_dir
from verl_diffusion.recipe_sources import BEGIN, END, recipes_with_sources, render_all, table_rows

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted(p.stem for p in Path(recipes_dir()).glob("*.yaml"))


@pytest.fixture(scope="module")
def composed():
    argv = ["m"]
    add_search_path(argv)
    search = [a for a in argv if a.startswith("hydra.searchpath")]
    with initialize_config_dir(config_dir=recipes_dir(), version_base="1.3"):
        return {name: compose(config_name=name, overrides=search) for name in RECIPES}


def test_every_gpu_recipe_has_a_sources_table():
    assert recipes_with_sources() == [n for n in RECIPES if n != "tiny_cpu"]


def test_docs_tables_are_the_rendering_of_the_recipes():
    doc = (ROOT / "docs" / "recipes.md").read_text()
    block = doc[doc.index(BEGIN):doc.index(END) + len(END)]
    assert block == render_all(), ("docs/recipes.md is stale: python -m verl_diffusion.recipe_sources --write "
                                   "docs/recipes.md")


def test_every_difference_and_silence_is_explained_and_every_key_exists(composed):
    for name in recipes_with_sources():
        for row in table_rows(name, composed[name]):
            assert row["ours"] != "<missing>", (name, row["key"])
            if row["same"] != "yes":
                assert str(row.get("why", "")).strip(), (name, row["key"], row["ours"], row["source"])


FLOW_GRPO_CODEBASE = ["sd35_ocr_flowgrpo", "sd35_pickscore_flowgrpo", "sd35_geneval_flowgrpo", "sd35_ocr_flow_cps",
                      "sd35_ocr_grpo_guard"]


@pytest.mark.parametrize("name", FLOW_GRPO_CODEBASE)
def test_flow_grpo_family_drops_zero_advantage_samples_with_flow_grpos_batch(composed, name):
    cfg = composed[name]
    assert cfg.algorithm.flow_grpo.filter_zero_advantage is True
    a = cfg.actor_rollout_ref
    groups, mini, epochs = int(cfg.data.train_batch_size), int(a.actor.ppo_mini_batch_size), int(a.actor.ppo_epochs)
    assert (groups, int(a.rollout.n), groups // mini * epochs) == (48, 24, 2)   # 48 groups of 24, 2 optimizer steps


def test_dppo_recipes_run_the_papers_main_setting(composed):
    for name in ("sd35_ocr_flow_dppo", "sd35_multi_gdpo", "flux1_dev_pickscore_flow_dppo", "flux2_klein_ocr_flow_dppo"):
        cfg = composed[name]
        a = cfg.actor_rollout_ref
        assert (int(cfg.data.train_batch_size), int(a.rollout.n), int(a.actor.ppo_epochs)) == (64, 16, 1), name
        assert cfg.algorithm.flow_grpo.std_mode == "group", name
