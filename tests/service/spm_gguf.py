"""A small SentencePiece-style (Llama / Gemma) vocabulary written into a GGUF as llama.cpp's
converter writes one: <unk> <s> </s>, the 256 byte-fallback tokens <0x00>..<0xFF>, single
characters, then pieces learned by BPE on a small corpus (scored best-first), a few control and
user-defined tokens, and a chat template. Gemma's files store a run of spaces as real spaces.
"""

from __future__ import annotations

from pathlib import Path

import gguf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def main():\n    print('hello world')\n    return 0\n",
    "Once upon a time there was a little girl who lived in a village near the forest.",
    "Streaming tokens to the client, one by one, as the model writes them.",
    "import numpy as np\nfor i in range(10):\n    x = np.zeros((i, i))\n",
    "Les élèves étudient à l'école; café, naïve, déjà vu.",
    "    indented code    with    runs of spaces  and\ttabs",
    "1234567890 3.14159 2024-01-31 100,000",
] * 20
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                 "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}"
                 "{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")
# llama.cpp's token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6


def spm_vocab(num_merges: int = 400) -> tuple[list[str], list[float], list[int]]:
    """tokens, scores and token types, in the order a SentencePiece BPE model lists them."""
    trainer = trainers.BpeTrainer(vocab_size=10_000, show_progress=False)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    bpe.train_from_iterator(CORPUS, trainer)
    merged = [a + b for a, b in (m.split(" ") if isinstance(m, str) else m for m in
                                 __import__("json").loads(bpe.to_str())["model"]["merges"])]
    merged = list(dict.fromkeys(merged))[:num_merges]
    chars = sorted({c for text in CORPUS for c in text.replace(" ", "\u2581")} | {"\u2581"})
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    scores = [0.0] * len(tokens)
    for i, piece in enumerate(merged):  # best merges first
        tokens.append(piece)
        scores.append(-float(i))
        types.append(NORMAL)
    for j, c in enumerate(chars):
        if c not in tokens:
            tokens.append(c)
            scores.append(-1e4 - j)
            types.append(NORMAL)
    for piece in ["\u2581\u2581", "\u2581\u2581\u2581\u2581"]:
        if piece not in tokens:
            tokens.append(piece)
            scores.append(-5e3)
            types.append(NORMAL)
    tokens += ["<start_of_turn>", "<end_of_turn>", "<think>"]
    scores += [0.0, 0.0, 0.0]
    types += [CONTROL, CONTROL, USER_DEFINED]
    return tokens, scores, types


def write_spm_gguf(path: Path, arch: str = "llama", chat_template: str | None = CHAT_TEMPLATE,
                   add_bos: bool | None = True) -> Path:
    """The vocabulary in a GGUF of `arch` ("llama", or "gemma3": runs of spaces spelled as
    spaces, no space prefix), with no tensors: only the tokenizer is read from it."""
    tokens, scores, types = spm_vocab()
    if arch.startswith("gemma"):
        tokens = [" " * len(t) if t and set(t) == {"\u2581"} and len(t) > 1 else t
                  for t in tokens]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(False)
    if arch.startswith("gemma"):
        writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
