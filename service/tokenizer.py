"""Text <-> token ids for the scheduler, read straight from the model's own files.

The scheduler never imports `gpu`, so this module reads what it needs itself:
- a `.gguf` file: the vocabulary, merges and special tokens in its metadata become a
  `tokenizers.Tokenizer` (byte-level BPE or SentencePiece, built the way transformers' GGUF
  converter builds it: service/gguf_tokenizer.py), its chat template that of the metadata;
- an HF directory: `tokenizer.json`, plus `tokenizer_config.json` / `chat_template.jinja` for the
  chat template and special tokens, and `config.json` / `generation_config.json` for stop ids.
"""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Iterable, Sequence

from tokenizers import Tokenizer

from service.chat_template import CHATML_TEMPLATE, ChatTemplate
from service.gguf_tokenizer import (TokenizerLoadError, build_gguf_tokenizer,
                                    gguf_tokenizer_metadata)
from service.gguf_tokenizer import byte_alphabet as _byte_alphabet
from service.tokenizer_cache import cached_tokenizer

# For `max_bytes_per_token`: pre-tokenizers that only split text (a Split or Punctuation whose
# behavior is "Removed" drops it, as Whitespace and BertPreTokenizer do), and normalizers that
# shorten text by at most _SHRINK (NFKC turns a fullwidth letter, 3 bytes, into 1; Hangul jamo
# compose 3 to 1; Lowercase "ẞ" 3 bytes to "ß" 2).
_SPLITTING_PRE_TOKENIZERS = frozenset({"Sequence", "ByteLevel", "Digits", "Metaspace", "Split",
                                       "Punctuation", "UnicodeScripts"})
_BOUNDED_NORMALIZERS = frozenset({"Sequence", "NFC", "NFD", "NFKC", "NFKD", "Lowercase",
                                  "Prepend", "Replace"})
_SHRINK = 4


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
            st = source.stat()
            return _gguf_tokenizer(str(source), st.st_size, st.st_mtime_ns)
        if source.is_dir():
            return cls.from_hf_dir(source)
        raise TokenizerLoadError(f"cannot load a tokenizer from {source}: expected a .gguf file "
                                 f"or a Hugging Face model directory with tokenizer.json")

    @classmethod
    def from_gguf(cls, path: Path) -> TextTokenizer:
        meta = gguf_tokenizer_metadata(path)
        if "tokenizer.ggml.tokens" not in meta:
            raise TokenizerLoadError(f"{path} has no tokenizer in its metadata "
                                     f"(tokenizer.ggml.tokens is missing)")
        tokens = meta["tokenizer.ggml.tokens"]
        backend = cached_tokenizer(path, len(tokens), lambda: build_gguf_tokenizer(
            meta, path, meta.get("general.architecture") or ""))

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


@lru_cache(maxsize=4)
def _gguf_tokenizer(path: str, size: int, mtime_ns: int) -> TextTokenizer:
    """One reading of a GGUF's tokenizer per file and version in a process (0.6 s for 49k
    tokens on 2 cores): a process that builds several engines on one file (benchmarks, tests)
    parses its vocabulary once. Shared, so never changed after construction."""
    return TextTokenizer.from_gguf(Path(path))
