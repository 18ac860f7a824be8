"""MultiReward: weighted sum, components, failure accounting (exception, NaN, timeout), executors, registry."""

import time

import numpy as np
import pytest
import torch
from PIL import Image

from verl_diffusion.rewards import REWARDS, Reward, RewardOutput, build_reward, register_reward


@register_reward("_test_const")
class _Const(Reward):
    def __init__(self, value=1.0, nan_at=(), raise_msg=None, sleep=0.0):
        self.value, self.nan_at, self.raise_msg, self.sleep = value, tuple(nan_at), raise_msg, sleep
        self._ready = False

    def score(self, images, prompts, metadata):
        if self.raise_msg:
            raise RuntimeError(self.raise_msg)
        time.sleep(self.sleep)
        s = np.array([self.value + float(m.get("i", 0)) for m in metadata])
        for i, m in enumerate(metadata):
            if m.get("i") in self.nan_at:
                s[i] = np.nan
        return RewardOutput(s, {"double": 2 * s})


def _batch(n=4):
    imgs = torch.full((n, 3, 8, 8), 128, dtype=torch.uint8)  # flat grey: JPEG reference, scores 0
    return imgs, [f"p{i}" for i in range(n)], [{"i": i} for i in range(n)]


def test_registry_names_and_unknown_name_message():
    assert {"ocr", "pickscore", "jpeg_compressibility", "jpeg_incompressibility", "aesthetic", "geneval"} <= set(REWARDS)
    with pytest.raises(ValueError) as e:
        build_reward({"ocrr": 1.0})
    msg = str(e.value)
    assert "\n" not in msg and "'ocrr'" in msg and "jpeg_compressibility" in msg and "geneval" in msg


def test_bad_options_fail_at_build_time():
    with pytest.raises(ValueError, match="bad options for reward 'jpeg_compressibility'"):
        build_reward({"jpeg_compressibility": 1.0}, options={"jpeg_compressibility": {"qualty": 90}})
    with pytest.raises(ValueError, match="not in components"):
        build_reward({"jpeg_compressibility": 1.0}, options={"ocr": {}})
    with pytest.raises(ValueError, match="executor"):
        build_reward({"jpeg_compressibility": 1.0}, executor="gpu")


def test_weighted_sum_components_details_and_metrics():
    r = build_reward({"_test_const": 0.5, "jpeg_compressibility": 2.0}, options={"_test_const": {"value": 1.0}})
    res = r(*_batch())
    torch.testing.assert_close(res.components["_test_const"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    torch.testing.assert_close(res.components["jpeg_compressibility"], torch.zeros(4))  # flat images
    torch.testing.assert_close(res.scores, 0.5 * res.components["_test_const"])
    torch.testing.assert_close(res.details["_test_const/double"], torch.tensor([2.0, 4.0, 6.0, 8.0]))
    assert res.metrics["reward/_test_const/mean"] == 2.5 and res.metrics["reward/_test_const/double"] == 5.0
    assert res.metrics["reward/failures/_test_const"] == 0.0 and res.metrics["reward/score/mean"] == 1.25
    assert res.scores.dtype == torch.float32


def test_nan_and_exception_become_penalty_counted_logged_once(caplog):
    r = build_reward({"_test_const": 1.0}, options={"_test_const": {"value": 0.0, "nan_at": (1, 3)}}, penalty=-5.0)
    with caplog.at_level("WARNING"):
        res = r(*_batch())
        r(*_batch())
    assert res.scores.tolist() == [0.0, -5.0, 2.0, -5.0] and res.failures == {"_test_const": 2}
    assert r.failure_totals == {"_test_const": 4}
    assert len([rec for rec in caplog.records if "_test_const" in rec.getMessage()]) == 1

    boom = build_reward({"_test_const": 1.0, "jpeg_compressibility": 1.0},
                        options={"_test_const": {"raise_msg": "model exploded"}}, penalty={"_test_const": -1.0})
    with caplog.at_level("WARNING"):
        res = boom(*_batch())
    assert res.failures == {"_test_const": 4, "jpeg_compressibility": 0}
    assert res.components["_test_const"].tolist() == [-1.0] * 4
    assert any("RuntimeError: model exploded" in rec.getMessage() for rec in caplog.records)


@pytest.mark.parametrize("executor", ["thread", "process"])
def test_pool_executors_match_sync(executor):
    rng = np.random.default_rng(0)
    images = [Image.fromarray((rng.random((32, 32, 3)) * a).astype(np.uint8)) for a in (0, 20, 80, 160, 255)]
    sync = build_reward({"jpeg_incompressibility": 1.0})(images, [""] * 5, [{}] * 5)
    with build_reward({"jpeg_incompressibility": 1.0}, executor=executor, max_workers=2) as pooled:
        res = pooled(images, [""] * 5, [{}] * 5)
    torch.testing.assert_close(res.scores, sync.scores, rtol=0, atol=0)


def test_timeout_becomes_penalty():
    r = build_reward({"_test_const": 1.0}, options={"_test_const": {"sleep": 1.0}}, executor="thread",
                     max_workers=2, timeout=0.2, penalty=-3.0)
    t = time.monotonic()
    res = r(*_batch(2))
    assert time.monotonic() - t < 0.9
    assert res.scores.tolist() == [-3.0, -3.0] and res.failures == {"_test_const": 2}
    r.close()
