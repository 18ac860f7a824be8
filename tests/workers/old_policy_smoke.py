"""The real actor-rollout worker with ``actor.old_policy`` on (FSDP2 DTensor shards, gloo, 1 process, no Ray).

Executed by tests/workers/test_old_policy_on_cpu.py in a subprocess (VERL_PLATFORM=cpu before verl is imported).
For full fine-tune and LoRA: two diffusion_nft steps with schedule constant d = 0.5; prints one JSON line per check.
"""

import json
import os
import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(out_dir: str) -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(free_port())}.items():
        os.environ.setdefault(k, v)
    import numpy as np
    import torch
    from hydra import compose, initialize_config_module

    from verl import DataProto
    from verl_diffusion.main_flowgrpo import add_search_path, prepare_config
    from verl_diffusion.models.tiny import save_tiny_sd3
    from verl_diffusion.workers import worker as wmod
    from verl_diffusion.workers.old_policy import local_tensor

    tiny = str(save_tiny_sd3(os.path.join(out_dir, "tiny")))

    def locals_(w):
        wmod._reshard(w.actor.engine)
        return [local_tensor(p).detach().clone() for p in w.old_policy.params]

    def maxdiff(a, b):
        return max(float((x - y).abs().max()) for x, y in zip(a, b))

    for lora in (0, 4):
        with initialize_config_module(config_module="verl_diffusion.config", version_base=None):
            argv = ["x"]
            add_search_path(argv)
            search = [a for a in argv if a.startswith("hydra.searchpath")]
            cfg = compose(config_name="tiny_cpu", overrides=[
                *search, f"trainer.run_dir={out_dir}/run{lora}", f"trainer.default_local_dir={out_dir}/ck{lora}",
                f"actor_rollout_ref.model.path={tiny}", "actor_rollout_ref.model.tiny=null",
                f"actor_rollout_ref.model.lora_rank={lora}", "actor_rollout_ref.model.lora_alpha=8",
                "actor_rollout_ref.model.init_lora_weights=gaussian",
                "actor_rollout_ref.actor.policy_loss.loss_mode=diffusion_nft",
                "actor_rollout_ref.actor.old_policy.schedule=constant", "actor_rollout_ref.actor.old_policy.decay=0.5",
                "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.micro_batch_size=4",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.num_steps=3",
                "actor_rollout_ref.rollout.sde.window.size=2", "actor_rollout_ref.rollout.sde.window.hi=2",
                "trainer.n_gpus_per_node=1"])
        prepare_config(cfg)
        w = wmod.DiffusionActorRolloutRefWorker(cfg.actor_rollout_ref)
        w.init_model()
        engine = w.actor.engine
        trainable = [p for p in engine.module.parameters() if p.requires_grad]
        from torch.distributed.tensor import DTensor

        seen = {}
        orig_generate = w.rollout.generate

        def spy_generate(*a, **k):
            cur = [local_tensor(p).detach() for p in w.old_policy.params]
            seen["weights"] = [c.clone() for c in cur]
            return orig_generate(*a, **k)

        w.rollout.generate = spy_generate
        captured = {}
        orig_prepare = wmod.prepare_steps

        def spy_prepare(loss, rows, *, velocity_fn=None, generator=None):
            captured["rows"], captured["gen_state"] = rows, generator.get_state()
            captured["shadow"] = [s_.clone() for s_ in w.old_policy.shadow]
            out = orig_prepare(loss, rows, velocity_fn=velocity_fn, generator=generator)
            captured["out"] = out
            return out

        wmod.prepare_steps = spy_prepare

        def step(s):
            prompts = np.array(["red apple", "red apple", "blue car", "blue car"], dtype=object)
            gen = DataProto.from_dict(non_tensors={"prompt": prompts, "uid": np.array(["a", "a", "b", "b"], dtype=object)},
                                      meta_info={"seed": s, "iteration": s - 1})
            out = w.generate_sequences(gen)
            out.batch.pop("images")
            b = DataProto(batch=out.batch, non_tensor_batch=gen.non_tensor_batch, meta_info=dict(gen.meta_info))
            tm = b.batch["train_mask"]
            b.batch["advantages"] = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand_as(tm).float().contiguous()
            b.batch["old_log_probs"] = b.batch["rollout_log_probs"]
            b.batch["group_ids"] = torch.tensor([0, 0, 1, 1])
            b.meta_info.update({"mini_batch_size": 4, "ppo_epochs": 1, "seed": s})
            before = [s_.clone() for s_ in w.old_policy.shadow]
            res = w.update_actor(b)
            return before, res.meta_info["metrics"]

        before, metrics = step(1)
        theta = locals_(w)
        expect = [torch.lerp(o, t, 0.5) for o, t in zip(before, theta)]
        row = {"check": f"update_lora{lora}", "decay": w.old_policy.last_decay,
               "metric": float(metrics["actor/old_policy_decay"]), "shadow_err": maxdiff(expect, w.old_policy.shadow),
               "dtensor": isinstance(trainable[0], DTensor), "n_tracked": len(w.old_policy.params),
               "n_trainable": len(trainable), "moved": maxdiff(before, theta),
               "grad_norm": float(np.mean(metrics.get("grad_norm", [float("nan")])))}
        # second step: the rollout samples with θ_old, prepare_steps' fresh v_old is v(θ_old)
        step(2)
        # θ_old at step 2's rollout = the shadow captured at step 2's prepare (no update in between), ≠ θ
        row["rollout_swapped"] = (all(torch.equal(a, b) for a, b in zip(seen["weights"], captured["shadow"]))
                                  and maxdiff(seen["weights"], theta) > 0)
        # recompute step 2's prepared tensors from the captured rows and generator state with a given θ_old swapped
        # in: the shadow before step 2's update (what the worker used) must give them bitwise; θ (the weights
        # before step 2's update, i.e. what schedule none would use) must not.
        theta2 = locals_(w)
        wmod.prepare_steps = orig_prepare
        saved = [s_.clone() for s_ in w.old_policy.shadow]
        key = "prep/fresh_old_velocity"

        def recompute(values):
            with torch.no_grad():
                for s_, o in zip(w.old_policy.shadow, values):
                    s_.copy_(o)
            g = torch.Generator()
            g.set_state(captured["gen_state"])
            with engine.eval_mode(), w._old_policy_swap():
                out = orig_prepare(w.step_loss, captured["rows"], velocity_fn=engine.velocity_fn(), generator=g)[key]
            with torch.no_grad():
                for s_, o in zip(w.old_policy.shadow, saved):
                    s_.copy_(o)
            return out

        v_old = recompute(captured["shadow"])
        v_cur = recompute(theta)
        row["prep_old_vs_theta_old"] = float((captured["out"][key] - v_old).abs().max())
        row["prep_old_vs_theta"] = float((captured["out"][key] - v_cur).abs().max())
        row["restored_bitwise"] = all(torch.equal(a, b) for a, b in zip(locals_(w), theta2))
        print(json.dumps(row), flush=True)

        # checkpoint round trip
        ck = os.path.join(out_dir, f"ckpt{lora}")
        w.save_checkpoint(ck, None, 2, None)
        ref = [s.clone() for s in w.old_policy.shadow]
        steps = int(engine.optimizer_steps)
        with torch.no_grad():
            for s in w.old_policy.shadow:
                s.add_(1.0)
        engine.optimizer_steps = 0
        w.load_checkpoint(ck, None, False)
        print(json.dumps({"check": f"ckpt_lora{lora}",
                          "shadow_equal": all(torch.equal(a, b) for a, b in zip(ref, w.old_policy.shadow)),
                          "optimizer_steps": int(engine.optimizer_steps), "expected_steps": steps}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
