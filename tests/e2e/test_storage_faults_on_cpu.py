"""A full disk and a read-only file system, for real: small tmpfs mounts (root with CAP_SYS_ADMIN, as on this
project's machines; skipped elsewhere with the reason). A read-only run directory stops the run before Ray with one
line (exit 2); a checkpoint folder that fills up mid-run stops it cleanly (exit 4, one line naming the path and
"No space left on device", run_state.json saying why), leaves no partial checkpoint that looks complete, and the
same command resumes from the previous complete checkpoint once there is room."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _mount(path, size: str) -> None:
    os.makedirs(path, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {res.stderr.strip()}")


def _umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _main(root, *overrides):
    env = dict(os.environ, VERL_PLATFORM="cpu", VERL_DIFFUSION_RUN_ROOT=str(root))
    return subprocess.run([sys.executable, "-m", "verl_diffusion.main_flowgrpo", "--config-name", "tiny_cpu",
                           "trainer.test_freq=-1", "trainer.val_before_train=false", *overrides],
                          capture_output=True, text=True, env=env, timeout=900)


@pytest.fixture()
def mount_point(tmp_path):
    path = tmp_path / "mnt"
    yield path
    _umount(path)


def test_a_read_only_run_dir_is_one_line_and_exit_2_before_ray(mount_point, tmp_path):
    _mount(mount_point, "4m")
    subprocess.run(["mount", "-o", "remount,ro", str(mount_point)], check=True)
    res = _main(tmp_path, f"trainer.run_dir={mount_point}/run")
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 2, (res.stdout[-2000:], res.stderr[-2000:])
    assert len(err) == 1 and f"{mount_point}/run" in err[0] and "Read-only file system" in err[0], err
    assert "Ray" not in res.stdout + res.stderr


def test_disk_full_during_a_save_stops_cleanly_and_resumes_from_the_last_complete_checkpoint(mount_point, tmp_path):
    # one tiny-model checkpoint is about 1.3 MB: the first fits in 2 MB, the second does not
    _mount(mount_point, "2m")
    ckpt = mount_point / "ckpt"
    args = ["trainer.total_training_steps=3", "trainer.save_freq=1", f"trainer.default_local_dir={ckpt}",
            "trainer.export.enable=false"]
    res = _main(tmp_path, *args)
    assert res.returncode == 4, (res.stdout[-3000:], res.stderr[-3000:])
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("storage error: saving the checkpoint of step 2 failed: ") \
        and "No space left on device" in err[0], res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    run_dir = tmp_path / "tiny_cpu"
    state = json.loads((run_dir / "run_state.json").read_text())
    assert state["status"] == "stopped" and state["step"] == 2 and "No space left on device" in state["reason"]
    assert sorted(os.listdir(ckpt)) == ["global_step_1", "latest_checkpointed_iteration.txt"]
    # step 2's row is written after its save: the resume trains step 2 again from step 1's checkpoint
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == [1]

    subprocess.run(["mount", "-o", "remount,size=64m", str(mount_point)], check=True)   # space freed
    res = _main(tmp_path, *args)
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert f"resuming from {ckpt}/global_step_1" in res.stdout
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")] == [1, 2, 3]
