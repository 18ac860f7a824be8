"""Parts the tiny pipelines of every architecture share: in-memory tokenizers, RoPE axes, the real scheduler and
VAE constants. Each architecture's ``build_tiny_pipeline`` (models/<architecture>.py) assembles its pipeline from
these; models/tiny.py indexes the builders.

The CLIP, T5 and Qwen tokenizers are built from an in-memory vocabulary (characters; byte-level BPE for Qwen), so
nothing is downloaded.
"""

from __future__ import annotations

import string

# Characters the tiny tokenizers know; anything else maps to <unk> (T5) or is dropped by byte-level BPE.
_CHARS = sorted(set(string.ascii_lowercase + string.digits + ".,!?'-:\"()"))

# SD3's VAE constants (diffusers' sd3 vae config); kept so decode exercises the real scale/shift path.
SD3_VAE_SCALING_FACTOR = 1.5305
SD3_VAE_SHIFT_FACTOR = 0.0609


# FLUX.1's VAE constants (its ae config), so decode exercises the real scale/shift path.
FLUX_VAE_SCALING_FACTOR = 0.3611
FLUX_VAE_SHIFT_FACTOR = 0.1159


def clip_bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
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


def word_merges(words) -> list[tuple[str, str]]:
    """BPE merges under which every word of ``words`` is one token.

    Each word is encoded with the merges so far; while it is several tokens, the merge of its first two tokens is
    appended (lowest priority, so words already whole stay whole: a whole word has no pair left to merge).
    """
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in words:
        parts = clip_bpe(word, ranks)
        while len(parts) > 1:
            ranks[(parts[0], parts[1])] = len(merges)
            merges.append((parts[0], parts[1]))
            parts = clip_bpe(word, ranks)
    return merges


def clip_tokenizer(max_length: int, words=()):
    """Character-level CLIP tokenizer; with ``words`` (lower-case), each of them is also one whole token."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        vocab[c] = len(vocab)
        vocab[c + "</w>"] = len(vocab)
    merges = word_merges(words)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)


def t5_tokenizer(max_length: int, words=()):
    """Character-level T5 (unigram) tokenizer; with ``words``, each of them is one whole ``▁word`` piece (its
    score beats any split into characters)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -1.0)]
    pieces += [(c, -2.0) for c in _CHARS] + [("▁" + c, -1.5) for c in _CHARS]
    known = {p for p, _ in pieces}
    pieces += [("▁" + w, -1.0) for w in dict.fromkeys(words) if "▁" + w not in known]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)


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
QWEN_SPECIALS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|vision_start|>", "<|vision_end|>",
                  "<|image_pad|>", "<|video_pad|>")
# Qwen3's chat template, reduced to what Flux2KleinPipeline uses (user turns, generation prompt, thinking off).
_QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def qwen_tokenizer(max_length: int):
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
    tok.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIALS)})
    tok.chat_template = _QWEN3_CHAT_TEMPLATE
    return tok


# Qwen-Image's FlowMatchEulerDiscreteScheduler config (dynamic, exponential shift with a terminal time).
QWEN_IMAGE_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=8192, max_shift=0.9,
                            num_train_timesteps=1000, shift=1.0, shift_terminal=0.02, time_shift_type="exponential",
                            use_dynamic_shifting=True)
# FLUX.1-dev's and FLUX.2's scheduler config (dynamic, exponential shift).
FLUX_SCHEDULER = dict(base_image_seq_len=256, base_shift=0.5, max_image_seq_len=4096, max_shift=1.15,
                      num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, time_shift_type="exponential")


def rope_axes(head_dim: int, n: int) -> tuple[int, ...]:
    """RoPE axis sizes (even, summing to ``head_dim``) for ``n`` position axes, the first one smallest."""
    rest = (head_dim - 2 * (head_dim // (2 * n))) // (n - 1) // 2 * 2
    first = head_dim - (n - 1) * rest
    return (first, *([rest] * (n - 1)))
