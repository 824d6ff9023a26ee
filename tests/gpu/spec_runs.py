"""The offline Engine set up for the speculative-decoding tests (test_spec_decode.py,
test_spec_disable.py): the questions, the chain and tree shapes, and mixed stops."""

from __future__ import annotations

from fmserve.engine import Engine
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings

QUESTIONS = ["What is 2+2?", "Name three colors.", "Write a haiku about rain.",
             "Explain gravity to a child in two sentences.", "Say hi.",
             "List the planets of the solar system in order, with one fact about each."]
CHAIN = SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                     disable_above_batch_size=0)
TREE = SpecSettings("eagle3", "", num_steps=3, topk=2, num_draft_tokens=6,
                    disable_above_batch_size=0)


def make_engine(model_path, spec: SpecSettings | None = None, **kw) -> Engine:
    # Small pages and a small step budget: prompts cross pages and prefill in chunks mixed
    # with decodes (the spec prefill then needs its one token of lookahead).
    opts = dict(dtype="fp32", page_size=4, max_kv_tokens=4096, max_running_requests=4,
                max_tokens_per_step=48, progress=False, spec=spec)
    opts.update(kw)
    return Engine(model=str(model_path), **opts)


def scenario() -> list[SamplingParams]:
    """Mixed stops: stop strings, max-token stops of many lengths, eos."""
    params = []
    for i, _ in enumerate(QUESTIONS):
        stop = [" the"] if i % 3 == 0 else []
        params.append(SamplingParams(temperature=0.0, max_new_tokens=3 + 4 * i, stop=stop))
    return params
