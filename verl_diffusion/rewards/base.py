"""Reward interface: batched scoring of decoded images with their prompts and per-row metadata.

A reward is a class with a ``name`` and ``score(images, prompts, metadata) -> RewardOutput``.
``images`` is a list of uint8 numpy arrays ``[H, W, 3]`` (RGB), one per sample, so that a batch can be
pickled to a process pool cheaply. Heavy state (OCR engine, CLIP model) is built lazily on first use, so
a reward object is cheap to construct and to send to a worker process.

A sample the reward cannot score is ``NaN`` in ``RewardOutput.scores``; ``MultiReward`` replaces it by the
configured penalty and counts it (``reward/failures/<name>``). Rewards never need to catch their own
exceptions: the caller does that too.
"""

from __future__ import annotations

import io
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

# name -> reward class. Filled by @register_reward in each reward module; read through verl_diffusion.rewards.
REWARDS: dict[str, type["Reward"]] = {}


def register_reward(name: str) -> Callable[[type["Reward"]], type["Reward"]]:
    """Class decorator: add a reward class to ``REWARDS`` under ``name`` (re-registering another class raises)."""

    def decorator(cls: type[Reward]) -> type[Reward]:
        if name in REWARDS and REWARDS[name] is not cls:
            raise ValueError(f"reward {name!r} is already registered as {REWARDS[name].__qualname__}; pick another name")
        cls.name = name
        REWARDS[name] = cls
        return cls

    return decorator


def get_reward_cls(name: str) -> type["Reward"]:
    """Look a reward class up by name; an unknown name raises one ValueError line listing the valid names."""
    if name not in REWARDS:
        raise ValueError(
            f"unknown reward {name!r}; valid names: {', '.join(sorted(REWARDS))}. "
            "Register more with @verl_diffusion.rewards.register_reward (docs/rewards.md)."
        )
    return REWARDS[name]


@dataclass
class RewardOutput:
    """What one reward returns for a batch of B samples.

    scores: [B] float64; NaN marks a sample the reward could not score.
    details: named per-sample values for logging, each [B] float64 (NaN = not applicable to that sample),
        e.g. GenEval's ``strict_accuracy`` or ``strict_accuracy/<tag>``.
    """

    scores: np.ndarray
    details: dict[str, np.ndarray] = field(default_factory=dict)
    # Why some samples are NaN (e.g. a failed server request); MultiReward logs each cause once.
    errors: list[str] = field(default_factory=list)
    # True when some samples are NaN because the step's time limit (``deadline``) ran out: failures of kind
    # "timeout" rather than "error".
    timed_out: bool = False


class Reward:
    """Base class. Subclasses set ``name`` (via @register_reward) and implement ``score``.

    Constructor keyword arguments are the reward's options (``build_reward(options={name: {...}})``);
    ``__init__`` must not load models: do that in ``setup()``, which runs once, in the process that scores.
    """

    name: str = "reward"
    # time.monotonic() by which this call must return (MultiReward sets it from ``reward.timeout``; None: no
    # limit). Rewards that wait on a server fit their per-request timeouts and retries inside it (time_left()).
    deadline: float | None = None

    def __init__(self, **options: Any):
        if options:
            raise ValueError(f"reward {self.name!r} takes no options, got {sorted(options)}")
        self._ready = False

    def setup(self) -> None:
        """Load heavy state (models, engines). Called once before the first ``score``."""

    def time_left(self) -> float | None:
        """Seconds until ``deadline`` (may be <= 0), or None when there is no limit."""
        return None if self.deadline is None else self.deadline - time.monotonic()

    def preflight(self, timeout: float) -> None:
        """Check, before the first step, that what this reward needs outside the process answers (a remote
        server); raise RuntimeError with one line naming it. Local rewards have nothing to check."""

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        raise NotImplementedError

    def ensure_ready(self) -> None:
        """Run ``setup()`` once (MultiReward calls it before fanning a batch out to threads)."""
        if not getattr(self, "_ready", False):
            self.setup()
            self._ready = True

    def __call__(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        self.ensure_ready()
        out = self.score(images, prompts, metadata)
        scores = np.asarray(out.scores, dtype=np.float64).reshape(-1)
        if scores.shape[0] != len(images):
            raise ValueError(f"reward {self.name!r} returned {scores.shape[0]} scores for {len(images)} images")
        out.scores = scores
        return out

    def __getstate__(self) -> dict:
        # Loaded models stay in their process; a pickled copy rebuilds them lazily where it runs.
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_m_")}
        state["_ready"] = False
        return state


def to_numpy_images(images: Any) -> list[np.ndarray]:
    """Convert a batch to a list of uint8 ``[H, W, 3]`` RGB arrays.

    Accepts a torch uint8 tensor ``[B, 3, H, W]`` (the rollout's ``images``), a float tensor in [0, 1] of
    that shape, a numpy array ``[B, H, W, 3]`` or ``[B, 3, H, W]``, or a sequence of PIL images / HWC arrays.
    """
    if hasattr(images, "detach") and hasattr(images, "cpu"):  # torch tensor, without importing torch here
        import torch

        t = images.detach().cpu()
        if t.is_floating_point():
            t = (t.clamp(0, 1) * 255).round()
        arr = t.to(torch.uint8).numpy()
        if arr.ndim != 4 or arr.shape[1] not in (1, 3):
            raise ValueError(f"images tensor must be [B, 3, H, W], got shape {tuple(arr.shape)}")
        arr = np.ascontiguousarray(arr.transpose(0, 2, 3, 1))
        if arr.shape[-1] == 1:
            arr = np.repeat(arr, 3, axis=-1)
        return list(arr)
    if isinstance(images, np.ndarray):
        if images.ndim != 4:
            raise ValueError(f"images array must be [B, H, W, 3] or [B, 3, H, W], got shape {images.shape}")
        if images.shape[-1] != 3 and images.shape[1] == 3:
            images = images.transpose(0, 2, 3, 1)
        images = list(images)
    out = []
    for i, im in enumerate(images):
        if hasattr(im, "convert"):  # PIL image
            out.append(np.asarray(im.convert("RGB"), dtype=np.uint8))
            continue
        a = np.asarray(im)
        if a.dtype != np.uint8:
            if np.issubdtype(a.dtype, np.floating):
                a = (np.clip(a, 0, 1) * 255).round()
            a = a.astype(np.uint8)
        if a.ndim != 3 or a.shape[-1] != 3:
            raise ValueError(f"image {i} must be [H, W, 3] RGB, got shape {a.shape}")
        out.append(a)
    return out


def encode_jpeg(image: np.ndarray, quality: int = 95) -> bytes:
    """JPEG bytes of one uint8 ``[H, W, 3]`` image (PIL encoder)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def row_ground_truth(meta: Mapping[str, Any] | None) -> Any:
    """``metadata['reward_model']['ground_truth']`` if present, else None (rows from data_process/ carry it)."""
    if not meta:
        return None
    rm = meta.get("reward_model")
    if isinstance(rm, Mapping):
        return rm.get("ground_truth")
    return None


def check_lengths(images: Sequence, prompts: Sequence, metadata: Sequence) -> None:
    if not (len(images) == len(prompts) == len(metadata)):
        raise ValueError(
            f"images, prompts and metadata must have the same length; got {len(images)}, {len(prompts)}, "
            f"{len(metadata)}"
        )


def probe_http(url: str, timeout: float) -> None:
    """GET ``url`` and accept any HTTP answer (a 404 or 405 still proves a live server); raise RuntimeError
    with one line naming the URL when nothing answers within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="GET"), timeout=timeout):
            return
    except urllib.error.HTTPError:
        return
    except (TimeoutError, OSError, ValueError) as e:  # URLError is an OSError; ValueError: a malformed URL
        reason = getattr(e, "reason", None) or e
        if isinstance(reason, TimeoutError) or "timed out" in str(reason):
            reason = f"no answer within {timeout:g} s"
        raise RuntimeError(f"{url} does not answer ({reason})") from None
