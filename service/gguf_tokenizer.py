"""Tokenizers built from a GGUF file's metadata (llama.cpp's `tokenizer.ggml.*` keys), the way
transformers' GGUF integration builds them, with the `tokenizers` library alone:

- `gpt2`: byte-level BPE from the file's vocabulary and merges, split as `tokenizer.ggml.pre`
  names (Llama 3, Qwen, SmolLM);
- `llama`: SentencePiece BPE (Llama 1/2, Mistral, TinyLlama; Gemma's files too): the `▁`
  metaspace, byte fallback to the <0xNN> tokens, merges rebuilt from the vocabulary ranked by
  the file's scores. Gemma's files (architecture gemma*) differ: no space prefix, spaces turned
  into `▁` by a normalizer and split after, runs of spaces stored as spaces, and merges
  ranked by position in the file (Gemma's scores do not follow its merge order).

Both match whole in text the file's control tokens (token_type 3: <|im_end|>, <start_of_turn>)
and its bos/eos/unk/pad tokens as special, and its user-defined ones (4: <think>) as plain
added tokens; `tokenizer.ggml.add_bos_token` / `add_eos_token` decide what `add_special_tokens`
adds (a SentencePiece file that does not say gets a BOS, as in llama.cpp).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers,
                        pre_tokenizers, processors)

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4

# Split regexes for `tokenizer.ggml.pre`, the same ones llama.cpp and transformers use.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_REGEX_SPLITS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"),
                    _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
# GPT-2's regex after putting every digit on its own (llama.cpp: starcoder, refact, smollm).
_DIGIT_SPLITTING = ("smollm", "starcoder", "refact", "codeshell")
# SentencePiece's stand-in for a space.
_METASPACE = "\u2581"
SUPPORTED_MODELS = ("gpt2", "llama")  # tokenizer.ggml.model


class TokenizerLoadError(ValueError):
    """The model path has no tokenizer we can build; the message says what is missing."""


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte (the byte-level BPE alphabet)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_level_pre_tokenizer(pre: str | None):
    if pre in _DIGIT_SPLITTING:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                 use_regex=True)])
    if pre in _REGEX_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_REGEX_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # "default", "gpt2" and anything unknown: GPT-2's own split, as transformers does.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def gguf_tokenizer_metadata(path: Path) -> dict[str, Any]:
    from ipc.gguf_file import GGUFFile  # the gguf package, only for GGUF models

    try:
        reader = GGUFFile(path)
    except Exception as e:
        reason = str(e).rstrip(".")
        raise TokenizerLoadError(f"could not read GGUF file {path}: {reason}. The file looks "
                                 f"truncated or corrupt; download it again.") from e
    return {key: value for key, value in reader.fields.items()
            if key.startswith("tokenizer.") or key == "general.architecture"}


def build_gguf_tokenizer(meta: dict[str, Any], path: Path, architecture: str = "") -> Tokenizer:
    """The tokenizer of a GGUF's `tokenizer.*` metadata; `architecture`: general.architecture."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise TokenizerLoadError(
            f"{path}: tokenizer model '{kind}' is not supported; supported: byte-level BPE "
            f"('gpt2': Llama 3, SmolLM, Qwen) and SentencePiece ('llama': Llama 2, Mistral, "
            f"Gemma). Use the model's Hugging Face directory (with tokenizer.json) instead.")
    if kind == "gpt2":
        return _byte_level_tokenizer(meta, path)
    return _sentencepiece_tokenizer(meta, path, gemma=architecture.startswith("gemma"))


def _byte_level_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerLoadError(f"{path} has a BPE vocabulary but no tokenizer.ggml.merges")
    alphabet = byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        # Every byte-level token is written in the byte alphabet; a few files store some as raw
        # text, so respell those (as transformers does) or they could never be produced.
        if not set(token) <= spelled:
            token = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tok.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    # A "control" token outside the byte alphabet is a llama.cpp mislabel that would grow the
    # vocabulary, so it is skipped, as in transformers.
    control = [t for t, ty in zip(tokens, types) if ty == _CONTROL and set(t) <= spelled]
    _add_special_tokens(tok, meta, control, add_bos_default=False)
    return tok


def _sentencepiece_tokenizer(meta: dict[str, Any], path: Path, gemma: bool) -> Tokenizer:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    if gemma:  # Gemma stores a token of 2+ spaces as spaces; its text has them as metaspaces
        tokens = [_METASPACE * len(t) if len(t) > 1 and not t.strip(" ") else t for t in tokens]
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    if gemma:
        ranks = {t: -i for i, t in enumerate(tokens)}  # earlier in the file: merged first
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None or len(scores) != len(tokens):
            raise TokenizerLoadError(f"{path} has a SentencePiece vocabulary but no "
                                     f"tokenizer.ggml.scores for its {len(tokens)} tokens")
        ranks = dict(zip(tokens, scores))
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_scores(vocab, ranks),
                               fuse_unk=True, byte_fallback=True,
                               unk_token=tokens[unk] if gemma and unk is not None else None))
    replace_space = decoders.Replace(_METASPACE, " ")
    if gemma:
        tok.normalizer = normalizers.Replace(" ", _METASPACE)
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        tok.decoder = decoders.Sequence([replace_space, decoders.ByteFallback(),
                                         decoders.Fuse()])
    else:
        # A space before the first word (llama.cpp's add_space_prefix, on unless the file says
        # otherwise), taken off again when decoding.
        prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_METASPACE, prepend_scheme="first" if prefix else "never", split=False)
        steps = [replace_space, decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    control = [t for t, ty in zip(tokens, types) if ty == _CONTROL]
    named = [tokens[i] for key in ("bos", "eos", "unknown", "padding")
             if (i := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None
             and 0 <= i < len(tokens)]
    _add_special_tokens(tok, meta, [*named, *control], add_bos_default=True)
    return tok


def merges_from_scores(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (transformers' `generate_merges`):
    every split of a token into two tokens, best-ranked result first, then shorter left part,
    then shorter right part; ties in vocabulary order."""
    merges = []
    for piece, rank in ranks.items():
        local = [(piece[:i], piece[i:], rank) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _add_special_tokens(tok: Tokenizer, meta: dict[str, Any], special: list[str],
                        add_bos_default: bool) -> None:
    """`special` (control tokens: <|im_start|>, <|eot_id|>) and user-defined ones (<think>) are
    matched whole in text, never cut into pieces; BOS/EOS are added as the file says."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = tok.get_vocab()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t in dict.fromkeys(special)])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    single, pieces = "$A", []
    if meta.get("tokenizer.ggml.add_bos_token", add_bos_default) and bos is not None:
        single, pieces = f"{tokens[bos]} {single}", [*pieces, (tokens[bos], int(bos))]
    if meta.get("tokenizer.ggml.add_eos_token") and eos is not None:
        single, pieces = f"{single} {tokens[eos]}", [*pieces, (tokens[eos], int(eos))]
    if pieces:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=pieces)
