"""SentencePiece (Llama-style and Gemma) tokenizers built from GGUF metadata against
transformers' GGUF tokenizer for the same file, on a few hundred strings: unicode, code,
whitespace runs, emoji, byte fallback, special and user-defined tokens; and the chat template
the file carries."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from service.tokenizer import TextTokenizer
from tests.service.spm_gguf import write_spm_gguf

SEEDS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "hello", " hello",
    "  two leading spaces", "trailing   ", "\n\nnewlines\n", "\ttab\tseparated\t",
    "def main():\n    print('hello world')\n    return 0\n",
    "for i in range(10):\n\tx = np.zeros((i, i))  # comment",
    "I 😀 love 🎉 emoji 👨‍👩‍👧 and flags 🇫🇷", "中文测试，日本語のテキスト、한국어 문장",
    "Les élèves étudient à l'école; café, naïve, déjà vu.", "ÀÉÎõü ß ﬁ",
    "\u00a0no-break\u2003em-space", "CRLF\r\nline", "x=1;y=22;z=333;w=4444",
    "1234567890 3.14159 2024-01-31 100,000", "<s>literal bos</s> and <unk>",
    "<start_of_turn>user\nhi<end_of_turn>", "a<think>b</think>c", "▁metaspace▁in▁text",
    "", " ", "  ", "\n", "H", "ZZZ QQQ", "{\"json\": [1, 2, {\"a\": null}]}",
]
PIECES = ["the", " ", "  ", "    ", "\n", "\t", "😀", "é", "中", "code", "x = 1", "print(",
          "<s>", "<think>", "Q", "ß", "—", "\u200b", "🇯🇵", "word", "0x1F", "'", "…"]


def strings(n: int = 300) -> list[str]:
    rng = random.Random(0)
    out = list(SEEDS)
    while len(out) < n:
        out.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))))
    return out


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def pair(request, tmp_path_factory):
    path = write_spm_gguf(tmp_path_factory.mktemp(request.param) / "spm.gguf", request.param)
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return TextTokenizer.from_model_path(path), ref


def test_encode_matches_transformers(pair):
    ours, ref = pair
    texts = strings()
    assert len(texts) >= 300
    for text in texts:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), repr(text)
        assert ours.encode(text, add_special_tokens=True) == ref.encode(text), repr(text)
        assert ours.decode(ids) == ref.decode(ids), repr(text)
    # The vocabulary really falls back to bytes, and "H" (no such piece) is one of them.
    assert ours.id_to_token(ours.encode("H")[-1]) == "<0x48>"


def test_special_tokens_and_template(pair):
    ours, ref = pair
    assert ours.bos_token_id == ref.bos_token_id == 1
    assert ours.eos_token_ids == (2,)
    assert ours.has_chat_template
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "写一首诗 😀"}]
    text = ours.apply_chat_template(chat, add_generation_prompt=True)
    assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert ours.encode_chat(chat) == ref.encode(text, add_special_tokens=False)


def test_no_bos_when_the_file_says_so(tmp_path):
    path = write_spm_gguf(tmp_path / "spm.gguf", add_bos=False)
    assert TextTokenizer.from_model_path(path).encode("hello", add_special_tokens=True)[0] != 1
