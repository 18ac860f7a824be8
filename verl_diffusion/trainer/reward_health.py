"""Per-step reward-failure accounting for the driver (rewards: docs/rewards.md).

A failed reward never raises: its samples get the penalty and are counted (``RewardResult.failures``). This
module turns the counts into what a user watching a long run needs:

* per step and per reward: ``reward/<name>/failures`` (samples) and ``reward/<name>/failure_fraction``, and a
  progress-line part ``failed <name> 32/32`` on every step with failures;
* a warning line when a reward's fault starts (first failing step after a healthy one, with the cause) and
  when it stops (first healthy step, with how long it lasted);
* a budget: ``max_consecutive_steps`` steps in a row whose failure fraction exceeds ``max_fraction`` for some
  reward stop the run (the trainer saves a checkpoint, flushes the metrics and exits non-zero).

Pure Python; the trainer calls :meth:`RewardHealth.update` once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Optional

from verl_diffusion.config.schema import RewardFailureBudget  # noqa: F401  (trainer.reward_failure_budget)

REWARD_FAILURE_EXIT = 3


class RewardBudgetExceeded(RuntimeError):
    """The reward-failure budget ran out; the message is the one line to print."""


@dataclass
class _State:
    failing_since: Optional[int] = None     # first step of the current fault, None when healthy
    over_budget_steps: int = 0              # consecutive steps above max_fraction


@dataclass
class RewardHealth:
    """Failure state per reward over the steps of a run."""

    budget: RewardFailureBudget = field(default_factory=RewardFailureBudget)
    states: dict[str, _State] = field(default_factory=dict)
    steps: int = 0                          # steps accounted in this process (a resumed run counts from its resume)

    def update(self, step: int, failures: Mapping[str, int], num_samples: int,
               causes: Optional[Mapping[str, str]] = None) -> tuple[dict[str, float], list[str]]:
        """Account one step. Returns (metrics, warning lines for faults that started or stopped this step)."""
        metrics: dict[str, float] = {}
        events: list[str] = []
        causes = causes or {}
        self.steps += 1
        n = max(int(num_samples), 1)
        for name, count in failures.items():
            count = int(count)
            frac = count / n
            metrics[f"reward/{name}/failures"] = float(count)
            metrics[f"reward/{name}/failure_fraction"] = frac
            st = self.states.setdefault(name, _State())
            if count and st.failing_since is None:
                st.failing_since = step
                why = f": {causes[name]}" if causes.get(name) else ""
                events.append(f"reward {name!r} started failing at step {step}: {count}/{num_samples} samples got "
                              f"the penalty{why}")
            elif not count and st.failing_since is not None:
                events.append(f"reward {name!r} recovered at step {step} after failing since step "
                              f"{st.failing_since} ({step - st.failing_since} steps)")
                st.failing_since = None
            st.over_budget_steps = st.over_budget_steps + 1 if frac > self.budget.max_fraction else 0
        return metrics, events

    def exceeded(self) -> Optional[str]:
        """The one-line reason to stop when some reward used up the budget, else None."""
        limit = self.budget.max_consecutive_steps
        if not limit:
            return None
        for name, st in self.states.items():
            if st.over_budget_steps >= limit:
                return (f"reward {name!r} failed on more than {self.budget.max_fraction:.0%} of the samples for "
                        f"{st.over_budget_steps} consecutive steps (trainer.reward_failure_budget."
                        f"max_consecutive_steps={limit}); stopping")
        return None

    def failed_throughout(self) -> Optional[str]:
        """At the end of a run shorter than the budget's window: the reason to exit non-zero when some reward failed
        beyond ``max_fraction`` on every step it ran (the window never filled, so :meth:`exceeded` never fired)."""
        limit = self.budget.max_consecutive_steps
        if not limit or not self.steps:
            return None
        for name, st in self.states.items():
            if st.over_budget_steps >= self.steps:
                return (f"reward {name!r} failed on more than {self.budget.max_fraction:.0%} of the samples on every "
                        f"one of the {self.steps} steps of this run (shorter than trainer.reward_failure_budget."
                        f"max_consecutive_steps={limit}); nothing was learned from it")
        return None


class NoSignalMonitor:
    """Warns when most groups carry no learning signal: a group whose images all scored the same has advantage 0
    everywhere (``reward/zero_std_ratio``, the share of such groups). One warning when the share stayed at or above
    ``share`` for ``steps`` steps in a row, one more when it recovers."""

    def __init__(self, share: float = 0.8, steps: int = 3):
        self.share, self.steps = float(share), int(steps)
        self.run, self.warned, self.first = 0, False, None

    def update(self, step: int, metrics: Mapping[str, float]) -> Optional[str]:
        ratio = metrics.get("reward/zero_std_ratio")
        if ratio is None:
            return None
        if float(ratio) >= self.share:
            self.first = step if self.run == 0 else self.first
            self.run += 1
            if self.run >= self.steps and not self.warned:
                self.warned = True
                return (f"{float(ratio):.0%} of the groups had equal rewards (no advantage, nothing to learn) on each "
                        f"of steps {self.first}-{step}: the reward cannot tell this model's images apart; check the "
                        "reward and its metadata, or use more images per prompt (rollout.n) / more noise")
            return None
        line = None
        if self.warned:
            line = f"learning signal back at step {step}: {float(ratio):.0%} of the groups had equal rewards"
        self.run, self.warned = 0, False
        return line


def failure_summary(metrics: Mapping[str, float]) -> str:
    """Progress-line part for the rewards that failed this step, e.g. ``failed geneval 32/32``; '' if none."""
    parts = []
    for key, value in metrics.items():
        if key.startswith("reward/") and key.endswith("/failures") and value:
            name = key[len("reward/"):-len("/failures")]
            frac = metrics.get(f"reward/{name}/failure_fraction")
            total = f"/{round(value / frac)}" if frac else ""
            parts.append(f"{name} {int(value)}{total}")
    return ("failed " + ", ".join(parts)) if parts else ""
