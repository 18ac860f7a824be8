"""Multi-reward: weighted sum of named rewards with per-component logging and failure accounting.

``build_reward({"ocr": 1.0, "pickscore": 0.5}, options={"pickscore": {"model_path": ...}})`` returns a
``MultiReward``; calling it on a batch returns a ``RewardResult``:

    scores      [B] float32   sum_k weight_k * component_k   (the trainer's ``sample_level_rewards``)
    components  {name: [B]}   each reward's score after penalty (GDPO aggregates these separately)
    details     {name/detail: [B]}  extra per-sample values for logging (NaN = not applicable)
    failures    {name: int}   samples of this call that got the penalty
    metrics     reward/<name>/{mean,std,min,max}, reward/<name>/<detail>, reward/failures/<name>,
                reward/score/{mean,std}

Failure never raises: an exception, a timeout or a non-finite score becomes ``penalty`` for the samples
concerned, is counted in ``reward/failures/<name>`` and is logged once per (reward, kind of cause).

Time limit: ``timeout`` (``reward.timeout``) bounds the seconds one call (one step's rewards) may take, in
every executor; what is unscored when it runs out gets the penalty, counts as a failure of kind ``timeout`` and
is reported by a warning line on every call that hits it. Remote rewards read ``Reward.deadline`` and fit their
per-request timeouts and retries inside it. With a limit, ``sync`` scores in a helper thread it can stop
waiting for.

Executors: ``sync`` scores in the calling thread; ``thread`` and ``process`` split each reward's batch
into up to ``max_workers`` chunks and score them concurrently (threads share loaded models; each process
loads its own once, so use ``process`` for CPU-bound Python rewards such as OCR).
"""

from __future__ import annotations

import concurrent.futures as cf
import inspect
from concurrent.futures.process import BrokenProcessPool
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from verl_diffusion.rewards.base import Reward, RewardOutput, check_lengths, get_reward_cls, to_numpy_images

logger = logging.getLogger(__name__)

EXECUTORS = ("sync", "thread", "process")


@dataclass
class RewardResult:
    scores: torch.Tensor  # [B] float32, weighted sum
    components: dict[str, torch.Tensor]  # name -> [B] float32, after penalty
    failures: dict[str, int]  # name -> failed samples in this call
    metrics: dict[str, float]
    details: dict[str, torch.Tensor] = field(default_factory=dict)  # "name/detail" -> [B] float32
    causes: dict[str, str] = field(default_factory=dict)  # name -> first cause of this call's failures


# -- process-pool worker side ------------------------------------------------------------------------
_WORKER_REWARDS: dict[str, Reward] = {}


def _worker_init(rewards: dict[str, Reward], threads: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    _WORKER_REWARDS.clear()
    _WORKER_REWARDS.update(rewards)


def _worker_score(name: str, deadline: float | None, images: list[np.ndarray], prompts: list[str],
                  metadata: list[dict]) -> RewardOutput:
    reward = _WORKER_REWARDS[name]
    reward.deadline = deadline  # time.monotonic() is one clock for every process of the host
    return reward(images, prompts, metadata)


def _call_before(deadline: float, reward: Reward, *args: Any) -> RewardOutput:
    """``reward(*args)`` in a helper thread, waiting at most until ``deadline``: the sync executor's bound.
    A call still running then raises TimeoutError here and is left to finish in its (daemon) thread; its
    result is dropped."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no time left")
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["out"] = reward(*args)
        except BaseException as e:  # handed to the caller below
            box["err"] = e

    worker = threading.Thread(target=target, name=f"reward-{reward.name}", daemon=True)
    worker.start()
    worker.join(left)
    if worker.is_alive():
        raise TimeoutError("still running")
    if "err" in box:
        raise box["err"]
    return box["out"]


def _plain(x: Any) -> Any:
    """OmegaConf containers -> plain dict / list, so options pickle to worker processes."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or type(x).__name__ == "ListConfig":
        return [_plain(v) for v in x]
    return x


class MultiReward:
    """A weighted set of rewards behind one batched call. Build it with ``build_reward``."""

    def __init__(
        self,
        rewards: Mapping[str, Reward],
        weights: Mapping[str, float],
        *,
        penalty: float | Mapping[str, float] = 0.0,
        executor: str = "sync",
        max_workers: int | None = None,
        timeout: float | None = None,
    ):
        if executor not in EXECUTORS:
            raise ValueError(f"reward executor={executor!r} is unknown; choose one of {list(EXECUTORS)}")
        self.rewards = dict(rewards)
        self.weights = {k: float(weights[k]) for k in self.rewards}
        if isinstance(penalty, Mapping):
            unknown = set(penalty) - set(self.rewards)
            if unknown:
                raise ValueError(f"penalty given for unknown components {sorted(unknown)}; components: {sorted(self.rewards)}")
            self.penalty = {k: float(penalty.get(k, 0.0)) for k in self.rewards}
        else:
            self.penalty = {k: float(penalty) for k in self.rewards}
        self.executor = executor
        self.max_workers = int(max_workers or min(4, os.cpu_count() or 1))
        if timeout is not None and not (isinstance(timeout, (int, float)) and math.isfinite(timeout) and timeout > 0):
            raise ValueError(f"reward timeout={timeout!r} must be a positive number of seconds per step, or null "
                             "for no limit")
        self.timeout = timeout
        self.failure_totals = {k: 0 for k in self.rewards}
        self._logged: set[tuple[str, str]] = set()
        self._pool: cf.Executor | None = None

    @property
    def names(self) -> list[str]:
        return list(self.rewards)

    # -- pools -----------------------------------------------------------------------------------------
    def _get_pool(self) -> cf.Executor | None:
        if self.executor == "sync":
            return None
        if self._pool is None:
            if self.executor == "thread":
                self._pool = cf.ThreadPoolExecutor(self.max_workers, thread_name_prefix="reward")
            else:
                threads = max(1, (os.cpu_count() or 1) // self.max_workers)
                self._pool = cf.ProcessPoolExecutor(
                    self.max_workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_worker_init,
                    initargs=(self.rewards, threads),
                )
        return self._pool

    def close(self) -> None:
        """Shut the worker pool down (a later call starts a new one)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def __enter__(self) -> MultiReward:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- scoring ---------------------------------------------------------------------------------------
    def _log_once(self, name: str, kind: str, cause: str, n: int) -> None:
        if (name, kind) in self._logged:
            return
        self._logged.add((name, kind))
        logger.warning(
            "reward %r failed on %d sample(s) (%s): %s. They get penalty %s; the trainer's progress line reports "
            "every step's failures (reward/%s/failures) and warns when a fault starts or stops.",
            name, n, kind, cause, self.penalty[name], name,
        )

    def __call__(self, images: Any, prompts: list[str], metadata: list[dict] | None = None) -> RewardResult:
        """Score a batch. images: uint8 tensor [B, 3, H, W] or list of PIL images; prompts: [B] str;
        metadata: [B] row dicts (``reward_model``, ``extra_info``, ...)."""
        imgs = to_numpy_images(images)
        prompts = [str(p) for p in prompts]
        metadata = [dict(m) if isinstance(m, Mapping) else {} for m in (metadata or [{}] * len(imgs))]
        check_lengths(imgs, prompts, metadata)
        n = len(imgs)
        pool = self._get_pool()
        # reward.timeout bounds the whole call (one step's rewards), in every executor. Remote rewards read the
        # deadline and fit their per-request timeouts and retries inside it.
        deadline = None if self.timeout is None else time.monotonic() + float(self.timeout)
        for reward in self.rewards.values():
            reward.deadline = deadline

        # Submit every chunk of every reward first so they overlap, then collect. A job is None (score
        # inline, sync), an exception raised while preparing, or a Future.
        pending: dict[str, list[tuple[slice, Any]]] = {}
        for name, reward in self.rewards.items():
            if pool is None or n == 0:
                pending[name] = [(slice(0, n), None)]
                continue
            if self.executor == "thread":
                try:
                    reward.ensure_ready()  # load once, before the threads use it
                except Exception as e:
                    pending[name] = [(slice(0, n), e)]
                    continue
            size = math.ceil(n / min(self.max_workers, n))
            pending[name] = []
            for sl in (slice(s, min(s + size, n)) for s in range(0, n, size)):
                args = (imgs[sl], prompts[sl], metadata[sl])
                if self.executor == "thread":
                    fut = pool.submit(reward, *args)
                else:
                    fut = pool.submit(_worker_score, name, deadline, *args)
                pending[name].append((sl, fut))

        components, details, failures, metrics, first_causes = {}, {}, {}, {}, {}
        timed_out: dict[str, int] = {}
        for name, reward in self.rewards.items():
            values = np.full(n, np.nan)
            dets: dict[str, np.ndarray] = {}
            causes: list[tuple[str, str]] = []
            for sl, job in pending[name]:
                try:
                    if job is None and deadline is not None:
                        out = _call_before(deadline, reward, imgs[sl], prompts[sl], metadata[sl])
                    elif job is None:
                        out = reward(imgs[sl], prompts[sl], metadata[sl])
                    elif isinstance(job, BaseException):
                        raise job
                    else:
                        left = None if deadline is None else max(0.0, deadline - time.monotonic())
                        out = job.result(timeout=left)
                    values[sl] = out.scores
                    for k, v in out.details.items():
                        dets.setdefault(k, np.full(n, np.nan))[sl] = np.asarray(v, dtype=np.float64)
                    kind = "timeout" if out.timed_out else "error"
                    causes += [(kind, e) for e in out.errors]
                    if out.timed_out:
                        timed_out[name] = timed_out.get(name, 0) + int((~np.isfinite(values[sl])).sum())
                except (cf.TimeoutError, TimeoutError):
                    causes.append(("timeout", f"no result within reward.timeout={self.timeout}s"))
                    timed_out[name] = timed_out.get(name, 0) + (sl.stop - sl.start)
                except Exception as e:  # never let a reward kill training
                    if isinstance(e, BrokenProcessPool):
                        self._pool = None  # a worker died; the next call starts a fresh pool
                    causes.append((type(e).__name__, f"{type(e).__name__}: {e}"))
            bad = ~np.isfinite(values)
            nbad = int(bad.sum())
            if nbad:
                kind, cause = causes[0] if causes else ("non-finite", "the reward returned NaN or inf")
                self._log_once(name, kind, cause, nbad)
                first_causes[name] = str(cause)
            values[bad] = self.penalty[name]
            self.failure_totals[name] += nbad
            failures[name] = nbad
            components[name] = torch.tensor(values, dtype=torch.float32)
            metrics[f"reward/failures/{name}"] = float(nbad)
            if n:
                metrics[f"reward/{name}/mean"] = float(values.mean())
                metrics[f"reward/{name}/std"] = float(values.std())
                metrics[f"reward/{name}/min"] = float(values.min())
                metrics[f"reward/{name}/max"] = float(values.max())
            for k, v in dets.items():
                details[f"{name}/{k}"] = torch.tensor(v, dtype=torch.float32)
                if np.isfinite(v).any():
                    metrics[f"reward/{name}/{k}"] = float(np.nanmean(v))

        if timed_out:
            logger.warning(
                "reward time limit hit: reward.timeout=%ss per step ran out with %s unscored; those samples get the "
                "penalty and count as failures of kind timeout (raise reward.timeout, or fix the slow reward)",
                self.timeout, ", ".join(f"{k}: {v} sample(s)" for k, v in timed_out.items()))
        scores = torch.zeros(n, dtype=torch.float32)
        for name, comp in components.items():
            scores += self.weights[name] * comp
        if n:
            metrics["reward/score/mean"] = float(scores.mean())
            metrics["reward/score/std"] = float(scores.std(unbiased=False))
        return RewardResult(scores=scores, components=components, failures=failures, metrics=metrics, details=details,
                            causes=first_causes)


def build_reward(
    components: Mapping[str, float],
    *,
    options: Mapping[str, Mapping] | None = None,
    penalty: float | Mapping[str, float] = 0.0,
    executor: str = "sync",
    max_workers: int | None = None,
    timeout: float | None = None,
) -> MultiReward:
    """Build a MultiReward from ``{name: weight}``; ``options[name]`` are that reward's keyword options.

    Unknown reward names, options for a reward not in ``components`` and bad option names raise ValueError
    here, before training starts.
    """
    components = _plain(components)
    options = _plain(options or {})
    if not components:
        raise ValueError("build_reward needs at least one component, e.g. {'ocr': 1.0}")
    extra = set(options) - set(components)
    if extra:
        raise ValueError(f"options given for rewards not in components: {sorted(extra)}; components: {sorted(components)}")
    rewards, weights = {}, {}
    for name, weight in components.items():
        cls = get_reward_cls(name)
        w = float(weight)
        if not math.isfinite(w):
            raise ValueError(f"reward weight for {name!r} must be finite, got {weight!r}")
        try:
            rewards[name] = cls(**dict(options.get(name) or {}))
        except TypeError as e:
            params = inspect.signature(cls.__init__).parameters.values()
            valid = [p.name for p in params if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
            raise ValueError(f"bad options for reward {name!r}: {e}; valid options: "
                             f"{', '.join(valid) if valid else '(none)'} (docs/rewards.md)") from e
        weights[name] = w
    return MultiReward(
        rewards, weights, penalty=_plain(penalty), executor=executor, max_workers=max_workers, timeout=timeout
    )
