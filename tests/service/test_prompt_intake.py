"""service/prompt_intake.py: a raw text prompt gets the model's own BOS where its tokenizer adds
one (as transformers' `tokenizer(text)` and llama.cpp do: Gemma 3 270M, given "The Eiffel Tower
is located in the city of" without its BOS, went on " the city. Her. Her."), a rendered chat
none beyond the template's, and a text tokenized off the loop the same ids as one inline."""

from __future__ import annotations

import anyio
import pytest
from transformers import AutoTokenizer

from fmserve.engine import Engine
from ipc.client_messages import ChatMessage, Generate
from ipc.sampling import SamplingParams
from service.prompt_intake import INLINE_MAX_BYTES, LargeText, PromptIntake
from service.tokenizer import TextTokenizer
from tests.service.spm_gguf import write_spm_gguf

BOS = 1


@pytest.fixture(scope="module", params=[True, False], ids=["add_bos", "no_bos"])
def spm(request, tmp_path_factory):
    path = write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", "gemma3",
                          add_bos=request.param)
    return request.param, path, TextTokenizer.from_model_path(path)


def generate(**prompt) -> Generate:
    return Generate(id="r1", params=SamplingParams(), **prompt)


def test_a_raw_text_gets_the_bos_its_file_asks_for(spm):
    add_bos, path, tok = spm
    ids = PromptIntake(tok).prepare(generate(text="hello world"), 10_000)
    assert ids == tok.encode("hello world", add_special_tokens=True)
    assert (ids[0] == BOS) == add_bos and ids.count(BOS) == int(add_bos)
    # transformers' tokenizer(text) on the same file: the independent reference
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert ids == ref("hello world").input_ids


def test_a_chat_keeps_only_its_templates_bos(spm):
    _, _, tok = spm
    ids = PromptIntake(tok).prepare(
        generate(messages=[ChatMessage(role="user", content="hello")]), 10_000)
    assert ids == tok.encode_chat([{"role": "user", "content": "hello"}])
    assert ids.count(BOS) == 1  # the template writes {{ bos_token }}; nothing is added to it


def test_a_large_text_is_tokenized_off_the_loop_with_the_same_bos(spm):
    add_bos, _, tok = spm
    intake = PromptIntake(tok)
    text = "hello world " * (INLINE_MAX_BYTES // 8)
    pending = intake.prepare(generate(text=text), 10**7)
    assert pending == LargeText(text, add_special_tokens=True)
    ids = anyio.run(intake.encode, pending)
    assert ids == tok.encode(text, add_special_tokens=True)
    assert (ids[0] == BOS) == add_bos


def test_the_offline_engine_encodes_a_raw_text_the_same_way(spm):
    _, _, tok = spm
    engine = Engine.__new__(Engine)  # only its tokenizer: encode needs no model
    engine.tokenizer = tok
    assert engine.encode("hello world") == tok.encode("hello world", add_special_tokens=True)
    assert engine.encode([{"role": "user", "content": "hi"}]) == tok.encode_chat(
        [{"role": "user", "content": "hi"}])
