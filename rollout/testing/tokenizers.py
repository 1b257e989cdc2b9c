"""Tokenizers made in code for the tiny copies (`rollout.testing.builders`): nothing is downloaded.

Each is the real tokenizer class with a vocabulary learnt here from a small English corpus (Qwen-Image's
system prompt and the words test prompts use): byte-level BPE for CLIP and Qwen2 (so any text
tokenizes), a Unigram of words and printable characters for T5.
"""

import re

from tokenizers.pre_tokenizers import ByteLevel
from transformers import CLIPTokenizer, Qwen2Tokenizer, T5TokenizerFast

# Qwen-Image's system prompt (QwenImagePipeline.prompt_template_encode). Its words double as the
# English vocabulary of every tiny tokenizer, together with a few words that test prompts use.
_QWEN_SYSTEM_PROMPT = (
    "Describe the image by detailing the color, shape, size, texture, quantity, text, "
    "spatial relationships of the objects and background:"
)
# Qwen-Image-Edit's (QwenImageEditPipeline.prompt_template_encode): its words make the 64 tokens the
# pipeline drops, as the real tokenizer makes them.
_QWEN_EDIT_SYSTEM_PROMPT = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), then "
    "explain how the user's text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where appropriate."
)
_PROMPT_WORDS = "a photo of a cat sitting on a red chair next to a dog in the garden"
_CORPUS = f"{_QWEN_SYSTEM_PROMPT} {_PROMPT_WORDS}"
# The 256 byte-level symbols, in GPT-2's id order (which is their code point order): every byte
# string is spelt with them, so any text tokenizes with a byte-level BPE.
_BYTE_SYMBOLS = sorted(ByteLevel.alphabet())


def _learn_merges(words: list[list[str]]) -> list[tuple[str, str]]:
    """BPE merges, in rank order, that turn each word (a list of initial symbols) into one token.

    Words are taken in turn: a word is first split by the merges learnt so far, then its remaining
    symbols are merged left to right by new, lower-priority merges, which therefore never fire
    before the earlier ones and leave the words already learnt whole.
    """
    ranks: dict[tuple[str, str], int] = {}
    for symbols in words:
        symbols = _apply_merges(symbols, ranks)
        while len(symbols) > 1:
            ranks.setdefault((symbols[0], symbols[1]), len(ranks))
            symbols = [symbols[0] + symbols[1], *symbols[2:]]
    return list(ranks)


def _apply_merges(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Split a word as BPE does: merge the adjacent pair of lowest rank until none is known."""
    while True:
        pairs = [(ranks[pair], i) for i, pair in enumerate(zip(symbols, symbols[1:])) if pair in ranks]
        if not pairs:
            return symbols
        _, i = min(pairs)
        symbols = [*symbols[:i], symbols[i] + symbols[i + 1], *symbols[i + 2 :]]


def _pre_tokens(tokenizer, text: str) -> list[str]:
    """`text` as the tokenizer's own normalizer and pre-tokenizer split it (byte-level mapped)."""
    backend = tokenizer.backend_tokenizer
    if backend.normalizer is not None:
        text = backend.normalizer.normalize_str(text)
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


def tiny_clip_tokenizer(pad_token: str = "<|endoftext|>") -> CLIPTokenizer:
    """CLIP-style byte-level BPE: lowercased words, end-of-word suffix `</w>`, 77 tokens."""
    specials = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>"}
    bare = CLIPTokenizer(vocab={s: i for i, s in enumerate(_BYTE_SYMBOLS)}, merges=[], **specials)
    # CLIP's BPE marks the last symbol of each word.
    words = [[*word[:-1], word[-1] + "</w>"] for word in _pre_tokens(bare, _CORPUS)]
    merges = _learn_merges(words)
    # Like CLIP's vocabulary: bytes, bytes ending a word, merge results, then the special tokens.
    symbols = [*_BYTE_SYMBOLS, *(s + "</w>" for s in _BYTE_SYMBOLS), *(a + b for a, b in merges)]
    symbols += [specials["bos_token"], specials["eos_token"]]
    vocab = {s: i for i, s in enumerate(dict.fromkeys(symbols))}
    return CLIPTokenizer(vocab=vocab, merges=merges, pad_token=pad_token, model_max_length=77, **specials)


def tiny_t5_tokenizer() -> T5TokenizerFast:
    """T5-style Unigram: `<pad>`, `</s>`, `<unk>` at ids 0-2, then `▁`-prefixed words and characters.

    Like the real T5 (and because `T5TokenizerFast` rebuilds its model without byte fallback on
    load), characters outside printable ASCII become `<unk>`.
    """
    specials = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    # Scores are log-probabilities: a whole word beats spelling it with single characters.
    characters = [("▁", -4.0)] + [(chr(c), -8.0) for c in range(33, 127)]
    words = [(f"▁{word}", -6.0) for word in dict.fromkeys(re.findall(r"[A-Za-z]+", _CORPUS))]
    return T5TokenizerFast(vocab=specials + characters + words, extra_ids=0, model_max_length=512)


_QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_qwen2_tokenizer(edit: bool = False) -> Qwen2Tokenizer:
    """Qwen2-style byte-level BPE (case kept, spaces glued to the next word) with the chat tokens;
    `edit`: learnt on Qwen-Image-Edit's system prompt instead of Qwen-Image's."""
    bare = Qwen2Tokenizer(vocab={s: i for i, s in enumerate(_BYTE_SYMBOLS)}, merges=[])
    # The text of Qwen-Image's chat template between its special tokens, so that its system prefix
    # comes to one token per word, as with the real tokenizer (see `rollout.testing.builders.build_tiny_qwenimage`).
    system = _QWEN_EDIT_SYSTEM_PROMPT if edit else _QWEN_SYSTEM_PROMPT
    corpus = f"system\n{system}\nuser\nassistant\n {_PROMPT_WORDS}"
    merges = _learn_merges([list(word) for word in _pre_tokens(bare, corpus)])
    symbols = [*_BYTE_SYMBOLS, *(a + b for a, b in merges), *_QWEN_SPECIAL_TOKENS, *_QWEN_VISION_TOKENS]
    vocab = {s: i for i, s in enumerate(dict.fromkeys(symbols))}
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>", *_QWEN_VISION_TOKENS],
        model_max_length=131072,
    )
