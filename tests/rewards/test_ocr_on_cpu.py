"""OCR reward: the published formula by hand, then real recognition of PIL-rendered text."""

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from verl_diffusion.rewards import build_reward
from verl_diffusion.rewards.ocr import OCRReward, extract_target, levenshtein, ocr_score


def test_extract_target_first_quoted_pair():
    assert extract_target('a sign reading "Open Late" and "Closed"') == "Open Late"
    assert extract_target("no quotes here") is None
    assert extract_target('one " only') is None


def test_levenshtein_hand_cases():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert levenshtein("abc", "abc") == 0


def test_ocr_score_formula():
    assert ocr_score("WELCOME HOME friends", "welcome home") == 1.0  # contained after normalisation
    assert ocr_score("welcome hame", "welcome home") == pytest.approx(1 - 1 / 11)  # 11 chars, 1 edit
    assert ocr_score("", "abcd") == 0.0  # distance capped at the target length
    assert ocr_score("zzzzzzzzzzzzzzzzzzzz", "abcd") == 0.0


def _render(text: str, size: int = 384) -> np.ndarray:
    img = Image.new("RGB", (size, size), "white")
    if text:
        ImageDraw.Draw(img).text((16, size // 2 - 20), text, fill="black", font=ImageFont.load_default(size=36))
    return np.asarray(img)


@pytest.fixture(scope="module")
def ocr():
    pytest.importorskip("rapidocr_onnxruntime", reason="rapidocr-onnxruntime not installed (pip install verl-diffusion[ocr])")
    reward = OCRReward(num_threads=1)
    reward.ensure_ready()
    return reward


def test_ocr_reward_on_rendered_images(ocr):
    prompt = 'A storefront sign that says "Open Late Today"'
    noise = (np.random.default_rng(0).random((384, 384, 3)) * 255).astype(np.uint8)
    images = [_render("Open Late Today"), _render("Bakery Cafe"), _render(""), noise]
    out = ocr(images, [prompt] * 4, [{}] * 4)
    right, wrong, blank, noisy = out.scores
    assert right > 0.9, out.scores
    assert wrong < 0.5 and blank == 0.0 and noisy < 0.5, out.scores


def test_ground_truth_overrides_prompt(ocr):
    out = ocr([_render("Hello World")], ['a sign "something else"'], [{"reward_model": {"ground_truth": "Hello World"}}])
    assert out.scores[0] > 0.9


def test_missing_target_is_a_counted_failure(ocr):
    reward = build_reward({"ocr": 1.0}, penalty=-1.0)
    reward.rewards["ocr"] = ocr
    res = reward([_render("Hello")], ["a prompt without quotes"], [{}])
    assert res.failures == {"ocr": 1} and res.scores.tolist() == [-1.0]
    assert res.metrics["reward/failures/ocr"] == 1.0


def test_thread_pool_matches_sync(ocr):
    images = [_render("Open Late Today"), _render("Bakery Cafe")]
    prompts = ['a sign "Open Late Today"'] * 2
    sync = ocr(images, prompts, [{}, {}]).scores
    with build_reward({"ocr": 1.0}, options={"ocr": {"num_threads": 1}}, executor="thread", max_workers=2) as pooled:
        res = pooled(images, prompts, [{}, {}])
    assert res.failures == {"ocr": 0}
    np.testing.assert_allclose(res.scores.numpy(), sync, rtol=1e-6)
