"""The paged runtime is invariant to batching, page size, chunking and attention backend."""

from __future__ import annotations

import pytest

from fmserve.engine import Engine
from ipc.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
TEXTS = ["Hi", "List three prime numbers and explain why each is prime.",
         "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
         "Translate to French: the cat sleeps on the warm windowsill all afternoon, dreaming "
         "of fish and of the birds it never catches."]


def make_engine(model_path, **kw) -> Engine:
    opts = dict(dtype="fp32", page_size=16, max_kv_tokens=4096, max_running_requests=8,
                progress=False)
    opts.update(kw)
    return Engine(model=str(model_path), **opts)


@pytest.fixture(scope="module")
def engine(model_path):
    return make_engine(model_path)


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.tokenizer.encode_chat([{"role": "user", "content": t}]) for t in TEXTS]


@pytest.fixture(scope="module")
def alone(engine, prompts):
    return [engine.generate([p], GREEDY)[0].token_ids for p in prompts]


def test_prompts_have_mixed_lengths(prompts):
    assert len({len(p) for p in prompts}) == len(prompts)


def test_batch_of_mixed_lengths_equals_each_alone(engine, prompts, alone):
    batched = [c.token_ids for c in engine.generate(prompts, GREEDY)]
    assert batched == alone
    acc = engine.scheduler.accounting()  # and accounting returns to empty
    assert acc["free_pages"] == acc["total_pages"]
    assert acc["free_slots"] == acc["total_slots"]
    assert acc["running"] == acc["waiting"] == 0


def test_page_size_1_equals_page_size_16(model_path, prompts, alone):
    engine = make_engine(model_path, page_size=1)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == alone


def test_chunked_prefill_equals_one_shot(model_path, prompts, alone):
    # An 11-token step budget splits every prompt into chunks, mixed with other requests' decodes.
    engine = make_engine(model_path, max_tokens_per_step=11)
    assert [c.token_ids for c in engine.generate(prompts, GREEDY)] == alone


def test_preemption_under_kv_pressure_keeps_outputs(model_path, prompts, alone):
    # Room for about two requests at a time: the scheduler must retract and recompute.
    engine = make_engine(model_path, page_size=4, max_kv_tokens=4 * 28)
    outs = engine.generate(prompts, GREEDY)
    assert [c.token_ids for c in outs] == alone
    assert engine.scheduler.core.num_retractions > 0, "the test no longer exercises retraction"
    assert engine.scheduler.accounting()["free_pages"] == engine.scheduler.core.pages.capacity


def test_triton_backend_equals_torch(tiny_llama):
    """On conftest's tiny_llama (the default model's attention geometry, 2 layers): Triton's
    interpreter costs per layer, and 30 real layers took over a minute. Mixed prompt lengths
    across page boundaries, prefill and decode in one batch; the torch backend is the
    reference (checked against transformers elsewhere)."""
    pytest.importorskip("triton")
    prompts = [[1, 5, 9], [1] + list(range(10, 50)), [1, 60, 61, 62, 63, 64, 65, 66, 67, 68,
               69, 70, 71, 72, 73, 74, 75, 76], [1, 90]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    out = {backend: [c.token_ids for c in make_engine(tiny_llama, attention_backend=backend)
                     .generate(prompts, params)] for backend in ("torch", "triton")}
    assert len({tuple(t) for t in out["torch"]}) > 1
    assert out["triton"] == out["torch"]
