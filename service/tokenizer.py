"""Text <-> token ids for the scheduler, read straight from the model's own files.

The scheduler never imports `gpu`, so this module reads what it needs itself:
- a `.gguf` file: the vocabulary, merges and special tokens in its metadata become a
  `tokenizers.Tokenizer` (byte-level BPE, built the way transformers' GGUF converter builds it);
- an HF directory: `tokenizer.json`, plus `tokenizer_config.json` / `chat_template.jinja` for the
  chat template and special tokens, and `config.json` / `generation_config.json` for stop ids.
"""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from service.chat_template import CHATML_TEMPLATE, ChatTemplate

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

# For `max_bytes_per_token`: pre-tokenizers that only split text (a Split or Punctuation whose
# behavior is "Removed" drops it, as Whitespace and BertPreTokenizer do), and normalizers that
# shorten text by at most _SHRINK (NFKC turns a fullwidth letter, 3 bytes, into 1; Hangul jamo
# compose 3 to 1; Lowercase "ẞ" 3 bytes to "ß" 2).
_SPLITTING_PRE_TOKENIZERS = frozenset({"Sequence", "ByteLevel", "Digits", "Metaspace", "Split",
                                       "Punctuation", "UnicodeScripts"})
_BOUNDED_NORMALIZERS = frozenset({"Sequence", "NFC", "NFD", "NFKC", "NFKD", "Lowercase",
                                  "Prepend", "Replace"})
_SHRINK = 4


class TokenizerLoadError(ValueError):
    """The model path has no tokenizer we can build; the message says what is missing."""


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
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


def _gguf_metadata(path: Path) -> dict[str, Any]:
    from ipc.gguf_file import GGUFFile  # the gguf package, only for GGUF models

    try:
        reader = GGUFFile(path)
    except Exception as e:
        reason = str(e).rstrip(".")
        raise TokenizerLoadError(f"could not read GGUF file {path}: {reason}. The file looks "
                                 f"truncated or corrupt; download it again.") from e
    return {key: value for key, value in reader.fields.items() if key.startswith("tokenizer.")}


def _build_gguf_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer:
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerLoadError(
            f"{path}: tokenizer model '{kind}' is not supported; only byte-level BPE ('gpt2', "
            f"used by Llama 3, SmolLM, Qwen) can be built from GGUF metadata. Use the model's "
            f"Hugging Face directory (with tokenizer.json) instead.")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise TokenizerLoadError(f"{path} has a BPE vocabulary but no tokenizer.ggml.merges")
    alphabet = _byte_alphabet()
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
    # Control tokens (<|im_start|>, <|eot_id|>) and user-defined ones (<think>) are matched whole
    # in text, never cut into bytes. A "control" token outside the byte alphabet is a llama.cpp
    # mislabel that would grow the vocabulary, so it is skipped, as in transformers.
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types)
                            if ty == _CONTROL and set(t) <= spelled])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED and t in vocab])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    single, special = "$A", []
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        single, special = f"{tokens[bos]} {single}", [*special, (tokens[bos], int(bos))]
    if meta.get("tokenizer.ggml.add_eos_token") and eos is not None:
        single, special = f"{single} {tokens[eos]}", [*special, (tokens[eos], int(eos))]
    if special:
        tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special)
    return tok


def _components(node: dict | None) -> list[dict]:
    """A normalizer or pre-tokenizer of tokenizer.json and, for a Sequence, everything in it."""
    if not node:
        return []
    out = [node]
    for child in (node.get("pretokenizers") or []) + (node.get("normalizers") or []):
        out += _components(child)
    return out


def _token_bound(backend: Tokenizer) -> tuple[int, str] | None:
    """(the most bytes of text one token can stand for, the characters it drops), or None when
    no such bound holds: a word-level or unigram model, a BPE without byte-level pre-tokenizer
    or byte fallback (its unknown token may stand for any run of text), a pre-tokenizer that
    drops text, an added token that swallows the whitespace beside it."""
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    pres = _components(spec.get("pre_tokenizer"))
    norms = _components(spec.get("normalizer"))
    byte_level = any(p.get("type") == "ByteLevel" for p in pres)
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    if any(p.get("type") not in _SPLITTING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
           for p in pres):
        return None
    for n in norms:
        pattern = (n.get("pattern") or {}).get("String") if n.get("type") == "Replace" else ""
        if n.get("type") not in _BOUNDED_NORMALIZERS or pattern is None or len(
                (n.get("content") or "").encode()) < len(pattern.encode()):
            return None  # unknown, or a Replace that may shorten text without bound
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    vocab = backend.get_vocab(with_added_tokens=True)
    alphabet = set(_byte_alphabet().values())
    # A byte no token spells is dropped: SmolLM2 has no token for 6 ASCII control characters
    # (counted out of the text) nor for the lead bytes 0xF1 and 0xF2 (unassigned planes: a
    # character of n bytes then still keeps n - 1 >= n / 2). Bytes that valid UTF-8 never
    # holds do not matter; a missing continuation byte could drop part of any character.
    unspelled = [b for b, c in _byte_alphabet().items() if byte_level and c not in vocab]
    if any(0x80 <= b < 0xC0 for b in unspelled):
        return None
    halved = any(0xC2 <= b < 0xF5 for b in unspelled)
    # A byte-level token spells one byte per character; anything else is at most its UTF-8
    # (byte fallback's "<0x41>" and Metaspace's "▁" stand for fewer bytes than they have).
    longest = max(len(t) if byte_level and set(t) <= alphabet else len(t.encode())
                  for t in vocab)
    factor = (_SHRINK if norms else 1) * (2 if halved else 1)
    return longest * factor, "".join(chr(b) for b in unspelled if b < 0x80)


def _read_json(file: Path) -> dict:
    if not file.is_file():
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"could not read {file}: {e}") from e


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _hf_chat_template(directory: Path, config: dict) -> str | None:
    jinja_file = directory / "chat_template.jinja"  # transformers >= 4.50 saves it here
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template


class TextTokenizer:
    """Encode, decode and render chats for one model."""

    def __init__(self, backend: Tokenizer, *, bos_token: str | None, eos_tokens: Sequence[str],
                 eos_token_ids: Sequence[int], chat_template: str | None, source: Path,
                 unk_token: str | None = None, pad_token: str | None = None) -> None:
        self._tok = backend
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_tokens[0] if eos_tokens else None
        self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
        ids = [*eos_token_ids, *(backend.token_to_id(t) for t in eos_tokens)]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(i for i in ids if i is not None))
        self.has_chat_template = chat_template is not None
        special = {"bos_token": bos_token, "eos_token": self.eos_token, "unk_token": unk_token,
                   "pad_token": pad_token}
        name = f"chat template of {source}" if chat_template else "fallback ChatML chat template"
        self.chat_template = ChatTemplate(chat_template or CHATML_TEMPLATE, name, special)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_model_path(cls, path: str | Path) -> TextTokenizer:
        source = Path(path).expanduser()
        if source.is_file() and source.suffix.lower() == ".gguf":
            return cls.from_gguf(source)
        if source.is_dir():
            return cls.from_hf_dir(source)
        raise TokenizerLoadError(f"cannot load a tokenizer from {source}: expected a .gguf file "
                                 f"or a Hugging Face model directory with tokenizer.json")

    @classmethod
    def from_gguf(cls, path: Path) -> TextTokenizer:
        meta = _gguf_metadata(path)
        if "tokenizer.ggml.tokens" not in meta:
            raise TokenizerLoadError(f"{path} has no tokenizer in its metadata "
                                     f"(tokenizer.ggml.tokens is missing)")
        backend = _build_gguf_tokenizer(meta, path)
        tokens = meta["tokenizer.ggml.tokens"]

        def token(key: str) -> str | None:
            i = meta.get(f"tokenizer.ggml.{key}")
            return None if i is None or not 0 <= i < len(tokens) else tokens[i]

        stop_ids = [meta[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot", "eom")
                    if meta.get(f"tokenizer.ggml.{k}_token_id") is not None]
        return cls(backend, bos_token=token("bos_token_id"),
                   eos_tokens=[t for t in [token("eos_token_id")] if t is not None],
                   eos_token_ids=[int(i) for i in stop_ids],
                   chat_template=meta.get("tokenizer.chat_template"), source=path,
                   unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"))

    @classmethod
    def from_hf_dir(cls, directory: Path) -> TextTokenizer:
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(f"{directory} has no tokenizer.json; only fast (tokenizers) "
                                     f"tokenizers are supported, not tokenizer.model alone")
        try:
            backend = Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:
            raise TokenizerLoadError(f"could not read {tokenizer_file}: {e}") from e
        tok_config = _read_json(directory / "tokenizer_config.json")
        model_config = _read_json(directory / "config.json")
        gen_config = _read_json(directory / "generation_config.json")
        bos = _token_text(tok_config.get("bos_token"))
        if bos is None and model_config.get("bos_token_id") is not None:
            bos = backend.id_to_token(int(model_config["bos_token_id"]))
        eos = _token_text(tok_config.get("eos_token"))
        # The model's stop ids: generation_config.json lists every end-of-turn token (Llama 3
        # instruct stops on <|eot_id|>, which is not the tokenizer's eos_token).
        stop_ids = (_as_ids(gen_config.get("eos_token_id"))
                    + _as_ids(model_config.get("eos_token_id")))
        return cls(backend, bos_token=bos, eos_tokens=[eos] if eos else [], eos_token_ids=stop_ids,
                   chat_template=_hf_chat_template(directory, tok_config), source=directory,
                   unk_token=_token_text(tok_config.get("unk_token")),
                   pad_token=_token_text(tok_config.get("pad_token")))

    # -- tokens -----------------------------------------------------------------------------

    @property
    def backend(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` itself (service/detokenizer.py streams with it)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def token_bound(self) -> tuple[int, str] | None:
        """(no token stands for more UTF-8 bytes of text than this, characters that become no
        token); None where the tokenizer gives no such bound. See `min_tokens`."""
        return _token_bound(self._tok)

    def min_tokens(self, text: str) -> int:
        """At least this many tokens would `encode(text)` give (0: no bound known), found
        without tokenizing: its UTF-8 bytes over the most that one token stands for."""
        if self.token_bound is None:
            return 0
        per_token, dropped = self.token_bound
        size = len(text.encode()) - sum(text.count(c) for c in dropped)  # ASCII: 1 byte each
        return -(-size // per_token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Special tokens written in `text` (like "<|im_end|>") become their ids; with
        `add_special_tokens` the model's own prefix/suffix (a BOS for Llama) is added."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_in_thread(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """`encode` for a worker thread. tokenizers' `encode` holds the GIL while it works (an
        8 MB text: 6 s during which no other thread ran, measured); `encode_batch` releases it
        and costs the same."""
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # -- chats ------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: list[dict[str, Any]],
                    add_generation_prompt: bool = True) -> list[int]:
        # The rendered text already holds the template's special tokens (BOS included, when the
        # template writes one), so nothing more is added: transformers does the same.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt),
                           add_special_tokens=False)

