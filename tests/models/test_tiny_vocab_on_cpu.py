"""The tiny SD3 builder's word-level tokenizers and its factor-2 VAE (the shapes model's layout, issue 9)."""

import pytest

from verl_diffusion.models.tiny import build_tiny_sd3_pipeline
from verl_diffusion.models.tiny_parts import clip_bpe, clip_tokenizer, t5_tokenizer, word_merges

WORDS = ["a", "red", "green", "greens", "circle", "circles", "square", "left", "of", "three", "triangles", "re",
         "reed", "ee"]


def test_every_vocabulary_word_is_one_token_in_any_order():
    # "red" before "green" puts the (r, e) merge first, which splits "green" unless its own merges are ranked
    # after it: every order of the words must still give one token per word.
    for words in (WORDS, WORDS[::-1], sorted(WORDS), sorted(WORDS, key=len)):
        merges = word_merges(words)
        ranks = {m: i for i, m in enumerate(merges)}
        assert all(clip_bpe(w, ranks) == [w + "</w>"] for w in words)


def test_tokenizers_split_prompts_into_whole_words_and_fall_back_to_characters():
    clip, t5 = clip_tokenizer(16, WORDS), t5_tokenizer(16, WORDS)
    prompt = "three green triangles left of a red circle"
    assert clip.convert_ids_to_tokens(clip(prompt).input_ids)[1:-1] == [w + "</w>" for w in prompt.split()]
    assert t5.convert_ids_to_tokens(t5(prompt).input_ids)[:-1] == ["▁" + w for w in prompt.split()]
    # An unknown word is spelled in characters (the character tokenizers of the other tiny models).
    assert clip.convert_ids_to_tokens(clip("dog").input_ids)[1:-1] == ["d", "o", "g</w>"]
    # Without words the tokenizers are the character-level ones.
    assert len(clip_tokenizer(16)("red").input_ids) == 2 + 3


def test_word_tokenizers_survive_save_and_load(tmp_path):
    from transformers import CLIPTokenizer, T5TokenizerFast

    clip, t5 = clip_tokenizer(16, WORDS), t5_tokenizer(16, WORDS)
    clip.save_pretrained(tmp_path / "c")
    t5.save_pretrained(tmp_path / "t")
    prompt = "a red square left of three green circles"
    assert CLIPTokenizer.from_pretrained(tmp_path / "c")(prompt).input_ids == clip(prompt).input_ids
    assert T5TokenizerFast.from_pretrained(tmp_path / "t")(prompt).input_ids == t5(prompt).input_ids


def test_two_block_vae_halves_the_image_side():
    import torch

    pipe = build_tiny_sd3_pipeline(sample_size=16, vae_blocks=2, latent_channels=4, vocab=WORDS)
    z = pipe.vae.encode(torch.zeros(1, 3, 32, 32)).latent_dist.mode()
    assert z.shape == (1, 4, 16, 16)
    assert pipe.vae.decode(z).sample.shape == (1, 3, 32, 32)
    assert pipe.transformer.config.in_channels == 4
