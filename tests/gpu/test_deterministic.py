"""runtime.deterministic: a request's tokens (and logprobs, to the bit) are the same alone and
inside a batch of 16 other prompts, at two positions in the batch, with and without overlap,
greedy and seeded at temperature 0.8, in bf16 and fp32, plain and under EAGLE-3. A step budget
of 40 tokens splits the prompts into other prefill chunks in a batch than alone, and batch 16
crosses q4_max_tokens (12), where the default mode switches kernels."""

from __future__ import annotations

import pytest

from fmserve.engine import Engine
from ipc.sampling import SamplingParams
from tests.gpu.spec_runs import CHAIN

TOPICS = ["a dragon", "the sea", "a robot", "rain", "a cat", "winter", "a city", "the moon",
          "a tree", "music", "a clock", "fire", "a river", "bread", "a map", "glass"]
PROMPTS = [f"Write a short story about {t}." for t in TOPICS]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, logprobs=0, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=1234, max_new_tokens=8, logprobs=0,
                        ignore_eos=True)
FILLER = SamplingParams(temperature=0.0, max_new_tokens=4)


def run(engine: Engine, overlap: bool, prompts: list[str], params: list[SamplingParams]):
    engine.overlap = overlap
    return [(c.token_ids, c.logprobs) for c in engine.generate(prompts, params)]


def batch_with(probes: dict[int, tuple[str, SamplingParams]]):
    """16 prompts: the probes at their positions, the others filled with other prompts."""
    prompts, params = list(PROMPTS), [FILLER] * len(PROMPTS)
    for i, (prompt, p) in probes.items():
        prompts[i], params[i] = prompt, p
    return prompts, params


def check_batch_invariance(engine: Engine) -> None:
    greedy, seeded = "Tell me about the history of bread.", "Describe a walk in the forest."
    alone = {name: run(engine, False, [prompt], [p])[0]
             for name, prompt, p in (("greedy", greedy, GREEDY), ("seeded", seeded, SEEDED))}
    for overlap, at in ((False, {3: "greedy", 9: "seeded"}), (True, {14: "greedy", 0: "seeded"})):
        probes = {i: ((greedy, GREEDY) if name == "greedy" else (seeded, SEEDED))
                  for i, name in at.items()}
        out = run(engine, overlap, *batch_with(probes))
        for i, name in at.items():
            assert out[i] == alone[name], (name, i, overlap)


def make_engine(model_path, dtype: str, **kw) -> Engine:
    return Engine(model=str(model_path), dtype=dtype, deterministic=True, page_size=4,
                  max_tokens_per_step=40, max_running_requests=16, progress=False, **kw)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_plain_decoding_is_batch_invariant(model_path, dtype):
    check_batch_invariance(make_engine(model_path, dtype))


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_eagle3_decoding_is_batch_invariant(model_path, dtype):
    check_batch_invariance(make_engine(model_path, dtype, spec=CHAIN))


def test_needs_the_torch_attention_backend():
    from ipc.worker_config import worker_config
    with pytest.raises(ValueError, match="attention_backend"):
        worker_config(deterministic=True, attention_backend="triton")
