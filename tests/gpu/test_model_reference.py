"""The model against transformers on the same GGUF: logits and greedy continuations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fmserve.engine import Engine
from ipc.sampling import SamplingParams
from tests.engine_runs import prompt_logits
from tests.hf_reference import hf_causal_lm

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "Write a haiku about paged attention."}],
]


@pytest.fixture(scope="module")
def hf_model(model_path):
    pytest.importorskip("transformers")
    return hf_causal_lm(model_path)


@pytest.fixture(scope="module")
def engine(model_path):
    return Engine(model=str(model_path), dtype="fp32", page_size=16, max_kv_tokens=4096,
                  max_running_requests=8, progress=False)


def test_logits_match_transformers(engine, hf_model):
    ids = engine.tokenizer.encode_chat(CHATS[1]) + engine.tokenizer.encode(" The reason is")
    ours = prompt_logits(engine, ids)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_64_tokens_match_transformers_generate(engine, hf_model):
    prompts = [engine.tokenizer.encode_chat(c) for c in CHATS]
    ours = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=64))
    for prompt, completion in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf_model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    pad_token_id=2)
        ref_new = ref[0, len(prompt):].tolist()
        assert completion.token_ids == ref_new, engine.tokenizer.decode(completion.token_ids)
        assert completion.finish_reason is not None


def test_logprobs_are_the_model_distribution(engine, hf_model):
    prompt = engine.tokenizer.encode_chat(CHATS[0])
    [c] = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=3, logprobs=3))
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(torch.tensor([prompt + c.token_ids])).logits[0].float(), -1)
    for i, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(lp.logprob - row[tok].item()) < 1e-3
        top_ids = [t for t, _ in lp.top]
        assert top_ids[0] == tok
        np.testing.assert_allclose([v for _, v in lp.top], row.topk(3).values.numpy(), atol=1e-3)
