"""Streamed text of a real service when tokens split UTF-8 characters: nothing lost at the end."""

from __future__ import annotations

import pytest

from ipc.client import Client
from ipc.client_messages import Chunk, Finished
from ipc.sampling import SamplingParams
from service.tokenizer import TextTokenizer
from tests.test_service import ServiceProcess

EMOJI_CHAT = [{"role": "user", "content": "Write three emoji in a row."}]


@pytest.fixture(scope="module")
def service(model_path):
    svc = ServiceProcess(model_path)
    yield svc
    svc.stop()


def stream(endpoint: str, max_new_tokens: int) -> tuple[list[Chunk], Finished]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    with Client(endpoint) as client:
        replies = list(client.generate(messages=EMOJI_CHAT, params=params, timeout_s=30.0))
    return replies[:-1], replies[-1]


def test_a_request_cut_mid_character_keeps_its_last_bytes(service, model_path):
    tokenizer = TextTokenizer.from_model_path(model_path)
    chunks, _ = stream(service.endpoint, 40)
    ids = [t for c in chunks for t in c.token_ids]
    # Mid-stream no chunk holds part of a character (the last may: it may end inside one).
    assert not any("\ufffd" in c.text for c in chunks[:-1]), "a partial character was streamed"
    # The first length at which the output ends inside a multi-byte character (an emoji is
    # three tokens of this model).
    cut = next((n for n in range(1, len(ids) + 1)
                if tokenizer.decode(ids[:n], skip_special_tokens=True).endswith("\ufffd")), None)
    assert cut is not None, f"the model wrote no multi-token character: {ids}"
    chunks, fin = stream(service.endpoint, cut)
    assert fin.reason == "length"
    assert [t for c in chunks for t in c.token_ids] == ids[:cut]
    # The concatenated text is the text of the tokens: the held-back bytes of the unfinished
    # character come with the last chunk (as U+FFFD) rather than vanishing. Before, the text
    # simply stopped short of them.
    assert "".join(c.text for c in chunks) == tokenizer.decode(ids[:cut], skip_special_tokens=True)
