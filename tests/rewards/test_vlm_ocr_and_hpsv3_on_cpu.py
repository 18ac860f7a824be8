"""The VLM-judge OCR reward against a loopback OpenAI-compatible stub, and the hpsv3 reward's loading contract
(clear errors; a fake inferencer in place of the package; the real model when its weights are given)."""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from verl_diffusion.rewards import build_reward
from verl_diffusion.rewards.hpsv3 import HPSv3Reward
from verl_diffusion.rewards.vlm_ocr import JUDGE_INSTRUCTION, VLMOCRReward


class _Judge(BaseHTTPRequestHandler):
    """Answers with the text its image "shows": the image's mean red value picks a canned transcription."""

    answers = {0: "HELLO world", 1: "hel1o", 2: None}   # None: HTTP 500
    seen: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        msg = body["messages"][0]["content"]
        url = msg[0]["image_url"]["url"]
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
        key = int(round(img[..., 0].mean() / 100))
        type(self).seen.append((self.path, body["model"], msg[1]["text"], self.headers.get("Authorization")))
        text = self.answers.get(key)
        if text is None:
            self.send_response(500)
            self.end_headers()
            return
        out = json.dumps({"choices": [{"message": {"role": "assistant", "content": text}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def judge():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Judge)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _image(red: int) -> np.ndarray:
    im = np.zeros((32, 32, 3), dtype=np.uint8)
    im[..., 0] = red
    return im


def test_vlm_ocr_scores_with_the_published_ocr_formula(judge):
    _Judge.seen.clear()
    r = VLMOCRReward(url=judge, model="judge-vl", api_key="k", max_retries=0)
    out = r([_image(0), _image(100), _image(0)], ['a sign "hello"', 'a sign "hello"', "no quotes here"],
            [{}, {}, {}])
    # "HELLO world" contains "hello" → 1; "hel1o" vs "hello": one substitution → 1 − 1/5; no target → NaN.
    assert out.scores[0] == 1.0 and out.scores[1] == pytest.approx(0.8) and np.isnan(out.scores[2])
    assert out.errors and "no target text" in out.errors[0]
    assert {s[:4] for s in _Judge.seen} == {("/v1/chat/completions", "judge-vl", JUDGE_INSTRUCTION, "Bearer k")}


def test_vlm_ocr_failures_are_penalised_and_counted(judge):
    reward = build_reward({"vlm_ocr": 1.0}, options={"vlm_ocr": {"url": judge, "max_retries": 1, "backoff": 0.01}},
                          penalty=-1.0)
    res = reward(np.stack([_image(0), _image(200)]), ['"hello"', '"hello"'], [{}, {}])
    assert res.scores.tolist() == [1.0, -1.0]
    assert res.failures == {"vlm_ocr": 1} and res.metrics["reward/failures/vlm_ocr"] == 1


def test_vlm_ocr_unreachable_server_and_missing_url(monkeypatch):
    monkeypatch.delenv("VLM_OCR_URL", raising=False)
    with pytest.raises(ValueError, match="vlm_ocr needs options.vlm_ocr.url"):
        VLMOCRReward()
    r = VLMOCRReward(url="http://127.0.0.1:9/v1", max_retries=0, timeout=2)
    out = r([_image(0)], ['"x"'], [{}])
    assert np.isnan(out.scores[0]) and "talking to http://127.0.0.1:9/v1" in out.errors[0]


def test_hpsv3_needs_a_local_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="hpsv3 needs options.hpsv3.checkpoint_path"):
        HPSv3Reward()
    r = HPSv3Reward(checkpoint_path=str(tmp_path / "missing.safetensors"))
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        r.ensure_ready()


def test_hpsv3_without_the_package_says_why(tmp_path, monkeypatch):
    ckpt = tmp_path / "HPSv3.safetensors"
    ckpt.write_bytes(b"")
    monkeypatch.setitem(sys.modules, "hpsv3", None)
    monkeypatch.setitem(sys.modules, "hpsv3.inference", None)
    with pytest.raises(ImportError, match="transformers==4.45.2"):
        HPSv3Reward(checkpoint_path=str(ckpt)).ensure_ready()
    # In a run, a missing package is a counted, penalised failure, not a crash.
    res = build_reward({"hpsv3": 1.0}, options={"hpsv3": {"checkpoint_path": str(ckpt)}}, penalty=-2.0)(
        np.stack([_image(0)]), ["p"], [{}])
    assert res.scores.tolist() == [-2.0] and res.failures == {"hpsv3": 1}


def test_hpsv3_scores_are_the_preference_mean(tmp_path, monkeypatch):
    """With a stand-in inferencer (the package's interface: reward(images, prompts) → [B, 2] of (μ, σ))."""
    import torch

    calls = []

    class FakeInferencer:
        def __init__(self, config_path=None, checkpoint_path=None, device="cuda"):
            calls.append((config_path, checkpoint_path, device))

        def reward(self, images, prompts):
            assert all(isinstance(im, Image.Image) for im in images)
            return torch.tensor([[float(np.asarray(im)[..., 0].mean()) + len(p), 0.5] for im, p in zip(images, prompts)])

    mod = types.ModuleType("hpsv3.inference")
    mod.HPSv3RewardInferencer = FakeInferencer
    monkeypatch.setitem(sys.modules, "hpsv3", types.ModuleType("hpsv3"))
    monkeypatch.setitem(sys.modules, "hpsv3.inference", mod)
    ckpt = tmp_path / "HPSv3.safetensors"
    ckpt.write_bytes(b"")
    out = HPSv3Reward(checkpoint_path=str(ckpt), device="cpu", batch_size=2)(
        [_image(10), _image(20), _image(30)], ["a", "bb", "ccc"], [{}, {}, {}])
    assert out.scores.tolist() == [11.0, 22.0, 33.0]
    assert calls == [(None, str(ckpt), "cpu")]


@pytest.mark.skipif(not os.environ.get("VERL_DIFFUSION_HPSV3_CHECKPOINT"),
                    reason="real HPSv3 weights absent: set VERL_DIFFUSION_HPSV3_CHECKPOINT (and install hpsv3 in a "
                           "compatible environment) to run")
def test_hpsv3_real_model_prefers_the_matching_image():   # pragma: no cover - needs weights
    r = HPSv3Reward(checkpoint_path=os.environ["VERL_DIFFUSION_HPSV3_CHECKPOINT"],
                    config_path=os.environ.get("VERL_DIFFUSION_HPSV3_CONFIG"))
    red = np.zeros((448, 448, 3), np.uint8)
    red[..., 0] = 220
    out = r([red, red], ["a plain red square", "a photo of a dog in the snow"], [{}, {}])
    assert np.isfinite(out.scores).all() and out.scores[0] > out.scores[1]
