"""No full-precision copy of a quantized projection stays resident (issue 29): the bytes of the
tensors a bf16 CPU model's projections hold, against what bf16 copies of them would take."""

from __future__ import annotations

import pytest
import torch

from gpu.llama import LlamaModel, unwrap
from gpu.loader.load import load_model
from gpu.q4_linear import Q4Linear, q4_kernel_available
from tests.gpu.kquant_models import write_kquant_llama

pytestmark = pytest.mark.skipif(not q4_kernel_available(),
                                reason="this torch build has no CPU int4 matmul")


def tensor_bytes(obj) -> int:
    """Bytes of every tensor an object holds in its attributes (and lists or tuples of them)."""
    seen: dict[int, int] = {}

    def visit(value) -> None:
        if isinstance(value, torch.Tensor):
            seen[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif hasattr(value, "__dict__"):
            for item in vars(value).values():
                visit(item)

    visit(obj)
    return sum(seen.values())


def projections(model: LlamaModel) -> list:
    return [unwrap(getattr(layer, p)) for layer in model.layers
            for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]


def bf16_bytes(projs: list[Q4Linear]) -> int:
    return sum(2 * p.out_features * p.in_features for p in projs)


def build(path) -> LlamaModel:
    loaded = load_model(path, dtype=torch.bfloat16, progress=False, keep_q4=True)
    return LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.bfloat16,
                      q4=loaded.q4, q4_max_tokens=12, lm_head_q4=loaded.lm_head_q4)


def test_the_default_q4_1_model_keeps_no_bf16_copy(gguf_path):
    model = build(gguf_path)
    projs = projections(model)
    assert all(isinstance(p, Q4Linear) and p.dense is None for p in projs)
    held, bf16 = tensor_bytes(projs), bf16_bytes(projs)
    # Q4_1 as int4: 0.5 byte of code and 4 / 32 of bf16 scale and zero a weight: 0.31 of bf16
    # (before: the codes and a bf16 copy, 1.31 of bf16).
    assert held <= 0.35 * bf16, (held, bf16)
    # The tied lm_head's large forwards use the embedding table, which the lookup keeps anyway.
    assert unwrap(model.lm_head).dense.weight is model.embed_tokens


def test_a_q4_k_m_style_model_keeps_no_bf16_copy(tmp_path):
    model = build(write_kquant_llama(tmp_path / "tiny-q4_k_m.gguf"))
    projs = projections(model) + [unwrap(model.lm_head)]
    assert all(isinstance(p, Q4Linear) and p.dense is None for p in projs)
    held, bf16 = tensor_bytes(projs), bf16_bytes(projs)
    # Q4_K 0.31 of bf16; Q5_K (two int4 digits) and Q6_K (two over a doubled input) 0.63.
    assert held <= 0.6 * bf16, (held, bf16)
