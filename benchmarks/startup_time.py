"""Start-up of a training run: driver start -> workers ready -> first step line, for one or more checkouts, side by
side in one run; and the cost of one more Ray actor that imports verl (what each extra process of verl's stock V1
set-up costs: TaskRunner, TransferQueue, reward-loop and agent-loop workers, router, server actors).

    python benchmarks/startup_time.py [--python LABEL=PATH ...] [--runs 2] [--actors 1 4]
        [--out benchmarks/results/startup_time.md]

Each ``--python`` is an interpreter whose environment has a verl_diffusion checkout installed (e.g. main's and a
branch's ``.venv/bin/python``); default: this interpreter. Each runs the default CPU demo for 2 steps
(``trainer.total_training_steps=2``, no validation, no logger) from an empty directory; the runs alternate between
the interpreters so that a change in the machine's load hits both. Times are wall seconds from the process start.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

RUN = ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
       "trainer.logger=[]"]
MARKS = (("run dir:", "driver ready (config checked)"), ("workers:", "workers + replicas ready"),
         ("step 1/", "first step line"))


def time_run(python: str) -> dict:
    """Seconds from process start to each mark, and to exit."""
    with tempfile.TemporaryDirectory() as root:
        env = dict(os.environ, VERL_DIFFUSION_RUN_ROOT=root)
        t0 = time.perf_counter()
        proc = subprocess.Popen([python, "-m", "verl_diffusion.main_flowgrpo", *RUN], cwd=root, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        err: list = []
        threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
        seen = {}
        for line in proc.stdout:
            for mark, _ in MARKS:
                if mark not in seen and line.startswith(mark):
                    seen[mark] = time.perf_counter() - t0
        rc = proc.wait()
        seen["exit"] = time.perf_counter() - t0
        if rc:
            raise RuntimeError(f"{python} exited {rc}: {''.join(err)[-3000:]}")
        return seen


def actor_cost(counts: list[int]) -> dict[int, float]:
    """Seconds until n Ray actors that import verl (with our plugin, as every verl process does) are ready."""
    import ray

    env = {"VERL_PLATFORM": "cpu", "OMP_NUM_THREADS": "1"}
    ray.init(num_cpus=max(counts) + 1, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": env})

    @ray.remote(num_cpus=1)
    class VerlImporter:
        def __init__(self):
            import verl.trainer.ppo.v1  # noqa: F401  (what verl's V1 actors import)

        def ready(self):
            return True

    out = {}
    for n in counts:
        t0 = time.perf_counter()
        actors = [VerlImporter.remote() for _ in range(n)]
        ray.get([a.ready.remote() for a in actors])
        out[n] = time.perf_counter() - t0
        for a in actors:
            ray.kill(a)
    ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", action="append", default=None, help="LABEL=PATH of an interpreter (repeatable)")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--actors", type=int, nargs="*", default=[1, 4])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    pythons = [p.split("=", 1) for p in (args.python or [f"this={sys.executable}"])]
    results: dict[str, list[dict]] = {label: [] for label, _ in pythons}
    for _ in range(args.runs):
        for label, path in pythons:
            results[label].append(time_run(path))
    med = {label: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for label, rows in results.items()}

    labels = [label for label, _ in pythons]
    lines = ["# Start-up time of a training run (default CPU demo, 2-core CPU)", "",
             f"`python benchmarks/startup_time.py {' '.join(sys.argv[1:])}`; medians of {args.runs} runs each, "
             "alternating; wall seconds from the process start.", "",
             "| mark | " + " | ".join(f"{lb} s" for lb in labels) + (" | ratio |" if len(labels) == 2 else " |"),
             "|---|" + "---|" * len(labels) + ("---|" if len(labels) == 2 else "")]
    for key, name in [*MARKS, ("exit", "exit (2 steps done)")]:
        vals = [med[lb].get(key, float("nan")) for lb in labels]
        row = f"| {name} | " + " | ".join(f"{v:.1f}" for v in vals) + " |"
        if len(labels) == 2:
            row += f" {vals[1] / vals[0]:.2f}× |"
        lines.append(row)
    if args.actors:
        cost = actor_cost(args.actors)
        lines += ["", "Ray actors importing verl (`import verl.trainer.ppo.v1`, plugin loaded), started together:", "",
                  "| actors | seconds until ready |", "|---|---|"]
        lines += [f"| {n} | {s:.1f} |" for n, s in cost.items()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
