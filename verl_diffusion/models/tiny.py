"""Tiny random diffusers pipelines, built fully offline, for tests, benchmarks and the CPU demo.

Nothing is downloaded: every component is created from a small config with a seeded random init, and the
CLIP and T5 tokenizers are built from an in-memory character vocabulary. The pipelines have the real
classes (``StableDiffusion3Pipeline`` with ``SD3Transformer2DModel``, ``AutoencoderKL``, two
``CLIPTextModelWithProjection`` and a ``T5EncoderModel``), so ``save_pretrained`` /
``from_pretrained`` and every adapter code path are exercised exactly as with the real weights.

Sizes (defaults): latent 16 channels × 16 × 16 (64 × 64 pixels, VAE factor 4), transformer 2 layers of
width 32, text encoders of width 16/16/32; about 136k parameters, 0.7 MB on disk in total.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Union

import torch

# Characters the tiny tokenizers know; anything else maps to <unk> (T5) or is dropped by byte-level BPE.
_CHARS = sorted(set(string.ascii_lowercase + string.digits + ".,!?'-:\"()"))

# SD3's VAE constants (diffusers' sd3 vae config); kept so decode exercises the real scale/shift path.
SD3_VAE_SCALING_FACTOR = 1.5305
SD3_VAE_SHIFT_FACTOR = 0.0609


def _clip_tokenizer(max_length: int):
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def _t5_tokenizer(max_length: int):
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(c, -2.0) for c in _CHARS] + [("▁" + c, -1.5) for c in _CHARS]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)


def build_tiny_sd3_pipeline(
    *,
    seed: int = 0,
    sample_size: int = 16,
    num_layers: int = 2,
    attention_head_dim: int = 8,
    num_attention_heads: int = 4,
    text_width: int = 16,
    text_seq_len: int = 16,
    latent_channels: int = 16,
    vae_channels: int = 8,
    shift: float = 3.0,
    dtype: torch.dtype = torch.float32,
):
    """Build a random tiny ``StableDiffusion3Pipeline`` offline.

    Args:
      seed: torch seed for all random weights (same seed → bitwise same weights).
      sample_size: latent height = width; pixels = 4·sample_size (VAE with three blocks, factor 4).
      num_layers, attention_head_dim, num_attention_heads: the joint transformer (width = heads·head_dim).
      text_width: hidden width of each CLIP encoder; T5 and the joint attention use 2·text_width, so the
        padded CLIP-L/G concat fits exactly as in SD3.
      text_seq_len: CLIP and T5 token length (L = 2·text_seq_len tokens of conditioning).
      latent_channels: 16 as in SD3.
      vae_channels: width of the VAE blocks.
      shift: FlowMatchEulerDiscreteScheduler shift (SD3: 3).
    Returns: StableDiffusion3Pipeline on CPU in ``dtype``.
    """
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    tokenizer = _clip_tokenizer(text_seq_len)
    tokenizer_2 = _clip_tokenizer(text_seq_len)
    tokenizer_3 = _t5_tokenizer(text_seq_len)
    joint_dim = 2 * text_width

    torch.manual_seed(seed)
    clip_cfg = dict(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width,
        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=text_seq_len,
        projection_dim=text_width, hidden_act="gelu", bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    text_encoder = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**clip_cfg))
    text_encoder_3 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_3), d_model=joint_dim, d_kv=8, d_ff=2 * joint_dim, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0,
    ))
    transformer = SD3Transformer2DModel(
        sample_size=sample_size, patch_size=2, in_channels=latent_channels, out_channels=latent_channels,
        num_layers=num_layers, attention_head_dim=attention_head_dim,
        num_attention_heads=num_attention_heads, joint_attention_dim=joint_dim,
        caption_projection_dim=attention_head_dim * num_attention_heads,
        pooled_projection_dim=2 * text_width, pos_embed_max_size=max(sample_size, 16),
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(vae_channels,) * 3, layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=min(4, vae_channels), sample_size=4 * sample_size,
        scaling_factor=SD3_VAE_SCALING_FACTOR, shift_factor=SD3_VAE_SHIFT_FACTOR,
        use_quant_conv=False, use_post_quant_conv=False,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        text_encoder_3=text_encoder_3, tokenizer_3=tokenizer_3,
    )
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae, text_encoder, text_encoder_2, text_encoder_3):
        module.eval()
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def save_tiny_sd3(path: Union[str, Path], **kwargs) -> Path:
    """Build a tiny SD3 pipeline (kwargs of :func:`build_tiny_sd3_pipeline`) and ``save_pretrained`` it.

    Returns: the directory, readable by ``SD3Adapter.from_pretrained`` and ``StableDiffusion3Pipeline``.
    """
    path = Path(path)
    build_tiny_sd3_pipeline(**kwargs).save_pretrained(str(path), safe_serialization=True)
    return path
