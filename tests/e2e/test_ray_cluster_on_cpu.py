"""A run joins an existing Ray cluster (docs/multinode.md) and ``trainer.val_only`` validates its checkpoint.

A head started with ``ray start --head`` and a second "node" (``ray start --address``, its own raylet and CPUs, on
the same host) form a 2-node cluster; ``python -m verl_diffusion.main_flowgrpo`` with ``RAY_ADDRESS`` set trains 2
steps of the tiny model on one worker per node (nnodes 2 × 1) there instead of starting its own Ray, saves and
exports. Then the same command with ``trainer.val_only=true`` validates the newest checkpoint and changes no run state.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

RAY = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster():
    if RAY is None:
        pytest.skip("the ray command is not installed next to this Python")
    port = _free_port()
    # Ray's token authentication: every node and the driver share one token, as on a real cluster (docs/multinode.md).
    # A short session folder: Ray's socket paths under pytest's tmp_path (popen-gw1/...) exceed AF_UNIX's 107 bytes.
    ray_tmp = tempfile.mkdtemp(prefix="vdray", dir="/tmp")
    env = dict(os.environ, VERL_PLATFORM="cpu", RAY_TMPDIR=ray_tmp, RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN=os.urandom(16).hex())
    address = f"127.0.0.1:{port}"
    head = subprocess.run([RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                           "--include-dashboard=false",
                           "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=300)
    assert head.returncode == 0, head.stderr[-2000:]
    try:
        node = subprocess.run([RAY, "start", f"--address={address}", "--node-ip-address=127.0.0.1", "--num-cpus=1",
                               "--disable-usage-stats"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert node.returncode == 0, node.stderr[-2000:]
        yield address, env
    finally:
        _stop_cluster(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _stop_cluster(ray_tmp: str) -> None:
    """Kill this cluster's processes only: every one names its session folder (under ``ray_tmp``) on its command
    line. ``ray stop`` would kill every Ray on the machine, the other pytest worker's included."""
    import signal

    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if ray_tmp in cmd:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass


def _main(env, address, root, *overrides):
    env = dict(env, RAY_ADDRESS=address, VERL_DIFFUSION_RUN_ROOT=str(root))
    return subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name", "tiny_cpu",
                           "trainer.total_training_steps=2", "trainer.nnodes=2", "trainer.n_gpus_per_node=1",
                           "data.train_batch_size=2", "trainer.save_freq=2", "trainer.test_freq=-1",
                           "trainer.val_before_train=false", *overrides],
                          env=env, capture_output=True, text=True, timeout=1200)


def test_a_run_joins_the_cluster_and_val_only_validates_its_checkpoint(cluster, tmp_path):
    address, env = cluster
    res = _main(env, address, tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    # the head's GCS (its host address as Ray reports it, the port we started it on) with both nodes' CPUs
    assert re.search(rf"ray: joined the cluster at \S+:{address.rsplit(':', 1)[1]} \(2 nodes, 2 CPUs, 0 GPUs\)", out), \
        out[-3000:]
    assert "Started a local Ray instance" not in out
    run_dir = Path(tmp_path) / "tiny_cpu"
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == [1, 2]
    assert (run_dir / "model" / "export_info.json").is_file()
    state = (run_dir / "run_state.json").read_text()

    res = _main(env, address, tmp_path, "trainer.val_only=true")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert f"validation only, of {run_dir}/checkpoints/global_step_2" in out, out[-3000:]
    assert "validation step 2 | reward" in out and "step 3/" not in out
    assert (run_dir / "validation" / "step_00002.jsonl").is_file()
    assert (run_dir / "run_state.json").read_text() == state
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == [1, 2]
