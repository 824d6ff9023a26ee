"""The draft head's int8 copies for small forwards (bf16 on the CPU, beside 4-bit decode).

The numbers must be the per-channel int8 product, a forward above the limit (or in another
dtype) must be the plain nn.Linear, the head's state_dict must not change, and a bf16 engine
with 4-bit decode must serve EAGLE through the int8 copies with the shipped head's drafts still
accepted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fmserve.engine import Engine
from gpu import cpu_q4_kernel, worker_state
from gpu.eagle.head_linear import SmallRowsInt8Linear
from gpu.quantized_linear import dequantize_int8, quantize_int8_per_channel
from gpu.q4_linear import q4_kernel_available
from ipc.sampling import SamplingParams
from ipc.spec_settings import SpecSettings, accept_length

needs_int8_kernel = pytest.mark.skipif(
    not hasattr(torch.ops.aten, "_weight_int8pack_mm"), reason="no CPU int8 matmul in this torch")


@needs_int8_kernel
def test_small_forwards_are_the_int8_product_and_larger_ones_the_linear():
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 64, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(64, 96, generator=gen))
    layer = SmallRowsInt8Linear(linear, max_rows=4)
    x = torch.randn(2, 3, 96, generator=gen).bfloat16()  # 6 rows in all: above the limit
    assert torch.equal(layer(x), F.linear(x, linear.weight))
    small = x[0]  # 3 rows
    q, scale = quantize_int8_per_channel(linear.weight.detach())
    int8_ref = small.double() @ dequantize_int8(q, scale).double().t()
    y = layer(small)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 64)
    torch.testing.assert_close(y.double(), int8_ref, rtol=2e-2, atol=5e-2)
    assert not torch.equal(y, F.linear(small, linear.weight))  # the int8 kernel ran
    assert list(layer.state_dict()) == ["weight"]
    with pytest.raises(ValueError, match="without a bias"):
        SmallRowsInt8Linear(nn.Linear(4, 4, bias=True), 4)


@needs_int8_kernel
@pytest.mark.skipif(not q4_kernel_available(), reason="no CPU int4 matmul in this torch")
def test_a_bf16_engine_drafts_on_int8_and_its_drafts_are_accepted(model_path):
    spec = SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                        disable_above_batch_size=0)
    engine = Engine(model=str(model_path), dtype="bf16", max_running_requests=2, progress=False,
                    spec=spec)  # q4_max_tokens: the default
    head = engine.worker.step.head
    keys_before = set(head.state_dict())
    wrapped = [m for m in head.modules() if isinstance(m, SmallRowsInt8Linear)]
    # fc, q/k/v/o, gate/up/down and the lm_head.
    assert len(wrapped) == 9
    assert not any(type(m) is nn.Linear for m in head.modules())
    assert set(head.state_dict()) == keys_before
    chats = [[{"role": "user", "content": q}]
             for q in ("Name three colors.", "Write a haiku about rain.")]
    outs = engine.generate(chats, SamplingParams(temperature=0.0, max_new_tokens=40))
    steps = sum(o.spec_verify_steps for o in outs)
    accepted = sum(o.spec_accepted_drafts for o in outs)
    assert all(len(o.token_ids) > 0 for o in outs)
    # The shipped head accepts 0.7 drafts a step here (accept length 1.7); a wrong int8 product
    # (a bad scale, transposed weights) would accept next to none.
    assert accept_length(accepted, steps) >= 1.3, (accepted, steps)


def test_fp32_engines_keep_the_heads_linears(model_path):
    spec = SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                        disable_above_batch_size=0)
    engine = Engine(model=str(model_path), dtype="fp32", max_running_requests=1, progress=False,
                    spec=spec)
    assert not any(isinstance(m, SmallRowsInt8Linear) for m in engine.worker.step.head.modules())


@pytest.mark.skipif(not cpu_q4_kernel.available(), reason="the C kernel is not built here")
def test_the_codes_argmax_is_the_products_argmax_without_writing_it():
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 500, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(500, 96, generator=gen))
    layer = SmallRowsInt8Linear(linear, max_rows=4, fp32_codes=True)
    x = torch.randn(3, 96, generator=gen)
    assert torch.equal(layer.argmax(x), layer(x).argmax(-1))
    assert layer.argmax(torch.randn(5, 96, generator=gen)) is None  # wider: the linear's
    assert layer.argmax(x.bfloat16()) is None
    if hasattr(torch.ops.aten, "_weight_int8pack_mm"):  # bf16's int8 copy: no codes
        assert SmallRowsInt8Linear(linear.bfloat16(), max_rows=4).argmax(x) is None


@pytest.mark.skipif(not cpu_q4_kernel.available(), reason="the C kernel is not built here")
def test_a_chains_draft_token_is_the_heads_argmax_taken_on_its_codes(model_path, monkeypatch):
    """A chain ranks no drafts, so Drafter.topk takes the head's argmax on the C kernel's
    codes without its logits: the tokens the softmax's top-1 of those logits gives."""
    monkeypatch.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)
    spec = SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                        disable_above_batch_size=0)
    engine = Engine(model=str(model_path), device="cpu", dtype="auto", max_kv_tokens=1024,
                    max_running_requests=2, progress=False, spec=spec)
    drafter = engine.worker.step.drafter
    assert drafter.chain
    rows = drafter.head.lm_head.max_rows  # a step's draft rows: one per request
    h = torch.randn(rows, drafter.head.config.hidden_size,
                    generator=torch.Generator().manual_seed(1))
    assert drafter.head.greedy_ids(h) is not None  # the fast way applies here
    _, ids = drafter.topk(h)
    expected = torch.softmax(drafter.head.logits(h), -1).topk(1, dim=-1).indices
    assert torch.equal(ids, drafter.head.draft_to_target(expected))
