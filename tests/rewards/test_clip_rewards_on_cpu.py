"""PickScore and the LAION aesthetic predictor on a tiny random CLIP saved to disk and loaded back
through the rewards' own loading code."""

import json

import numpy as np
import pytest
import torch

from verl_diffusion.rewards import build_reward
from verl_diffusion.rewards.aesthetic import build_aesthetic_mlp
from verl_diffusion.rewards.pickscore import PickScoreReward


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor, CLIPTokenizer

    d = tmp_path_factory.mktemp("tiny_clip")
    vocab = {}
    for c in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'\"-":
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    (d / "vocab.json").write_text(json.dumps(vocab))
    (d / "merges.txt").write_text("#version: 0.2\n")
    tok = CLIPTokenizer(str(d / "vocab.json"), str(d / "merges.txt"))
    ip = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=ip, tokenizer=tok).save_pretrained(d)
    eos = vocab["<|endoftext|>"]
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(vocab), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=77, bos_token_id=eos - 1,
                         eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8),
        projection_dim=16,
    )
    torch.manual_seed(0)
    model = CLIPModel(cfg).eval()
    model.save_pretrained(d)
    return d, model


def _images(n=4, size=48):
    rng = np.random.default_rng(0)
    return [(rng.random((size, size, 3)) * 255).astype(np.uint8) for _ in range(n)]


PROMPTS = ["a cat on a mat", "a red car", "two dogs", "a bowl of fruit"]


def test_pickscore_loads_from_dir_and_matches_formula(tiny_clip_dir):
    d, model = tiny_clip_dir
    reward = build_reward({"pickscore": 1.0}, options={"pickscore": {"model_path": str(d), "device": "cpu"}})
    imgs = _images()
    a = reward(imgs, PROMPTS, [{}] * 4)
    b = reward(imgs, PROMPTS, [{}] * 4)
    assert a.failures == {"pickscore": 0}
    torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=0)  # deterministic
    # the published formula, computed here with the model object we saved
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(d)
    with torch.no_grad():
        from PIL import Image

        px = proc(images=[Image.fromarray(i) for i in imgs], return_tensors="pt")["pixel_values"]
        tx = proc(text=PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
        ie = model.visual_projection(model.vision_model(pixel_values=px).pooler_output)
        te = model.text_projection(model.text_model(input_ids=tx["input_ids"], attention_mask=tx["attention_mask"]).pooler_output)
        cos = torch.nn.functional.cosine_similarity(ie, te, dim=-1)
        expected = model.logit_scale.exp() * cos / 26
    torch.testing.assert_close(a.scores, expected.float(), rtol=1e-5, atol=1e-6)


def test_pickscore_requires_model_path():
    with pytest.raises(ValueError, match="model_path"):
        PickScoreReward()


def test_pickscore_missing_dir_is_counted_not_raised(tmp_path):
    reward = build_reward({"pickscore": 1.0}, options={"pickscore": {"model_path": str(tmp_path / "nope")}}, penalty=-2.0)
    res = reward(_images(2), PROMPTS[:2], [{}, {}])
    assert res.failures == {"pickscore": 2} and res.scores.tolist() == [-2.0, -2.0]


def test_aesthetic_loads_mlp_file_and_scores_deterministically(tiny_clip_dir, tmp_path):
    d, model = tiny_clip_dir
    torch.manual_seed(1)
    mlp = build_aesthetic_mlp(16).eval()
    assert sorted(mlp.state_dict())[:2] == ["layers.0.bias", "layers.0.weight"]  # published key layout
    torch.save(mlp.state_dict(), tmp_path / "aesthetic.pth")
    opts = {"aesthetic": {"clip_path": str(d), "mlp_path": str(tmp_path / "aesthetic.pth"), "device": "cpu"}}
    reward = build_reward({"aesthetic": 1.0}, options=opts)
    imgs = _images()
    a, b = reward(imgs, PROMPTS, [{}] * 4), reward(imgs, PROMPTS, [{}] * 4)
    torch.testing.assert_close(a.scores, b.scores, rtol=0, atol=0)
    from transformers import AutoProcessor
    from PIL import Image

    px = AutoProcessor.from_pretrained(d)(images=[Image.fromarray(i) for i in imgs], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        emb = model.visual_projection(model.vision_model(pixel_values=px).pooler_output)
        expected = mlp(emb / emb.norm(dim=-1, keepdim=True))
    torch.testing.assert_close(a.scores, expected.float(), rtol=1e-5, atol=1e-6)
    assert len(set(a.scores.tolist())) == 4
