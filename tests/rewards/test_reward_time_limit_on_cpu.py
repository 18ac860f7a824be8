"""reward.timeout bounds the time one step spends on rewards, in every executor (issue 12 item 3), and remote
rewards are checked before the first step (item 4's pre-flight): a loopback server that accepts connections and
never answers, a closed port, and a live protocol server."""

import json
import logging
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from verl_diffusion.rewards import Reward, RewardOutput, build_reward, register_reward
from verl_diffusion.rewards.geneval_server import ColorBlobScorer, serve

META = {"tag": "single_object", "include": [{"class": "apple", "count": 1}], "prompt": "a photo of an apple"}


@pytest.fixture(scope="module")
def silent_server():
    """Accepts every connection, reads nothing and never answers until the module's tests are done."""
    release = threading.Event()

    class Silent(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            release.wait()

        do_GET = do_POST

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Silent)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    release.set()
    srv.shutdown()
    srv.server_close()


def _closed_port_url():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


def _batch(n):
    imgs = torch.full((n, 3, 16, 16), 200, dtype=torch.uint8)
    rows = [{"reward_model": {"ground_truth": json.dumps(META)}}] * n
    return imgs, [META["prompt"]] * n, rows


@pytest.mark.parametrize("executor", ["sync", "thread", "process"])
def test_step_time_limit_bounds_a_silent_server(silent_server, executor, caplog):
    # The client's own defaults: 120 s per request x 4 attempts, i.e. ~8 minutes without the step's limit.
    limit = 2.0 if executor != "process" else 6.0  # a spawned process imports torch first
    r = build_reward({"geneval": 1.0}, options={"geneval": {"url": silent_server, "batch_size": 2}},
                     executor=executor, max_workers=2, timeout=limit, penalty=-1.0)
    assert r.rewards["geneval"].timeout == 120.0 and r.rewards["geneval"].max_retries == 3
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="verl_diffusion.rewards.multi"):
        res = r(*_batch(4))
    wall = time.monotonic() - t0
    r.close()
    assert limit <= wall < limit + 1.5, wall
    assert res.scores.tolist() == [-1.0] * 4
    assert res.failures == {"geneval": 4} and res.metrics["reward/failures/geneval"] == 4.0
    hits = [rec.getMessage() for rec in caplog.records if "reward time limit hit" in rec.getMessage()]
    assert len(hits) == 1 and f"reward.timeout={limit}s" in hits[0] and "geneval: 4 sample(s)" in hits[0]
    kinds = [rec.getMessage() for rec in caplog.records if "failed on 4 sample(s) (timeout)" in rec.getMessage()]
    assert kinds, [rec.getMessage() for rec in caplog.records]


@register_reward("_test_sleepy")
class _Sleepy(Reward):
    def __init__(self, sleep=0.0):
        self.sleep = sleep
        self._ready = False

    def score(self, images, prompts, metadata):
        time.sleep(self.sleep)
        return RewardOutput(np.arange(1.0, len(images) + 1.0))


def test_sync_limit_also_bounds_a_slow_local_reward():
    r = build_reward({"_test_sleepy": 1.0}, options={"_test_sleepy": {"sleep": 3.0}}, timeout=0.5, penalty=-2.0)
    t0 = time.monotonic()
    res = r(*_batch(3))
    assert time.monotonic() - t0 < 1.5
    assert res.scores.tolist() == [-2.0] * 3 and res.failures == {"_test_sleepy": 3}
    fast = build_reward({"_test_sleepy": 1.0}, timeout=5.0)(*_batch(3))  # under the limit: scored as usual
    assert fast.scores.tolist() == [1.0, 2.0, 3.0] and fast.failures == {"_test_sleepy": 0}


def test_retries_stop_when_the_step_time_runs_out(silent_server):
    """Per-request timeout 1 s, 3 retries: within a 2.5 s step limit the client makes at most 3 attempts and
    reports the limit, instead of 4 attempts + backoff."""
    r = build_reward({"geneval": 1.0}, options={"geneval": {"url": silent_server, "timeout": 1.0, "backoff": 0.1}},
                     timeout=2.5)
    t0 = time.monotonic()
    res = r(*_batch(2))
    assert time.monotonic() - t0 < 3.5
    assert res.failures == {"geneval": 2}


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "soon"])
def test_timeout_must_be_positive_or_null(bad):
    with pytest.raises(ValueError, match=r"reward timeout=.* must be a positive number of seconds per step, or null"):
        build_reward({"geneval": 1.0}, timeout=bad)


def test_preflight_names_the_url_of_a_dead_or_silent_server(silent_server):
    from verl_diffusion.rewards.geneval import GenEvalReward
    from verl_diffusion.rewards.vlm_ocr import VLMOCRReward

    dead = _closed_port_url()
    with pytest.raises(RuntimeError, match=rf"^{dead} does not answer \(.*refused"):
        GenEvalReward(url=dead).preflight(2.0)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"^{silent_server} does not answer \(no answer within 1 s\)"):
        GenEvalReward(url=silent_server).preflight(1.0)
    assert time.monotonic() - t0 < 2.0
    with pytest.raises(RuntimeError, match=rf"^{dead}/v1/models does not answer"):
        VLMOCRReward(url=dead + "/v1").preflight(2.0)
    srv, _ = serve(ColorBlobScorer(), port=0)  # a live protocol server answers a GET with an HTTP error: alive
    try:
        GenEvalReward(url=f"http://127.0.0.1:{srv.server_address[1]}").preflight(2.0)
    finally:
        srv.shutdown()
        srv.server_close()
