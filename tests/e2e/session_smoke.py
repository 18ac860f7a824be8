"""Every in-process training of the e2e suite in ONE Ray session, one subprocess (tests/e2e/conftest.py).

Each Ray session of its own costs a Python start, the verl import and ``ray.init`` (about half a minute on the
2-core CI machine): the recipe runs (tests/e2e/recipes_smoke.py), the standalone / async replica runs
(tests/e2e/standalone_smoke.py) and the short tiny-model trainings of tests/e2e/test_train_tiny_on_cpu.py share
one here. ``run_flowgrpo`` uses the initialised Ray and releases each run's workers and placement groups.

    python tests/e2e/session_smoke.py '{"kind": "recipe", "case": "RECIPE:ARCH[:override,...]"}' \\
        '{"kind": "standalone", "case": "NAME:PLACEMENT:LORA_RANK[:sync|async[:WORKERS]]"}' \\
        '{"kind": "tiny", "name": NAME, "overrides": [...], "geneval": false}' ...

Prints one ``RESULT {json}`` line per case, in order, with ``kind`` and ``key`` (the case string or the name) added.
A ``tiny`` case is tiny_cpu with the given overrides in a fresh run directory; its row holds ``rows`` (the run's
metrics.jsonl, as a command-line run writes it), ``out`` (what the trainer printed) and ``worker_info``; with
``geneval`` the run gets tests/e2e/geneval_helpers.py's prompt file and a live GenEval server of its own.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run_tiny(name: str, overrides: list[str], geneval: bool = False) -> dict:
    from recipes_smoke import compose

    from verl_diffusion.main_flowgrpo import run_flowgrpo

    tmp = tempfile.mkdtemp(prefix=f"vd_{name}_")
    row: dict = {"name": name}
    out = io.StringIO()
    srv = None
    try:
        if geneval:   # the fault test's prompt file (GenEval ground truth) and a live GenEval server
            from geneval_helpers import geneval_prompts, geneval_server

            prompts = geneval_prompts(os.path.join(tmp, "prompts.jsonl"))
            srv, url = geneval_server()
            overrides = [f"data.train_files=[{prompts}]", f"data.val_files=[{prompts}]",
                         f"+reward.options.geneval.url={url}", *overrides]
        cfg = compose("tiny_cpu", [f"trainer.run_dir={tmp}/run", f"trainer.default_local_dir={tmp}/ckpt", *overrides])
        with contextlib.redirect_stdout(out):
            summary = run_flowgrpo(cfg, finalize=False)
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            row.update(rows=[json.loads(line) for line in f], worker_info=summary["worker_info"],
                       run_dir=f"{tmp}/run", ckpt_dir=f"{tmp}/ckpt", model=summary.get("model"))
    except Exception as e:   # reported by the run's own test
        row["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    finally:
        if srv is not None:
            srv.shutdown()
            srv.server_close()
    row["out"] = out.getvalue()
    return row


def main(specs: list[dict]) -> None:
    os.environ["VERL_PLATFORM"] = "cpu"
    import ray

    import standalone_smoke
    from recipes_smoke import RAY_ENV, run_case as run_recipe

    probe = standalone_smoke.register_probe_trainer()
    # standalone runs need one CPU per actor worker and one per replica (2 + 2)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": RAY_ENV})
    try:
        for spec in specs:
            t0 = time.perf_counter()
            kind = spec["kind"]
            if kind == "recipe":
                row, key = run_recipe(spec["case"]), spec["case"]
            elif kind == "standalone":
                row, key = standalone_smoke.run_case(spec["case"], probe), spec["case"]
            elif kind == "tiny":
                row, key = run_tiny(spec["name"], list(spec["overrides"]), bool(spec.get("geneval"))), spec["name"]
            else:
                raise ValueError(f"unknown case kind {kind!r}")
            # each case's wall time: in its row, and on stderr (which the e2e conftest prints when the session fails)
            elapsed = round(time.perf_counter() - t0, 1)
            print(f"session case {kind} {key}: {elapsed} s", file=sys.stderr, flush=True)
            print("RESULT " + json.dumps({**row, "kind": kind, "key": key, "elapsed_s": elapsed}, default=float),
                  flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main([json.loads(a) for a in sys.argv[1:]])
