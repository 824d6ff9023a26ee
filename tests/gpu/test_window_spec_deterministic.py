"""Sliding-window models (Mistral: every layer windowed; Gemma 3: local layers between global
ones) under EAGLE and under runtime.deterministic, on tiny random-weight models built here
(family_models) in fp32, a window of 8 under 30-token prompts.

EAGLE: greedy output, chain and tree, EAGLE-3 and EAGLE-1 heads, overlap on, equals
transformers' greedy output. A random head's drafts are rarely accepted, but every verify
step's root row attends over the window, so a verify that ignored it would already emit
other tokens. To accept drafts too (deep tree rows, whose windows cut into the prefix, and
the tree's KV compaction), one run drafts the reference's own tokens along one path of every
tree. Deterministic: a request's tokens and logprobs, to the bit, are the same alone and
inside a batch of other prompts split into other prefill chunks, plain and under EAGLE.
"""

from __future__ import annotations

import pytest
import torch

from fmserve.engine import Engine
from gpu.eagle.head_io import random_draft_head, save_draft_head
from gpu.loader.load import load_model
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings
from tests.engine_runs import assert_accounting_empty
from tests.gpu import family_models as fm

PROMPT = [fm.BOS] + [(7 * i * i + 3 * i) % 300 for i in range(29)]  # 30 tokens, window 8
PROMPTS = [PROMPT, PROMPT[5:]]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
# EAGLE-3 reads three target layers below the last: four Mistral layers (window on each),
# Gemma 3's six (the last global, the others windowed).
LAYERS = {"mistral": 4, "gemma3": 6}
AUX = {"mistral": (0, 1, 2), "gemma3": (0, 2, 4)}
SHAPES = {"chain": dict(num_steps=3, topk=1, num_draft_tokens=4),
          "tree": dict(num_steps=3, topk=2, num_draft_tokens=6)}


@pytest.fixture(scope="module", params=["mistral", "gemma3"])
def family(request):
    return request.param


_TARGETS: dict[str, tuple] = {}


@pytest.fixture(scope="module")
def target(family, tmp_path_factory):
    return target_of(family, tmp_path_factory)


def target_of(family: str, tmp_path_factory) -> tuple:
    """The model's directory, its random EAGLE-3 and EAGLE-1 heads, and transformers' greedy
    tokens for PROMPTS; made once per module."""
    if family in _TARGETS:
        return _TARGETS[family]
    model = fm.random_model(family, num_hidden_layers=LAYERS[family])
    path = fm.save_hf_dir(model, tmp_path_factory.mktemp(family))
    loaded = load_model(path, dtype=torch.float32, progress=False)
    embed = loaded.weights["embed_tokens"]
    lm_head = loaded.weights.get("lm_head", embed)
    heads = {}
    for algorithm in ("eagle3", "eagle"):
        head = random_draft_head(loaded.config, embed, lm_head, algorithm, seed=5,
                                 aux_layer_ids=AUX[family] if algorithm == "eagle3" else None)
        heads[algorithm] = tmp_path_factory.mktemp(f"{family}-{algorithm}")
        save_draft_head(head, heads[algorithm])
    refs = [fm.reference_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    _TARGETS[family] = path, heads, refs
    return _TARGETS[family]


def spec(heads, shape: str, algorithm: str = "eagle3") -> SpecSettings:
    return SpecSettings(algorithm, str(heads[algorithm]), disable_above_batch_size=0,
                        **SHAPES[shape])


def engine_for(path, **settings) -> Engine:
    opts = dict(dtype="fp32", page_size=4, max_kv_tokens=1024, max_running_requests=4,
                max_tokens_per_step=16, progress=False)
    return Engine(model=str(path), **(opts | settings))


def draft_the_reference(engine: Engine, sequence: list[int]) -> None:
    """The drafter proposes `sequence`'s own tokens along one path of every tree (to its
    deepest node, the last column of that depth, so the tree's KV is compacted), whatever the
    head drafted: greedy verification accepts them where the target agrees. One request."""
    drafter = engine.worker.step.drafter
    full = torch.tensor(sequence)
    draft = drafter.tree

    def tree(batches, slots, seq_lens, *rest):
        t = draft(batches, slots, seq_lens, *rest)
        bs, width = t.tokens.shape
        cols = torch.arange(width)
        deepest = (t.depth * width + cols).argmax(1)
        on_path = t.mask[torch.arange(bs), deepest] & (cols > 0)
        wanted = full[(seq_lens[:, None] + t.depth).clamp(max=len(full) - 1)]
        t.tokens = torch.where(on_path, wanted, t.tokens)
        return t

    drafter.tree = tree


@pytest.mark.parametrize("shape, algorithm", [("chain", "eagle3"), ("tree", "eagle3"),
                                              ("tree", "eagle")])
def test_eagle_greedy_equals_transformers(target, shape, algorithm):
    path, heads, refs = target
    engine = engine_for(path, spec=spec(heads, shape, algorithm), overlap=True)
    out = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == refs
    assert all(c.spec_verify_steps > 0 for c in out)
    assert_accounting_empty(engine)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_eagle_accepting_drafts_equals_transformers(target, shape):
    path, heads, refs = target
    engine = engine_for(path, spec=spec(heads, shape), overlap=True)
    draft_the_reference(engine, PROMPT + refs[0])
    [c] = engine.generate([PROMPT], GREEDY)
    assert c.token_ids == refs[0]
    assert c.spec_accepted_drafts >= NEW_TOKENS // 2, (c.spec_accepted_drafts,
                                                       c.spec_verify_steps)
    assert_accounting_empty(engine)


def test_eagle_tree_on_the_triton_backend(tmp_path_factory):
    """The Triton kernels (tree-masked extend with each layer's window, paged decode) in the
    whole spec step, under the interpreter, on Gemma 3 (both kinds of layer): two requests
    prefilled in chunks and verified in one batch, overlap on, the first accepting drafts."""
    path, heads, refs = target_of("gemma3", tmp_path_factory)
    engine = engine_for(path, spec=spec(heads, "tree"), attention_backend="triton",
                        overlap=True)
    assert engine.worker.step.needs_cpu_seq_lens is False  # neither backend asks host lengths
    draft_the_reference(engine, PROMPT + refs[0])  # the second request's drafts miss
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=4,
                                                  ignore_eos=True))
    assert [c.token_ids for c in out] == [r[:4] for r in refs]
    assert out[0].spec_accepted_drafts > 0
    assert_accounting_empty(engine)


# -- deterministic mode ---------------------------------------------------------------------

PROBE = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, logprobs=0, ignore_eos=True)
OTHERS = [[fm.BOS] + [(11 * i + 5 * j) % 300 for i in range(9 + 7 * j)] for j in range(3)]


def deterministic_engine(path, **settings) -> Engine:
    return engine_for(path, deterministic=True, max_tokens_per_step=12, **settings)


def check_batch_invariance(engine: Engine, refs) -> None:
    """The probe alone (transformers' tokens), then second of four with overlap on."""
    [alone] = engine.generate([PROMPT], PROBE)
    assert alone.token_ids == refs[0]
    engine.overlap = True
    batch = OTHERS[:1] + [PROMPT] + OTHERS[1:]
    params = [SamplingParams(temperature=0.0, max_new_tokens=3 + i) for i in range(4)]
    params[1] = PROBE
    inside = engine.generate(batch, params)[1]
    assert (inside.token_ids, inside.logprobs) == (alone.token_ids, alone.logprobs)
    assert_accounting_empty(engine)


def test_deterministic_alone_equals_in_a_batch(target):
    path, _, refs = target
    check_batch_invariance(deterministic_engine(path), refs)


def test_deterministic_eagle_tree_alone_equals_in_a_batch(tmp_path_factory):
    """Gemma 3 (both kinds of layer): the batch-invariant backend's windowed verify rows,
    drafts accepted (the other requests get the probe's drafts: rejected, harmlessly)."""
    path, heads, refs = target_of("gemma3", tmp_path_factory)
    engine = deterministic_engine(path, spec=spec(heads, "tree"))
    draft_the_reference(engine, PROMPT + refs[0])
    check_batch_invariance(engine, refs)
