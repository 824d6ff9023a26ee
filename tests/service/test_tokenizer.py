"""Tokenizer, chat template and streaming detokenizer against transformers' tokenizer for the same
files (its GGUF converter and `apply_chat_template` are the independent reference)."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import pytest
from transformers import AutoTokenizer

from service.chat_template import ChatTemplate, ChatTemplateError
from service.detokenizer import IncrementalDetokenizer
from service.tokenizer import TextTokenizer, TokenizerLoadError
from tests.hf_reference import hf_tokenizer


TEXTS = [
    "Hello, world!",
    "12345 and 3.14159, 1,000,000 or 2024-01-31",
    "def square(x):\n    return x ** 2  # comment\n\n\tprint(square(12))",
    "I 😀 love 🎉 emoji 👨‍👩‍👧 and flags 🇫🇷",
    "中文测试，日本語のテキスト、한국어 문장",
    "  leading, and   runs   of spaces\n\n\n  trailing  ",
    "<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>",
    "don't I'll we've THEY'RE",
    "ÀÉÎõü ß ﬁ café naïve",
    "\u00a0no-break\u2003em-space\ttab\r\nCRLF",
    " ",
    "",
    "x=1;y=22;z=333;w=4444;v=55555",
    "<repo_name>fmserve<file_sep>main.py",
]

CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of France?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 😀"},
     {"role": "user", "content": "写一首诗"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "a"},
     {"role": "assistant", "content": "b"}, {"role": "user", "content": "c <|im_end|> d"}],
]

STREAM_TEXT = ("Streaming 😀🎉 test: 中文测试，日本語のテキスト 👨‍👩‍👧‍👦 done. "
               "Ünïcödé, 한국어, emoji 🇯🇵🦀 and 数字 12345.")


@pytest.fixture(scope="module")
def ours(gguf_path) -> TextTokenizer:
    return TextTokenizer.from_model_path(gguf_path)


@pytest.fixture(scope="module")
def reference(gguf_path):
    return hf_tokenizer(gguf_path)


def _ids(out) -> list[int]:
    """apply_chat_template(tokenize=True) returns a BatchEncoding in transformers 5."""
    return list(out["input_ids"] if hasattr(out, "keys") else out)


# -- encoding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, reference, text):
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == reference.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours, reference, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
        ids, skip_special_tokens=True)


def test_special_tokens_and_vocab(ours, reference):
    assert ours.vocab_size == len(reference)
    assert ours.bos_token_id == reference.bos_token_id
    assert reference.eos_token_id in ours.eos_token_ids
    for token_id in (0, 1, 2, 100, 4093, ours.vocab_size - 1):
        token = ours.id_to_token(token_id)
        assert token == reference.convert_ids_to_tokens(token_id)
        assert ours.token_to_id(token) == token_id


# -- chat template -----------------------------------------------------------------------------

@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_matches_transformers(ours, reference, chat, add_generation_prompt):
    text = reference.apply_chat_template(chat, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(chat, add_generation_prompt=add_generation_prompt) == text
    ids = _ids(reference.apply_chat_template(chat, tokenize=True,
                                             add_generation_prompt=add_generation_prompt))
    assert ours.encode_chat(chat, add_generation_prompt=add_generation_prompt) == ids


def test_template_errors_name_the_template():
    with pytest.raises(ChatTemplateError, match="my template does not compile"):
        ChatTemplate("{% for m in messages %}", name="my template")
    failing = ChatTemplate("{{ raise_exception('roles must alternate') }}", name="strict template")
    with pytest.raises(ChatTemplateError, match="strict template.*roles must alternate"):
        failing.render([{"role": "user", "content": "x"}])


def test_fallback_chatml_matches_transformers(tmp_path, reference):
    """A model without a template gets ChatML; transformers with that template is the reference."""
    reference.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    ours = TextTokenizer.from_model_path(tmp_path)
    assert not ours.has_chat_template
    chatml = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
              "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt "
              "%}{{ '<|im_start|>assistant\n' }}{% endif %}")
    for chat in CHATS:
        expected = reference.apply_chat_template(chat, chat_template=chatml, tokenize=False,
                                                 add_generation_prompt=True)
        assert ours.apply_chat_template(chat) == expected


# -- other sources -----------------------------------------------------------------------------

def test_hf_directory_tokenizer_matches_transformers(tmp_path, reference):
    reference.save_pretrained(tmp_path)
    hf_ref = AutoTokenizer.from_pretrained(tmp_path)
    ours = TextTokenizer.from_model_path(tmp_path)
    for text in TEXTS:
        assert ours.encode(text) == hf_ref.encode(text, add_special_tokens=False)
    for chat in CHATS:
        assert ours.encode_chat(chat) == _ids(hf_ref.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=True))
    assert ours.bos_token_id == hf_ref.bos_token_id
    assert hf_ref.eos_token_id in ours.eos_token_ids


def _write_tokenizer_gguf(path: Path, source: Path, pre: str, add_bos: bool) -> None:
    """The source model's vocabulary under another pre-tokenizer name, and nothing else."""
    reader = gguf.GGUFReader(source)
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(16)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama3_pre_tokenizer_and_bos_match_transformers(tmp_path, gguf_path):
    """Llama 3's split regex ("llama-bpe") and a vocabulary that asks for a BOS token."""
    file = tmp_path / "vocab-llama-bpe.gguf"
    _write_tokenizer_gguf(file, gguf_path, "llama-bpe", add_bos=True)
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=file.name)
    ours = TextTokenizer.from_model_path(file)
    for text in TEXTS + ["Hello\n\n  world's ...!!! X", "don't\r\n\tY  \n z"]:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), text
    assert ours.encode("x", add_special_tokens=True)[0] == ours.bos_token_id
    assert not ours.has_chat_template


def test_a_ggufs_tokenizer_is_read_once_a_process_until_the_file_changes(tmp_path, gguf_path):
    file = tmp_path / "vocab.gguf"
    _write_tokenizer_gguf(file, gguf_path, "llama-bpe", add_bos=True)
    first = TextTokenizer.from_model_path(file)
    assert TextTokenizer.from_model_path(str(file)) is first
    st = file.stat()
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # rewritten in place
    again = TextTokenizer.from_model_path(file)
    assert again is not first
    assert again.encode("Hello world", add_special_tokens=True) == first.encode(
        "Hello world", add_special_tokens=True)


def test_unsupported_tokenizer_model(tmp_path):
    file = tmp_path / "wpm.gguf"
    writer = gguf.GGUFWriter(file, "bert")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[UNK]", "[CLS]", "[SEP]", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(TokenizerLoadError, match=r"wpm.gguf.*'bert' is not supported"):
        TextTokenizer.from_model_path(file)


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerLoadError, match="tokenizer.json"):
        TextTokenizer.from_model_path(tmp_path)


# -- streaming ---------------------------------------------------------------------------------

def test_incremental_detokenizer_streams_whole_characters(ours):
    ids = ours.encode(STREAM_TEXT)
    # The text must really split characters across tokens, or this test proves nothing.
    assert any("\ufffd" in ours.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(ours)
    pieces = [detok.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == ours.decode(ids) == STREAM_TEXT
    assert detok.text == STREAM_TEXT


def test_incremental_detokenizer_skips_special_tokens(ours, reference):
    ids = ours.encode_chat(CHATS[2], add_generation_prompt=False)
    detok = IncrementalDetokenizer(ours, skip_special_tokens=True)
    streamed = "".join(detok.push(i) for i in ids) + detok.flush()
    assert streamed == reference.decode(ids, skip_special_tokens=True)
    assert "<|im_start|>" not in streamed


def test_incremental_detokenizer_flush_returns_held_back_bytes(ours):
    ids = ours.encode("😀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(ours)
    assert [detok.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.flush() == ours.decode(ids[:-1])  # the incomplete character, as U+FFFD


class PythonWindowDetokenizer:
    """The detokenizer the service used before DecodeStream, kept as the reference: decode the
    window since the last complete point, release what is new once it is whole."""

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        full = self.tokenizer.decode(self.ids[self.prefix_offset:], self.skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]


def byte_fallback_tokenizer() -> TextTokenizer:
    """A Llama 2 style tokenizer: Metaspace "▁" for spaces, `<0x..>` byte-fallback tokens for
    what the vocabulary lacks (an emoji is four of them), the first token's space stripped."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ["▁Hello", "▁world", "▁", "Hello", "!", "▁a", "b", "é"]:
        vocab[word] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True,
                                   fuse_unk=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return TextTokenizer(backend, bos_token="<s>", eos_tokens=["</s>"], eos_token_ids=[2],
                         chat_template=None, source=Path("byte-fallback"))


@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_gives_the_python_windows_text_on_byte_level_bpe(ours, skip):
    # Split UTF-8 (emoji, CJK), leading and runs of spaces, special tokens skipped or not.
    ids = ours.encode(STREAM_TEXT + "<|im_start|>user\n  two  spaces <|im_end|> 😀")
    assert any("\ufffd" in ours.decode([i]) for i in ids) and ours.token_to_id("<|im_end|>") in ids
    ours_stream, reference = IncrementalDetokenizer(ours, skip), PythonWindowDetokenizer(ours, skip)
    assert [ours_stream.push(i) for i in ids] == [reference.push(i) for i in ids]
    # Random ids: bytes that never make a whole character, specials anywhere.
    import random

    rng = random.Random(7)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 30))]
        ours_stream, reference = IncrementalDetokenizer(ours, skip), PythonWindowDetokenizer(ours, skip)
        assert [ours_stream.push(i) for i in ids] == [reference.push(i) for i in ids], ids


@pytest.mark.parametrize("text", ["Hello world!", " Hello 😀 world é", "😀😀 a b", "  Hello"])
@pytest.mark.parametrize("skip", [True, False])
def test_decode_stream_gives_the_python_windows_text_on_byte_fallback_tokens(text, skip):
    tok = byte_fallback_tokenizer()
    ids = [1] + tok.encode(text) + [2]
    if "😀" in text:
        assert tok.token_to_id("<0xF0>") in ids  # the emoji really is split into bytes
    detok, reference = IncrementalDetokenizer(tok, skip), PythonWindowDetokenizer(tok, skip)
    pieces = [detok.push(i) for i in ids]
    assert pieces == [reference.push(i) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == tok.decode(ids, skip_special_tokens=skip)



@pytest.mark.parametrize("text", TEXTS + [
    "\x04\x06\x13\x14\x16\x1d" * 50 + "a",  # characters no token of SmolLM2 spells: dropped
    "\U00040000\U00080001" * 20,  # unassigned planes: lead bytes SmolLM2 has no token for
    "\n" + " " * 80, " " * 5000, "a" * 5000, "😀" * 300,
])
def test_min_tokens_never_exceeds_the_token_count(ours, text):
    # The service refuses a text whose min_tokens reaches the context without tokenizing it.
    assert ours.min_tokens(text) <= len(ours.encode(text))
    assert ours.encode_in_thread(text) == ours.encode(text)


def test_min_tokens_bound_is_known_only_where_it_holds(ours, tiny_llama):
    per_token, dropped = ours.token_bound  # byte-level BPE
    assert per_token >= max(len(ours.decode([i]).encode()) for i in range(ours.vocab_size))
    assert ours.min_tokens("x" * 8_000_000) == -(-8_000_000 // per_token)
    # A word-level tokenizer's unknown token stands for a word of any length: no bound.
    word_level = TextTokenizer.from_model_path(tiny_llama)
    assert word_level.token_bound is None and word_level.min_tokens("x" * 100_000) == 0
