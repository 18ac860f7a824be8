"""Train the tiny model a few steps colocated and through a standalone diffusers replica (weights through the
``diffusion_gloo`` checkpoint engine), LoRA and full fine-tune, all in ONE Ray session.

Its cases run for tests/e2e/test_standalone_replica_on_cpu.py through ``run_case`` in the e2e suite's shared Ray
session (tests/e2e/session_smoke.py, a subprocess: the platform is chosen before verl is first imported); ``main``
runs them alone. Standalone runs get one replica per actor worker: replica r samples the rows colocated worker r would,
with the same seed, so with equal weights a standalone run and a colocated one are the same computation.
After every weight sync the trainer below compares the replica's transformer with the actor's, tensor by tensor.
Prints one ``RESULT {json}`` line per run.

    python tests/e2e/standalone_smoke.py NAME:PLACEMENT:LORA_RANK[:sync|async[:WORKERS]] ...

WORKERS actor workers (default 1) and, standalone, as many replicas: replica r samples worker r's rows with worker
r's seed, so a standalone run still reproduces the colocated one.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback

STEPS = int(os.environ.get("VD_STANDALONE_STEPS", "3"))


def overrides(placement: str, lora: int, tmp: str, mode: str = "sync", workers: int = 1) -> list[str]:
    return [f"actor_rollout_ref.rollout.placement={placement}", f"actor_rollout_ref.model.lora_rank={lora}",
            "actor_rollout_ref.model.lora_alpha=8", "actor_rollout_ref.model.init_lora_weights=gaussian",
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.micro_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.num_steps=4",
            "actor_rollout_ref.rollout.sde.window.size=3", "actor_rollout_ref.rollout.sde.window.hi=3",
            "actor_rollout_ref.rollout.val_num_steps=4", f"trainer.n_gpus_per_node={workers}",
            f"actor_rollout_ref.rollout.standalone.num_replicas={workers}",
            f"trainer.total_training_steps={STEPS}", "trainer.test_freq=-1", "trainer.val_before_train=false",
            "trainer.save_freq=-1", "trainer.logger=[]", f"trainer.v1.trainer_mode=diffusion_probe_{mode}",
            f"trainer.run_dir={tmp}/run", f"trainer.default_local_dir={tmp}/ckpt",
            "reward.executor=sync"]


def register_probe_trainer():
    """``diffusion_probe``: the sync trainer plus, after each weight sync, the replica-vs-actor weight comparison."""
    import ray
    from verl.trainer.ppo.v1.trainer_base import register_trainer

    from verl_diffusion.trainer.async_trainer import RayFlowGRPOAsyncTrainer
    from verl_diffusion.trainer.flowgrpo_trainer import RayFlowGRPOTrainer

    def full_state(worker):   # runs in the actor worker (one rank: the DTensors are whole)
        from verl_diffusion.rollout.checkpoint_engine import actor_weights
        from verl_diffusion.workers.worker import _reshard

        _reshard(worker.actor.engine)
        return {k: v.cpu().clone() for k, v in actor_weights(worker.actor.engine.module, lora_only=False)}

    class Probe:
        probes: list = []

        def _sync_and_compare(self):
            sync = self.checkpoint_manager.update_weights(self.global_steps) or {}
            row = {"step": int(self.global_steps), "sync": {k: float(v) for k, v in sync.items()}}
            if getattr(self.rollout_replicas[0], "rollout_mode", None) is not None and \
                    self.rollout_replicas[0].rollout_mode.value == "standalone":
                # every actor rank gathers (collective); every replica is compared with rank 0's full tensors
                actor = ray.get([w.__ray_call__.remote(full_state) for w in self.actor_rollout_wg.workers])[0]
                workers = [rep.workers[0] for rep in self.rollout_replicas]
                states = ray.get([w.transformer_state.remote() for w in workers])
                row.update(keys_equal=all(sorted(actor) == sorted(r) for r in states),
                           bitwise_equal=all(k in r and bool((actor[k] == r[k]).all()) for r in states for k in actor),
                           max_abs_diff=max(float((actor[k] - r[k]).abs().max()) for r in states for k in actor),
                           replica_version=min(ray.get([w.get_global_steps.remote() for w in workers])),
                           replica_sync=ray.get(workers[0].last_sync.remote()), replicas=len(workers))
            Probe.probes.append(row)

        def on_init_end(self):
            self._sync_and_compare()

        def on_step_end(self):
            self._sync_and_compare()

    register_trainer("diffusion_probe_sync")(type("ProbeSync", (Probe, RayFlowGRPOTrainer), {}))
    register_trainer("diffusion_probe_async")(type("ProbeAsync", (Probe, RayFlowGRPOAsyncTrainer), {}))
    return Probe


def run_case(case: str, probe) -> dict:
    """One ``NAME:PLACEMENT:LORA_RANK[:sync|async[:WORKERS]]`` case in the caller's Ray session (the probe trainers
    registered by ``register_probe_trainer``, passed as ``probe``): its row (or the error)."""
    from recipes_smoke import compose

    from verl_diffusion.main_flowgrpo import run_flowgrpo

    name, placement, lora, *rest = case.split(":")
    mode = rest[0] if rest else "sync"
    workers = int(rest[1]) if len(rest) > 1 else 1
    row: dict = {"name": name, "placement": placement, "lora": int(lora), "mode": mode, "workers": workers}
    probe.probes = []
    try:
        cfg = compose("tiny_cpu", overrides(placement, int(lora), tempfile.mkdtemp(prefix=f"vd_{name}_"), mode,
                                         workers))
        summary = run_flowgrpo(cfg, finalize=False)
        row.update(history=summary["history"], worker_info=summary["worker_info"], probes=probe.probes)
    except Exception as e:   # reported by the run's own test
        row["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    return row


def main(cases: list[str]) -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    import ray

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from recipes_smoke import RAY_ENV

    probe = register_probe_trainer()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": RAY_ENV})
    try:
        for case in cases:
            print("RESULT " + json.dumps(run_case(case, probe), default=float), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
