"""Project-wide invariants: the algos import boundary, test naming, and the plugin in a fresh process."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_algos_imports_torch_only():
    mods = sorted(p.stem for p in (ROOT / "verl_diffusion" / "algos").glob("*.py") if p.stem != "__init__")
    code = (
        "import sys\n"
        + "".join(f"import verl_diffusion.algos.{m}\n" for m in mods)
        + "print(','.join(sorted({n.split('.')[0] for n in sys.modules})))"
    )
    res = _run(code)
    assert res.returncode == 0, res.stderr
    roots = set(res.stdout.strip().split(","))
    forbidden = {"verl", "ray", "diffusers", "omegaconf", "transformers", "hydra", "peft"} & roots
    assert not forbidden, f"verl_diffusion.algos imports {forbidden}"


def test_every_test_file_says_where_it_runs():
    bad = [str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
           if not (p.stem.endswith("_on_cpu") or p.stem.endswith("_gpu"))]
    assert not bad, f"test files must end in _on_cpu.py or _gpu.py: {bad}"


def test_plain_import_verl_registers_everything(fresh_import_verl):
    """Nothing imported by hand, a fresh process (tests/sanity/conftest.py: `import verl`, then every estimator and
    loss through verl's getters, and verl's V1 trainer registry holding diffusion_sync / diffusion_async)."""
    res = fresh_import_verl
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]


def test_check_command_lists_registrations(check_command):
    res = check_command
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    for line in ("platform:cpu", "adv_estimator:flow_grpo", "policy_loss:flow_dppo", "policy_loss:path_space",
                 "trainer:diffusion_sync", "trainer:diffusion_async"):
        assert line in res.stdout
