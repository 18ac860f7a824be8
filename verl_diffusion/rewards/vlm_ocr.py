"""OCR scored by a vision-language model behind an OpenAI-compatible endpoint (verl PR #5951's judge).

Each image goes as a base64 JPEG in one ``POST {url}/chat/completions`` request with the instruction "output
only the text content from the image" (verl's Qwen-Image OCR example uses Qwen3-VL-8B-Instruct served by
vLLM); the reply text is scored against the target exactly as the ``ocr`` reward scores rapidocr's text
(``ocr.ocr_score``: lower-cased, spaces removed, substring → 1, else 1 − min(Levenshtein, len)/len).

Options: ``url`` (base URL ending in /v1; env ``VLM_OCR_URL``), ``model`` (the served model name),
``api_key`` (env ``VLM_OCR_API_KEY``; sent as a Bearer token when set), ``max_tokens`` (256),
``temperature`` (0.0: a judge should be deterministic; verl's example samples at 0.7), ``timeout`` (60 s),
``max_retries`` (2, with ``backoff`` 0.5 s doubling; 4xx is not retried), ``concurrency`` (8 requests in
flight), ``jpeg_quality`` (95).

Failures: a request that still fails, or a reply without text, gives NaN for that image (MultiReward
penalises and counts it, logging the cause); the other images keep their scores.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import json
import os
import time
import urllib.error
import urllib.request
from typing import Optional

import numpy as np

from verl_diffusion.rewards.base import (
    Reward,
    RewardOutput,
    encode_jpeg,
    probe_http,
    register_reward,
    row_ground_truth,
)
from verl_diffusion.rewards.ocr import extract_target, normalize_text, ocr_score

JUDGE_INSTRUCTION = "Please output only the text content from the image without any additional descriptions or formatting."


@register_reward("vlm_ocr")
class VLMOCRReward(Reward):
    def __init__(self, url: Optional[str] = None, model: str = "Qwen3-VL-8B-Instruct", api_key: Optional[str] = None,
                 max_tokens: int = 256, temperature: float = 0.0, timeout: float = 60.0, max_retries: int = 2,
                 backoff: float = 0.5, concurrency: int = 8, jpeg_quality: int = 95):
        url = url or os.environ.get("VLM_OCR_URL")
        if not url:
            raise ValueError("vlm_ocr needs options.vlm_ocr.url (or VLM_OCR_URL): the base URL of an "
                             "OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (vllm serve <vlm>)")
        self.url = url.rstrip("/")
        self.model, self.api_key = str(model), api_key or os.environ.get("VLM_OCR_API_KEY")
        self.max_tokens, self.temperature, self.timeout = int(max_tokens), float(temperature), float(timeout)
        self.max_retries, self.backoff = int(max_retries), float(backoff)
        self.concurrency, self.jpeg_quality = max(1, int(concurrency)), int(jpeg_quality)
        self._ready = False

    def request_body(self, image: np.ndarray) -> dict:
        data = base64.b64encode(encode_jpeg(image, self.jpeg_quality)).decode("ascii")
        return {"model": self.model, "max_tokens": self.max_tokens, "temperature": self.temperature,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}},
                    {"type": "text", "text": JUDGE_INSTRUCTION}]}]}

    def read_text(self, image: np.ndarray) -> str:
        """The judge's transcription of one image; raises RuntimeError after the retries."""
        body = json.dumps(self.request_body(image)).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last = "no attempt"
        attempt = 0
        for attempt in range(self.max_retries + 1):
            if attempt:
                pause, left = self.backoff * 2 ** (attempt - 1), self.time_left()
                time.sleep(pause if left is None else max(0.0, min(pause, left)))
            # Each attempt fits in what is left of the step's reward time (reward.timeout), retries included.
            left = self.time_left()
            if left is not None and left <= 0:
                raise TimeoutError(f"vlm_ocr: reward.timeout ran out talking to {self.url} ({last}; {attempt} "
                                   "attempt(s) made)")
            req = urllib.request.Request(f"{self.url}/chat/completions", data=body, headers=headers, method="POST")
            try:
                wait = self.timeout if left is None else min(self.timeout, left)
                with urllib.request.urlopen(req, timeout=wait) as resp:
                    reply = json.loads(resp.read())
                text = reply["choices"][0]["message"]["content"]
                if not isinstance(text, str):
                    raise ValueError(f"message content is {type(text).__name__}, not text")
                return text
            except urllib.error.HTTPError as e:
                last = f"HTTP {e.code} from {self.url}"
                if 400 <= e.code < 500:
                    break
            except (OSError, urllib.error.URLError, TimeoutError) as e:
                last = f"{type(e).__name__} talking to {self.url}: {e}"
            except (ValueError, KeyError, IndexError, TypeError) as e:
                last = f"bad reply from {self.url}: {type(e).__name__}: {e}"
        left = self.time_left()
        if left is not None and left <= 0:
            raise TimeoutError(f"vlm_ocr: {last} (after {attempt + 1} attempts; reward.timeout ran out)")
        raise RuntimeError(f"vlm_ocr: {last} (after {attempt + 1} attempts)")

    def score(self, images: list[np.ndarray], prompts: list[str], metadata: list[dict]) -> RewardOutput:
        scores = np.full(len(images), np.nan)
        errors: list[str] = []
        timed_out = False
        targets = []
        for prompt, meta in zip(prompts, metadata):
            target = row_ground_truth(meta)
            if not isinstance(target, str) or not target.strip():
                target = extract_target(prompt)
            targets.append(target if target is not None and normalize_text(target) else None)
        todo = [i for i, t in enumerate(targets) if t is not None]
        if len(todo) < len(images):
            errors.append(f"{len(images) - len(todo)} prompt(s) have no target text between double quotes")
        with cf.ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(todo), 1))) as pool:
            futures = {pool.submit(self.read_text, images[i]): i for i in todo}
            for fut in cf.as_completed(futures):
                i = futures[fut]
                try:
                    scores[i] = ocr_score(fut.result(), targets[i])
                except Exception as e:   # one image's failure: NaN, counted and penalised by MultiReward
                    errors.append(str(e))
                    timed_out = timed_out or isinstance(e, TimeoutError)
        return RewardOutput(scores, errors=errors, timed_out=timed_out)

    def preflight(self, timeout: float) -> None:
        """Any HTTP answer from ``{url}/models`` (the OpenAI-compatible model list) within ``timeout`` seconds;
        raises RuntimeError naming the URL otherwise."""
        probe_http(f"{self.url}/models", timeout)
