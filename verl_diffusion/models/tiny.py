"""Tiny random diffusers pipelines, built fully offline, for tests, benchmarks and the CPU demo.

Nothing is downloaded: every component is created from a small config with a seeded random init, and the
CLIP, T5 and Qwen tokenizers are built from an in-memory vocabulary (characters; byte-level BPE for Qwen).
The pipelines have the real classes (SD3: ``StableDiffusion3Pipeline`` with ``SD3Transformer2DModel``,
``AutoencoderKL``, two ``CLIPTextModelWithProjection`` and a ``T5EncoderModel``; Qwen-Image, FLUX.1 and
FLUX.2-klein likewise, see each builder), so ``save_pretrained`` / ``from_pretrained`` and every adapter
code path are exercised exactly as with the real weights. :func:`save_tiny` saves any of them, optionally
with a sharded transformer checkpoint.

Sizes (defaults): latent 16 channels × 16 × 16 (64 × 64 pixels, VAE factor 4), transformer 2 layers of
width 32, text encoders of width 16/16/32; about 136k parameters, 0.7 MB on disk in total.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

# Characters the tiny tokenizers know; anything else maps to <unk> (T5) or is dropped by byte-level BPE.
_CHARS = sorted(set(string.ascii_lowercase + string.digits + ".,!?'-:\"()"))

# SD3's VAE constants (diffusers' sd3 vae config); kept so decode exercises the real scale/shift path.
SD3_VAE_SCALING_FACTOR = 1.5305
SD3_VAE_SHIFT_FACTOR = 0.0609


def _clip_bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's byte-pair encoding of one lower-case word (the algorithm of ``CLIPTokenizer.bpe``)."""
    parts = list(word[:-1]) + [word[-1] + "</w>"]
    while len(parts) > 1:
        pairs = {(a, b) for a, b in zip(parts, parts[1:])}
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                merged.append(parts[i] + parts[i + 1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


def _word_merges(words) -> list[tuple[str, str]]:
    """BPE merges under which every word of ``words`` is one token.

    Each word is encoded with the merges so far; while it is several tokens, the merge of its first two tokens is
    appended (lowest priority, so words already whole stay whole: a whole word has no pair left to merge).
    """
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        parts = _clip_bpe(word, ranks)
        while len(parts) > 1:
            ranks[(parts[0], parts[1])] = len(merges)
            merges.append((parts[0], parts[1]))
            parts = _clip_bpe(word, ranks)
    return merges


def _clip_tokenizer(max_length: int, words=()):
    """Character-level CLIP tokenizer; with ``words`` (lower-case), each of them is also one whole token."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    merges = _word_merges(words)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def _t5_tokenizer(max_length: int, words=()):
    """Character-level T5 (unigram) tokenizer; with ``words``, each of them is one whole ``▁word`` piece (its
    score beats any split into characters)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(c, -2.0) for c in _CHARS] + [("▁" + c, -1.5) for c in _CHARS]
    known = {p for p, _ in pieces}
    pieces += [("▁" + w, -1.0) for w in dict.fromkeys(words) if "▁" + w not in known]
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
    vae_blocks: int = 3,
    vocab: Optional[Sequence[str]] = None,
    shift: float = 3.0,
    dtype: torch.dtype = torch.float32,
):
    """Build a random tiny ``StableDiffusion3Pipeline`` offline.

    Args:
      seed: torch seed for all random weights (same seed → bitwise same weights).
      sample_size: latent height = width; pixels = f·sample_size with the VAE factor f = 2^(vae_blocks − 1).
      num_layers, attention_head_dim, num_attention_heads: the joint transformer (width = heads·head_dim).
      text_width: hidden width of each CLIP encoder; T5 and the joint attention use 2·text_width, so the
        padded CLIP-L/G concat fits exactly as in SD3.
      text_seq_len: CLIP and T5 token length (L = 2·text_seq_len tokens of conditioning).
      latent_channels: 16 as in SD3.
      vae_channels: width of the VAE blocks.
      vae_blocks: number of VAE encoder/decoder blocks (3: factor 4, 2: factor 2).
      vocab: whole words of the tokenizers (lower-case; e.g. a prompt vocabulary), on top of the characters.
      shift: FlowMatchEulerDiscreteScheduler shift (SD3: 3).
    Returns: StableDiffusion3Pipeline on CPU in ``dtype``.
    """
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    words = [w.lower() for w in vocab or ()]
    tokenizer = _clip_tokenizer(text_seq_len, words)
    tokenizer_2 = _clip_tokenizer(text_seq_len, words)
    tokenizer_3 = _t5_tokenizer(text_seq_len, words)
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
        down_block_types=("DownEncoderBlock2D",) * vae_blocks, up_block_types=("UpDecoderBlock2D",) * vae_blocks,
        block_out_channels=(vae_channels,) * vae_blocks, layers_per_block=1, latent_channels=latent_channels,
        norm_num_groups=min(4, vae_channels), sample_size=2 ** (vae_blocks - 1) * sample_size,
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


# ---------------------------------------------------------------------------------------------------------
# Qwen tokenizer (Qwen-Image's Qwen2.5-VL and FLUX.2-klein's Qwen3): byte-level BPE over an in-memory vocab.

def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / Qwen byte-level alphabet: every byte maps to a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# Whole-word tokens, so that Qwen-Image's prompt template tokenizes to exactly the 34 tokens the pipeline drops
# (``prompt_template_encode_start_idx``), as with the real tokenizer; anything else falls back to bytes.
_QWEN_WORDS = ("system", "Describe", " the", " image", " by", " detailing", " color", ",", " shape", " size",
               " texture", " quantity", " text", " spatial", " relationships", " of", " objects", " and",
               " background", ":", "user", "\n", "assistant")
_QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
# Qwen3's chat template, reduced to what Flux2KleinPipeline uses (user turns, generation prompt, thinking off).
_QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def _qwen_tokenizer(max_length: int):
    from transformers import Qwen2Tokenizer

    b2u = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(b2u.values())}
    merges: list[tuple[str, str]] = []
    for word in _QWEN_WORDS:
        u = "".join(b2u[b] for b in word.encode())
        for i in range(1, len(u)):
            if (u[:i], u[i]) not in merges:
                merges.append((u[:i], u[i]))
            vocab.setdefault(u[: i + 1], len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
    tok.add_special_tokens({"additional_special_tokens": list(_QWEN_SPECIALS)})
    tok.chat_template = _QWEN3_CHAT_TEMPLATE
    return tok


# Qwen-Image's FlowMatchEulerDiscreteScheduler config (dynamic, exponential shift with a terminal time).
QWEN_IMAGE_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                            num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                            use_dynamic_shifting=True)
# FLUX.1-dev's and FLUX.2's scheduler config (dynamic, exponential shift).
FLUX_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                      num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")


def build_tiny_qwen_image_pipeline(*, seed: int = 0, num_layers: int = 2, attention_head_dim: int = 16,
                                   num_attention_heads: int = 2, text_width: int = 16, latent_channels: int = 16,
                                   vae_base_dim: int = 8, max_length: int = 128, dtype: torch.dtype = torch.float32):
    """A random tiny ``QwenImagePipeline``: Qwen2.5-VL text encoder (2 layers, width ``text_width``), the
    MMDiT with ``num_layers`` blocks, the causal 3D VAE (factor 8, ``latent_channels`` channels), and the
    real scheduler config (:data:`QWEN_IMAGE_SCHEDULER`). 64×64 pixels → latents [16, 8, 8], 16 image tokens.
    """
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = _qwen_tokenizer(max_length)
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in _QWEN_SPECIALS}
    torch.manual_seed(seed)
    head = text_width // 2
    config = Qwen2_5_VLConfig(
        text_config={"hidden_size": text_width, "intermediate_size": 2 * text_width, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": len(tokenizer),
                     "bos_token_id": tokenizer.pad_token_id, "eos_token_id": special["<|im_end|>"],
                     "max_position_embeddings": 2048, "rope_theta": 1000000.0,
                     "rope_scaling": {"mrope_section": [head // 8, head // 8, head // 4], "rope_type": "default",
                                      "type": "default"}},
        vision_config={"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2,
                       "out_hidden_size": text_width},
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"], vision_end_token_id=special["<|vision_end|>"],
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config)
    transformer = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * latent_channels, out_channels=latent_channels, num_layers=num_layers,
        attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
        joint_attention_dim=text_width, guidance_embeds=False, axes_dims_rope=_rope_axes(attention_head_dim, 3))
    gen = torch.Generator().manual_seed(seed + 1)
    vae = AutoencoderKLQwenImage(
        base_dim=vae_base_dim, z_dim=latent_channels, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[round(float(v), 4) for v in 0.5 * torch.randn(latent_channels, generator=gen)],
        latents_std=[round(float(v), 4) for v in 1.0 + torch.rand(latent_channels, generator=gen)])
    scheduler = FlowMatchEulerDiscreteScheduler(**QWEN_IMAGE_SCHEDULER)
    pipe = QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                             transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


def _rope_axes(head_dim: int, n: int) -> tuple[int, ...]:
    """RoPE axis sizes (even, summing to ``head_dim``) for ``n`` position axes, the first one smallest."""
    rest = (head_dim - 2 * (head_dim // (2 * n))) // (n - 1) // 2 * 2
    first = head_dim - (n - 1) * rest
    return (first, *([rest] * (n - 1)))


def build_tiny_flux_pipeline(*, seed: int = 0, num_layers: int = 1, num_single_layers: int = 1,
                             attention_head_dim: int = 16, num_attention_heads: int = 2, text_width: int = 16,
                             text_seq_len: int = 16, latent_channels: int = 16, vae_channels: int = 8,
                             guidance_embeds: bool = True, dtype: torch.dtype = torch.float32):
    """A random tiny ``FluxPipeline`` (FLUX.1-dev layout: guidance embedding on): CLIP-L (pooled) and T5
    text encoders with ``text_seq_len`` tokens, ``num_layers`` double- and ``num_single_layers``
    single-stream blocks, a 16-channel VAE of factor 8 with FLUX's scaling/shift, FLUX.1-dev's scheduler
    config. 64×64 pixels → latents [16, 8, 8], 16 image tokens."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer = _clip_tokenizer(text_seq_len)
    tokenizer_2 = _t5_tokenizer(text_seq_len)
    torch.manual_seed(seed)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=text_seq_len, projection_dim=text_width,
        hidden_act="gelu", bos_token_id=0, eos_token_id=1, pad_token_id=1))
    text_encoder_2 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=2 * text_width, d_kv=8, d_ff=4 * text_width, num_layers=2,
        num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0))
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * latent_channels, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
        joint_attention_dim=2 * text_width, pooled_projection_dim=text_width, guidance_embeds=guidance_embeds,
        axes_dims_rope=_rope_axes(attention_head_dim, 3))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(vae_channels,) * 4, layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=min(4, vae_channels), sample_size=64,
        scaling_factor=FLUX_VAE_SCALING_FACTOR, shift_factor=FLUX_VAE_SHIFT_FACTOR,
        use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae, text_encoder, text_encoder_2):
        module.eval()
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


# FLUX.1's VAE constants (its ae config), so decode exercises the real scale/shift path.
FLUX_VAE_SCALING_FACTOR = 0.3611
FLUX_VAE_SHIFT_FACTOR = 0.1159


def build_tiny_flux2_klein_pipeline(*, seed: int = 0, num_layers: int = 1, num_single_layers: int = 1,
                                    attention_head_dim: int = 16, num_attention_heads: int = 2, text_width: int = 16,
                                    text_layers: int = 28, text_seq_len: int = 32, vae_latent_channels: int = 8,
                                    vae_channels: int = 8, dtype: torch.dtype = torch.float32):
    """A random tiny ``Flux2KleinPipeline`` (klein-base: not distilled, no guidance embedding): a Qwen3 text
    encoder of ``text_layers`` layers (28, so the pipeline's hidden-state layers 9, 18, 27 exist) and width
    ``text_width``, ``text_seq_len`` text tokens, the FLUX.2 VAE (factor 8, ``vae_latent_channels`` channels,
    batch-norm statistics randomised so decode exercises them), FLUX's scheduler config.
    64×64 pixels → latents [4·vae_latent_channels, 4, 4], 16 image tokens."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _qwen_tokenizer(text_seq_len)
    torch.manual_seed(seed)
    text_encoder = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=text_width, intermediate_size=2 * text_width,
        num_hidden_layers=text_layers, num_attention_heads=2, num_key_value_heads=2, head_dim=text_width // 2,
        max_position_embeddings=512, bos_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.pad_token_id,
        pad_token_id=tokenizer.pad_token_id))
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * vae_latent_channels, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=attention_head_dim, num_attention_heads=num_attention_heads,
        joint_attention_dim=3 * text_width, timestep_guidance_channels=32, axes_dims_rope=_rope_axes(attention_head_dim, 4), guidance_embeds=False)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(vae_channels,) * 4, layers_per_block=1,
        latent_channels=vae_latent_channels, norm_num_groups=min(4, vae_channels), sample_size=64,
        use_quant_conv=False, use_post_quant_conv=False)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.3 * torch.randn(vae.bn.running_mean.shape, generator=gen))
        vae.bn.running_var.copy_(0.5 + torch.rand(vae.bn.running_var.shape, generator=gen))
    scheduler = FlowMatchEulerDiscreteScheduler(**FLUX_SCHEDULER)
    pipe = Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                              transformer=transformer, is_distilled=False)
    pipe.set_progress_bar_config(disable=True)
    for module in (transformer, vae, text_encoder):
        module.eval()
    return pipe if dtype == torch.float32 else pipe.to(dtype=dtype)


# architecture name -> builder; save_tiny(name, path) saves any of them.
TINY_BUILDERS = {
    "sd3": build_tiny_sd3_pipeline,
    "qwen_image": build_tiny_qwen_image_pipeline,
    "flux": build_tiny_flux_pipeline,
    "flux2_klein": build_tiny_flux2_klein_pipeline,
}


def save_tiny(architecture: str, path: Union[str, Path], *, max_shard_size: Optional[str] = None, **kwargs) -> Path:
    """Build the tiny pipeline of ``architecture`` (a key of :data:`TINY_BUILDERS`) and ``save_pretrained`` it.

    ``max_shard_size`` (e.g. "100KB") saves the transformer as a sharded safetensors checkpoint with an
    index file, as the real Qwen-Image / FLUX checkpoints are. Returns the directory.
    """
    if architecture not in TINY_BUILDERS:
        raise KeyError(f"tiny architecture {architecture!r} is unknown; choose one of {sorted(TINY_BUILDERS)}")
    path = Path(path)
    pipe = TINY_BUILDERS[architecture](**kwargs)
    pipe.save_pretrained(str(path), safe_serialization=True)
    if max_shard_size is not None:
        import shutil

        shutil.rmtree(path / "transformer")
        pipe.transformer.save_pretrained(str(path / "transformer"), safe_serialization=True,
                                         max_shard_size=max_shard_size)
    return path
