"""The fp32 model of a CPU without native bf16 (gpu/cpu_kernels.py): its quantized projections
and tied embedding stay as the file's codes only (small forwards on the C kernel, wide ones
dequantized a piece at a time into scratch), with no fp32 or fp16 copy; its tokens agree with
the exact fp32 model; the hand-over is measured once and cached."""

from __future__ import annotations

import json
import time

import pytest
import torch

from gpu import cpu_kernels, cpu_q4_kernel
from gpu.cpu_kernels import Fp32Split, fp32_split_applies, int4_max_rows
from gpu.cpu_q4_kernel import CodesLinear, q4_matmul, scratch_matmul
from gpu.llama import LlamaModel, unwrap
from gpu.loader.load import load_model
from gpu.q4_linear import Q4Linear, q4_kernel_available
from gpu.quantized_linear import Fp16Linear
from tests.gpu.test_cpu_load import spinners
from tests.gpu.test_quantized_memory import projections, tensor_bytes
from tests.gpu.teacher_forcing import TEXT, prompt_logits

pytestmark = pytest.mark.skipif(
    not q4_kernel_available() or "fbgemm" not in torch.backends.quantized.supported_engines,
    reason="this torch build has no CPU int4 matmul or no FBGEMM")

CPU = torch.device("cpu")


def build(path, split: Fp32Split | None) -> LlamaModel:
    loaded = load_model(path, dtype=torch.float32, progress=False, keep_q4=split is not None)
    return LlamaModel(loaded.config, loaded.weights, CPU, torch.float32, q4=loaded.q4,
                      q4_max_tokens=12, lm_head_q4=loaded.lm_head_q4, fp32_split=split)


@pytest.fixture(scope="module")
def split_model(gguf_path):
    return build(gguf_path, Fp32Split(projection_rows=4, lm_head_rows=2))


def test_a_bf16_split_runs_its_wide_forwards_in_bf16(gguf_path):
    model = build(gguf_path, Fp32Split(projection_rows=4, lm_head_rows=2, bf16_gemm=True))
    proj = unwrap(model.layers[0].gate_up_proj)
    if not isinstance(proj, CodesLinear):
        pytest.skip("no C kernel here: the wide path is FBGEMM's fp16 packs")
    x = torch.randn(32, proj.in_features, generator=torch.Generator().manual_seed(2))
    assert torch.equal(proj(x), scratch_matmul(x, proj.rows[0], bf16=True))
    assert torch.equal(proj(x[:4]), q4_matmul(x[:4], proj.rows[0]))  # small ones on the codes


def test_only_dtype_auto_on_the_cpu_takes_the_split():
    assert fp32_split_applies(CPU, torch.float32, "auto", 12)
    assert not fp32_split_applies(CPU, torch.float32, "fp32", 12)  # explicit fp32 stays exact
    assert not fp32_split_applies(CPU, torch.bfloat16, "auto", 12)  # bf16 CPUs: q4_linear.py
    assert not fp32_split_applies(CPU, torch.float32, "auto", 0)  # q4_max_tokens 0: nothing
    assert not fp32_split_applies(CPU, torch.float32, "auto", 12, "dense")  # fp32 copies


def test_the_split_keeps_only_the_codes(split_model, gguf_path):
    projs = projections(split_model) + [unwrap(split_model.lm_head)]
    if cpu_q4_kernel.available():  # the C kernel: codes only, scratch for wide forwards
        assert all(isinstance(p, CodesLinear) and p.dense is None for p in projs)
    else:  # torch's int4 kernel, FBGEMM fp16 packs for wide forwards
        assert all(isinstance(p, Q4Linear) and isinstance(p.dense, Fp16Linear) for p in projs)
    assert split_model.wide_paths == len(projs)
    # A forward of up to 4 rows never reaches the wide path: the compiled decode step's bound.
    assert split_model.kernel_max_rows == 4
    fp32_bytes = sum(4 * p.out_features * p.in_features for p in projs)
    # The tensors held are the codes with their scales: 0.75 bytes a weight for the C kernel's
    # form (fp32 scales and minimums), 1.1 for the Q8_0 lm_head's int8 codes (1.5 as a pair of
    # 4-bit parts without the C kernel); an fp32 copy would be 4, an fp16 one 2.
    assert tensor_bytes(projs) <= 0.25 * fp32_bytes
    if not cpu_q4_kernel.available():
        return
    # The tied embedding is the lm_head's own Q8_0 codes, looked up row by row: no fp32 table.
    assert split_model._embed_table is None
    assert split_model.embed_codes is unwrap(split_model.lm_head).rows[0]
    table = load_model(gguf_path, dtype=torch.float32, progress=False).weights["embed_tokens"]
    ids = torch.tensor([0, 1, 17, 4242, table.shape[0] - 1])
    assert torch.equal(split_model.embed(ids), table[ids])  # the file's values, exactly
    assert torch.equal(split_model.embed_tokens, table)  # a borrower's fresh copy


def test_small_forwards_take_the_codes_and_wide_ones_the_wide_path(split_model):
    proj = unwrap(split_model.layers[0].gate_up_proj)
    exact = proj.weight.float()  # the codes dequantized, as the kernel multiplies them
    gen = torch.Generator().manual_seed(1)
    for rows in (1, proj.max_tokens, proj.max_tokens + 1, 32):
        x = torch.randn(rows, proj.in_features, generator=gen)
        y = proj(x)
        assert y.dtype == torch.float32 and y.shape == (rows, proj.out_features)
        reference = x @ exact.t()
        if isinstance(proj, CodesLinear):
            on_codes = q4_matmul(x, proj.rows[0])  # the C kernel, int8 inputs
            if rows > proj.max_tokens:  # the exact weights in fp32: only rounding differs
                assert torch.equal(y, scratch_matmul(x, proj.rows[0])), rows
                assert torch.allclose(y, reference, rtol=1e-5, atol=1e-5), rows
                assert not torch.equal(y, on_codes), rows
            else:
                assert torch.equal(y, on_codes), rows
        elif rows > proj.max_tokens:
            assert torch.equal(y, proj.dense(x)), rows
        else:  # the int4 kernel on the input rounded to bf16, as a bf16 model runs it
            assert torch.equal(y, proj(x.bfloat16()).float()), rows
            assert not torch.equal(y, proj.dense(x)), rows
        assert ((y - reference).norm() / reference.norm()).item() < 0.01, rows


def top1_agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.argmax(-1) == b.argmax(-1)).float().mean().item()


def test_the_split_model_tracks_the_exact_fp32_model(split_model, gguf_path, model_path):
    from service.tokenizer import TextTokenizer
    ids = TextTokenizer.from_model_path(model_path).encode(TEXT)
    exact = prompt_logits(build(gguf_path, None), ids)
    wide = prompt_logits(split_model, ids)  # one forward of ~100 rows: the wide path
    assert top1_agreement(wide, exact) >= 0.98
    if cpu_q4_kernel.available():  # scratch: the file's weights exactly, fp32 throughout
        assert top1_agreement(wide, exact) == 1.0
        assert ((wide - exact).norm() / exact.norm()).item() < 1e-4
    codes = build(gguf_path, Fp32Split(projection_rows=4096, lm_head_rows=4096))
    on_codes = prompt_logits(codes, ids)  # every forward on the codes
    if not cpu_q4_kernel.available():  # torch's int4 kernel, inputs in bf16
        assert top1_agreement(on_codes, wide) >= 0.95
        assert top1_agreement(on_codes, exact) >= 0.95
        return
    # The C kernel's int8 inputs (as llama.cpp's Q8_1) cost a little more: on this text 7 of
    # 116 positions, every one a near-tie of the exact model (its top two within 0.2 logits).
    assert top1_agreement(on_codes, exact) >= 0.93
    top2 = exact.topk(2, dim=-1).values
    differ = on_codes.argmax(-1) != exact.argmax(-1)
    assert (top2[differ, 0] - top2[differ, 1]).max().item() < 0.25
    assert ((on_codes - exact).norm() / exact.norm()).item() < 0.04


HAND_OVERS = (0, *cpu_kernels.CANDIDATE_ROWS, cpu_kernels.UNBOUNDED_ROWS)


def test_the_hand_over_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FMSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "BUSY_CORES", 1e9)  # however busy the test machine is
    calls = []
    real = cpu_kernels.measure_int4_max_rows
    monkeypatch.setattr(cpu_kernels, "measure_int4_max_rows",
                        lambda i, o, bf16=False, up_to=2048: calls.append((i, o))
                        or real(i, o, bf16, up_to))
    first = int4_max_rows(64, 128)
    assert first in HAND_OVERS and calls == [(64, 128)]
    assert int4_max_rows(64, 128) == first and len(calls) == 1  # from the cache
    cache = tmp_path / "cpu_kernels.json"
    assert first in json.loads(cache.read_text()).values()
    cache.write_text("{not json")  # a damaged cache is measured again, not an error
    assert int4_max_rows(64, 128) in HAND_OVERS and len(calls) == 2
    assert len(json.loads(cache.read_text())) == 1


def test_a_hand_over_measured_on_a_busy_machine_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("FMSERVE_CACHE", str(tmp_path))
    procs = spinners(2, 3.0)  # two processes spinning through the measurement
    time.sleep(0.3)
    try:
        assert int4_max_rows(64, 128) in HAND_OVERS
    finally:
        for p in procs:
            p.kill()
    assert not (tmp_path / "cpu_kernels.json").exists()  # measured again at the next start


def test_a_hand_over_is_confirmed_before_it_is_taken(monkeypatch):
    """A kernel that loses one pair of timings (a moment of other work) is timed again; two
    losses in a row hand over. The timings are scripted: rows -> verdicts in turn."""
    script = {1: [True], 2: [False, True], 4: [False, False]}
    seen = []

    def scripted(int4, wide, x):
        seen.append(x.shape[0])
        return script[x.shape[0]].pop(0)

    monkeypatch.setattr(cpu_kernels, "_int4_wins", scripted)
    assert cpu_kernels.measure_int4_max_rows(64, 128, up_to=8) == 2
    assert seen == [1, 2, 2, 4, 4]


def test_the_environment_can_fix_the_hand_over(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_CODES_ROWS, "3")
    # The wide path multiplies in bf16 where the CPU has it (gpu/cpu_q4_kernel.py).
    assert cpu_kernels.plan_fp32_split(576, 1536, 49152) == Fp32Split(
        3, 3, bf16_gemm=cpu_kernels.cpu_has_native_bf16())
    for bad in ("many", "-1"):
        monkeypatch.setenv(cpu_kernels.ENV_CODES_ROWS, bad)
        with pytest.raises(ValueError, match=f"FMSERVE_CPU_CODES_ROWS='{bad}': give a whole"):
            cpu_kernels.plan_fp32_split(576, 1536, 49152)
