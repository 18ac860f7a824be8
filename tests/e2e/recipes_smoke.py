"""Train each given recipe two steps with the tiny model of its architecture, all in ONE Ray session.

Its cases run for tests/e2e/test_recipes_train_on_cpu.py through ``run_case`` in the e2e suite's shared Ray session
(tests/e2e/session_smoke.py, a subprocess: the platform must be chosen before verl is first imported, which a pytest
process that already imported verl cannot guarantee); ``main`` runs them alone. Prints one JSON line per recipe:
its history, validation history and the workers' report, or the error.

    python tests/e2e/recipes_smoke.py RECIPE:ARCH[:override,override...] ...
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def compose(name: str, overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_dir

    from verl_diffusion.main_flowgrpo import add_search_path

    argv = ["main_flowgrpo"]
    add_search_path(argv)
    search = [a for a in argv if a.startswith("hydra.searchpath")]
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return hydra_compose(config_name=name, overrides=[*search, *overrides])


def tiny_overrides(name: str, arch: str, tmp: str) -> list[str]:
    """The recipe shrunk in size only: 64 px, 2 prompts × 4 images, two mini-batches, 2 steps, one worker; every
    reward replaced by JPEG compressibility (random tiny models write no text; PickScore / HPSv3 need weights)."""
    raw = compose(name, [])
    return [f"actor_rollout_ref.model.tiny={{architecture: {arch}, seed: 0}}", "actor_rollout_ref.model.path=null",
            "actor_rollout_ref.rollout.resolution=64", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.rollout.micro_batch_size=4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.val_num_steps=4",
            "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.total_training_steps=2",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.val_num_images=2",
            "trainer.save_freq=-1", "trainer.logger=[]", f"trainer.run_dir={tmp}/run",
            f"trainer.default_local_dir={tmp}/ckpt",
            "data.train_files=[pkg://verl_diffusion/data/tiny_train_prompts.txt]",
            "data.val_files=[pkg://verl_diffusion/data/tiny_val_prompts.txt]",
            *[f"~reward.components.{k}" for k in raw.reward.components], "~reward.options",
            "+reward.components.jpeg_compressibility=1.0", "reward.executor=sync"]


RAY_ENV = {"VERL_PLATFORM": "cpu", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
           "VERL_LOGGING_LEVEL": "WARN"}


def run_case(case: str) -> dict:
    """One ``RECIPE:ARCH[:override,...]`` case in the caller's Ray session: its row (or the error)."""
    from verl_diffusion.main_flowgrpo import run_flowgrpo

    name, arch, *extra = case.split(":")
    extra = extra[0].split(",") if extra else []
    row: dict = {"recipe": name, "arch": arch}
    try:
        cfg = compose(name, [*tiny_overrides(name, arch, tempfile.mkdtemp(prefix=f"vd_{name}_")), *extra])
        summary = run_flowgrpo(cfg, finalize=False)
        row.update(history=summary["history"], val_history=summary["val_history"],
                   worker_info=summary["worker_info"], model_path=str(cfg.actor_rollout_ref.model.path),
                   loss_mode=str(cfg.actor_rollout_ref.actor.policy_loss.loss_mode), run_dir=summary["run_dir"],
                   model=summary.get("model"))
    except Exception as e:   # reported by the recipe's own test
        row["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    return row


def main(cases: list[str]) -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": RAY_ENV})
    try:
        for case in cases:
            print("RESULT " + json.dumps(run_case(case), default=float), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
