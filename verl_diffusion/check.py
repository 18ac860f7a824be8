"""``python -m verl_diffusion.check``: load the plugin loudly and list what it registered into verl.

verl imports ``verl.plugins`` entry points inside a try/except that logs failures at DEBUG level, so a
broken install shows up much later (e.g. "Unknown platform 'cpu'"). This command imports the plugin the
same way, prints every registration and exits 1 with the import error if anything fails.
"""

from __future__ import annotations

import sys
import traceback


def main(argv: list[str] | None = None) -> int:
    try:  # as main_flowgrpo does: on a CPU host choose the cpu platform before verl is imported (no fallback lines)
        from verl_diffusion.launch import select_platform

        select_platform()
    except RuntimeError as e:  # a GPU host whose driver torch cannot use: check the plugin anyway, say why
        print(f"verl_diffusion: {e}", file=sys.stderr)
    try:
        from importlib.metadata import entry_points

        eps = [ep for ep in entry_points(group="verl.plugins") if ep.value.startswith("verl_diffusion")]
        if not eps:
            print("verl_diffusion: no 'verl.plugins' entry point found; reinstall the package (pip install -e .)")
            return 1
        for ep in eps:
            ep.load()
        from verl_diffusion.registry import registered
        from verl.trainer.ppo.core_algos import get_adv_estimator_fn, get_policy_loss_fn

        lines = registered()
        for line in lines:
            kind, name = line.split(":", 1)
            if kind == "adv_estimator":
                get_adv_estimator_fn(name)
            elif kind == "policy_loss":
                get_policy_loss_fn(name)
    except Exception:  # noqa: BLE001 - the whole point is to show any failure loudly
        traceback.print_exc()
        print("verl_diffusion: plugin failed to load (see the traceback above)", file=sys.stderr)
        return 1
    print(f"verl_diffusion: plugin loaded from entry point {eps[0].value!r}; {len(lines)} registrations:")
    for line in lines:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
