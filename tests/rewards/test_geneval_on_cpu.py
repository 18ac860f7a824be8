"""GenEval client against a real loopback HTTP server speaking the reward-server protocol: correct scores,
then a server that returns 500s, is slow, or closes the connection."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image, ImageDraw

from verl_diffusion.rewards import build_reward
from verl_diffusion.rewards._protocol import dumps, safe_loads
from verl_diffusion.rewards.geneval import GenEvalReward
from verl_diffusion.rewards.geneval_server import COLOR_RGB, ColorBlobScorer, serve

CLASS_COLORS = {"apple": (0, 200, 200), "cup": (200, 0, 200), "dog": (90, 90, 255)}


def draw(objs, size=96):
    """objs: (class, colour, x0, y0, x1, y1); border = class colour, interior = attribute colour."""
    img = Image.new("RGB", (size, size), "white")
    d = ImageDraw.Draw(img)
    for cls, color, *box in objs:
        d.rectangle(box, fill=COLOR_RGB[color], outline=CLASS_COLORS[cls], width=6)
    return np.asarray(img)


def row(meta):
    return {"reward_model": {"style": "rule", "ground_truth": json.dumps(meta)}}


TWO_APPLES = {"tag": "counting", "include": [{"class": "apple", "count": 2}], "exclude": [{"class": "apple", "count": 3}],
              "prompt": "a photo of two apples"}
RED_CUP = {"tag": "colors", "include": [{"class": "cup", "count": 1, "color": "red"}], "prompt": "a photo of a red cup"}
DOG_LEFT = {"tag": "position", "include": [{"class": "cup", "count": 1}, {"class": "dog", "count": 1, "position": ["left of", 0]}],
            "prompt": "a photo of a dog left of a cup"}

CASES = [
    (draw([("apple", "green", 5, 5, 30, 30), ("apple", "red", 50, 50, 80, 80)]), TWO_APPLES, 1.0, 1.0),
    (draw([("apple", "green", 5, 5, 30, 30)]), TWO_APPLES, 0.5, 0.0),          # count fails, exclude holds
    (draw([("cup", "blue", 10, 10, 40, 40)]), RED_CUP, 0.5, 0.0),              # found, wrong colour
    (draw([("cup", "red", 10, 10, 40, 40)]), RED_CUP, 1.0, 1.0),
    (draw([("dog", "brown", 5, 30, 30, 60), ("cup", "black", 60, 30, 90, 60)]), DOG_LEFT, 1.0, 1.0),
    (draw([("dog", "brown", 60, 30, 90, 60), ("cup", "black", 5, 30, 30, 60)]), DOG_LEFT, 2 / 3, 0.0),
]


@pytest.fixture(scope="module")
def server():
    srv, _ = serve(ColorBlobScorer(CLASS_COLORS), port=0)
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_scores_from_loopback_server(server):
    images = [c[0] for c in CASES]
    metas = [row(c[1]) for c in CASES]
    reward = build_reward({"geneval": 1.0}, options={"geneval": {"url": server, "batch_size": 4}})  # 2 requests
    res = reward(images, [c[1]["prompt"] for c in CASES], metas)
    np.testing.assert_allclose(res.scores.numpy(), [c[2] for c in CASES], atol=1e-6)
    np.testing.assert_allclose(res.details["geneval/strict_accuracy"].numpy(), [c[3] for c in CASES])
    assert res.failures == {"geneval": 0}
    assert res.metrics["reward/geneval/strict_accuracy/counting"] == pytest.approx(0.5)
    assert res.metrics["reward/geneval/strict_accuracy/position"] == pytest.approx(0.5)
    assert res.metrics["reward/geneval/strict_accuracy/colors"] == pytest.approx(0.5)


def test_protocol_reply_has_group_results(server):
    import urllib.request

    from verl_diffusion.rewards.base import encode_jpeg

    body = dumps({"images": [encode_jpeg(CASES[0][0])], "meta_datas": [TWO_APPLES], "only_strict": False})
    with urllib.request.urlopen(urllib.request.Request(server, data=body, method="POST"), timeout=10) as r:
        reply = safe_loads(r.read())
    assert set(reply) == {"scores", "rewards", "strict_rewards", "group_rewards", "group_strict_rewards"}
    assert reply["group_strict_rewards"]["counting"] == [1.0] and reply["group_strict_rewards"]["colors"] == [-10.0]


class _Flaky(BaseHTTPRequestHandler):
    """mode: 500 (always), slow (sleeps past the client timeout), close (drops the connection),
    500-then-ok (one 500 then correct replies)."""

    mode = "500"
    calls = 0

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        type(self).calls += 1
        body = self.rfile.read(int(self.headers["Content-Length"]))
        mode = type(self).mode
        if mode == "500" or (mode == "500-then-ok" and type(self).calls == 1):
            msg = b"Traceback ...\nRuntimeError: detector crashed"
            self.send_response(500)
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        if mode == "slow":
            time.sleep(1.0)
        if mode == "close":
            self.connection.shutdown(socket.SHUT_RDWR)
            self.connection.close()
            return
        n = len(safe_loads(body)["images"])
        reply = dumps({"scores": [0.5] * n, "rewards": [0.0] * n, "strict_rewards": [0.0] * n,
                       "group_rewards": {}, "group_strict_rewards": {}})
        self.send_response(200)
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)


@pytest.fixture
def flaky():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    _Flaky.calls = 0
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.mark.parametrize("mode", ["500", "slow", "close"])
def test_failing_server_is_penalised_and_counted(flaky, mode, caplog):
    _Flaky.mode = mode
    url = f"http://127.0.0.1:{flaky.server_address[1]}"
    opts = {"geneval": {"url": url, "timeout": 0.3, "max_retries": 2, "backoff": 0.01}}
    reward = build_reward({"geneval": 1.0}, options=opts, penalty=-1.0)
    images, metas = [CASES[0][0]] * 3, [row(TWO_APPLES)] * 3
    with caplog.at_level("WARNING"):
        res = reward(images, ["p"] * 3, metas)
        res2 = reward(images, ["p"] * 3, metas)
    assert res.scores.tolist() == [-1.0] * 3 and res.failures == {"geneval": 3}
    assert res.metrics["reward/failures/geneval"] == 3.0 and res2.failures == {"geneval": 3}
    assert _Flaky.calls == 2 * 3  # 1 try + 2 retries, per call
    logged = [r.getMessage() for r in caplog.records if "geneval" in r.getMessage()]
    assert len(logged) == 1  # logged once, with its cause
    expected = {"500": "HTTP 500", "slow": "timed out", "close": "talking to"}[mode]
    assert expected in logged[0], logged[0]


def test_retry_recovers_after_one_500(flaky):
    _Flaky.mode = "500-then-ok"
    url = f"http://127.0.0.1:{flaky.server_address[1]}"
    reward = GenEvalReward(url=url, timeout=2, max_retries=2, backoff=0.01)
    out = reward([CASES[0][0]] * 2, ["p"] * 2, [row(TWO_APPLES)] * 2)
    assert out.scores.tolist() == [0.5, 0.5] and not out.errors and _Flaky.calls == 2


def test_missing_metadata_is_a_failure_not_a_request(server):
    res = build_reward({"geneval": 1.0}, options={"geneval": {"url": server}})([CASES[0][0]], ["p"], [{}])
    assert res.failures == {"geneval": 1}


def test_safe_loads_refuses_code():
    import os
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        safe_loads(pickle.dumps(Evil()))


def test_launcher_script_serves_the_protocol():
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "scripts" / "reward_server.py"
    kwargs = json.dumps({"class_colors": {k: list(v) for k, v in CLASS_COLORS.items()}})
    proc = subprocess.Popen([sys.executable, str(script), "--port", "0", "--scorer-kwargs", kwargs],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = line.strip().rsplit(" ", 1)[-1]
        assert url.startswith("http://127.0.0.1:"), line
        res = build_reward({"geneval": 1.0}, options={"geneval": {"url": url}})([CASES[3][0]], ["p"], [row(RED_CUP)])
        assert res.scores.tolist() == [1.0]
    finally:
        proc.terminate()
        proc.wait(timeout=10)
