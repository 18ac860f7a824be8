"""GenEval reward: a client for the object-detection reward server (protocol in ``_protocol.py``).

Each row's GenEval metadata (``tag``, ``include`` / ``exclude`` requirements, ``prompt``) comes from
``reward_model.ground_truth`` (a JSON string or a dict, as data_process/geneval.py writes it). Images go
as JPEG bytes, ``batch_size`` per request.

The training score is the server's partial credit (``scores``). The per-sample ``accuracy``
(``rewards``), ``strict_accuracy`` (``strict_rewards``) and ``strict_accuracy/<tag>`` are returned as
details, so validation logs ``reward/geneval/strict_accuracy/<tag>``.

Failure handling: a request that times out, gets a 5xx or loses its connection is retried
``max_retries`` times with exponential backoff (``backoff`` · 2^attempt, at most ``max_backoff`` s); a 4xx
is not retried. Requests and retries stay inside the step's reward time (``reward.timeout``, read from
``deadline``): when it runs out the remaining samples are NaN with ``timed_out`` set. A batch that still fails gives NaN for its samples (MultiReward applies the penalty and
counts them, logging the cause from ``RewardOutput.errors``) and the other batches keep their scores.
Per-tag strict accuracy is grouped by each row's own ``tag``.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

import numpy as np

from verl_diffusion.rewards._protocol import dumps, safe_loads
from verl_diffusion.rewards.base import (
    Reward,
    RewardOutput,
    encode_jpeg,
    probe_http,
    register_reward,
    row_ground_truth,
)

logger = logging.getLogger(__name__)


class GenEvalServerError(RuntimeError):
    """The server did not answer usefully after all retries (``timed_out``: the step's time limit ran out)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


def geneval_metadata(meta: Mapping[str, Any] | None) -> dict | None:
    """The GenEval requirement dict of one row, or None. Accepts the row's metadata (``reward_model``
    with ``ground_truth`` as JSON text or dict) or a bare GenEval dict (has ``include``)."""
    if not meta:
        return None
    if "include" in meta and "tag" in meta:
        return dict(meta)
    gt = row_ground_truth(meta)
    if isinstance(gt, str):
        try:
            gt = json.loads(gt)
        except json.JSONDecodeError:
            return None
    return dict(gt) if isinstance(gt, Mapping) and "include" in gt else None


@register_reward("geneval")
class GenEvalReward(Reward):
    """Options: ``url`` (http://127.0.0.1:18085), ``batch_size`` (64), ``timeout`` (120 s per request),
    ``max_retries`` (3), ``backoff`` (1 s), ``max_backoff`` (30 s), ``jpeg_quality`` (75: PIL's default,
    as Flow-GRPO sends), ``only_strict`` (False), ``score_key`` (scores | rewards | strict_rewards)."""

    def __init__(
        self,
        url: str = "http://127.0.0.1:18085",
        batch_size: int = 64,
        timeout: float = 120.0,
        max_retries: int = 3,
        backoff: float = 1.0,
        max_backoff: float = 30.0,
        jpeg_quality: int = 75,
        only_strict: bool = False,
        score_key: str = "scores",
    ):
        if score_key not in ("scores", "rewards", "strict_rewards"):
            raise ValueError(f"geneval: score_key={score_key!r}; choose scores | rewards | strict_rewards")
        self.url, self.batch_size, self.timeout = url, int(batch_size), float(timeout)
        self.max_retries, self.backoff, self.max_backoff = int(max_retries), float(backoff), float(max_backoff)
        self.jpeg_quality, self.only_strict, self.score_key = int(jpeg_quality), bool(only_strict), score_key
        self.last_errors: list[str] = []
        self._ready = False

    # -- transport -------------------------------------------------------------------------------------
    def post(self, payload: dict) -> dict:
        """One request with retries; returns the validated reply dict or raises GenEvalServerError."""
        body = dumps(payload)
        n = len(payload["images"])
        last = "no attempt"
        attempt = 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                pause = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
                left = self.time_left()
                time.sleep(pause if left is None else max(0.0, min(pause, left)))
            # Each attempt fits in what is left of the step's reward time (reward.timeout), retries included.
            left = self.time_left()
            if left is not None and left <= 0:
                raise GenEvalServerError(f"reward.timeout ran out talking to {self.url} ({last}; {attempt} "
                                         "attempt(s) made)", timed_out=True)
            req = urllib.request.Request(
                self.url, data=body, method="POST", headers={"Content-Type": "application/octet-stream"}
            )
            try:
                wait = self.timeout if left is None else min(self.timeout, left)
                with urllib.request.urlopen(req, timeout=wait) as resp:
                    reply = safe_loads(resp.read())
                return self._check_reply(reply, n)
            except urllib.error.HTTPError as e:
                text = e.read()[:300].decode("utf-8", "replace").strip().splitlines()
                last = f"HTTP {e.code} from {self.url}: {text[-1] if text else e.reason}"
                if 400 <= e.code < 500:
                    break  # the request itself is wrong; retrying cannot help
            except (TimeoutError, OSError, urllib.error.URLError, ConnectionError) as e:
                last = f"{type(e).__name__} talking to {self.url}: {e}"
            except ValueError as e:  # malformed reply
                last = f"bad reply from {self.url}: {e}"
            except Exception as e:  # unpickling errors and anything unexpected
                last = f"{type(e).__name__} from {self.url}: {e}"
            logger.debug("geneval attempt %d/%d failed: %s", attempt + 1, self.max_retries + 1, last)
        left = self.time_left()
        raise GenEvalServerError(f"{last} (after {attempt + 1} attempts)", timed_out=left is not None and left <= 0)

    @staticmethod
    def _check_reply(reply: Any, n: int) -> dict:
        if not isinstance(reply, dict):
            raise ValueError(f"expected a dict, got {type(reply).__name__}")
        for key in ("scores", "rewards", "strict_rewards"):
            if key not in reply or len(reply[key]) != n:
                raise ValueError(f"key {key!r} missing or not of length {n} (keys: {sorted(reply)})")
        return reply

    # -- scoring ---------------------------------------------------------------------------------------
    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        n = len(images)
        metas = [geneval_metadata(m) for m in metadata]
        errors: list[str] = []  # local: threads may score chunks of one batch concurrently
        timed_out = False
        out = {k: np.full(n, np.nan) for k in ("scores", "rewards", "strict_rewards")}
        per_tag: dict[str, np.ndarray] = {}
        valid = [i for i in range(n) if metas[i] is not None]
        if len(valid) < n:
            errors.append(
                f"{n - len(valid)} row(s) carry no GenEval metadata (reward_model.ground_truth must be the "
                "tag/include/exclude JSON that data_process/geneval.py writes)"
            )
        for s in range(0, len(valid), self.batch_size):
            idx = valid[s : s + self.batch_size]
            payload = {
                "images": [encode_jpeg(images[i], self.jpeg_quality) for i in idx],
                "meta_datas": [metas[i] for i in idx],
                "only_strict": self.only_strict,
            }
            try:
                reply = self.post(payload)
            except GenEvalServerError as e:
                errors.append(str(e))
                timed_out = timed_out or e.timed_out
                continue
            for key in out:
                out[key][idx] = np.asarray(reply[key], dtype=np.float64)
            for i, strict in zip(idx, out["strict_rewards"][idx]):
                tag = str(metas[i].get("tag", "unknown"))
                per_tag.setdefault(tag, np.full(n, np.nan))[i] = strict
        details = {"accuracy": out["rewards"], "strict_accuracy": out["strict_rewards"]}
        details.update({f"strict_accuracy/{tag}": v for tag, v in per_tag.items()})
        self.last_errors = errors
        return RewardOutput(out[self.score_key], details, errors=errors, timed_out=timed_out)

    def preflight(self, timeout: float) -> None:
        """Any HTTP answer from ``url`` (the protocol's POST endpoint answers a GET with 4xx/5xx) within
        ``timeout`` seconds; raises RuntimeError naming the URL otherwise."""
        probe_http(self.url, timeout)
