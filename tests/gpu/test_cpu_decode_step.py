"""The decode step in C (gpu/cpu_decode_step.py, gpu/csrc/decode_step.c): where it applies,
that one decoder layer of it gives the torch decoder's numbers on the same kernel, and that the
real model decodes with it, each token the model's own first choice or within a near-tie; its
KV cache is fp16 (runtime.kv_cache_dtype = "auto"), as llama.cpp keeps it, unless asked not.

The model is the default one with dtype "auto" resolved to fp32, as on an AVX2-only CPU
(resolve_dtype patched), so its projections keep the file's 4-bit codes on the C kernel."""

from __future__ import annotations

import itertools

import msgspec
import pytest
import torch

from fmserve.bench import DEV_PROMPTS
from fmserve.engine import Engine
from fmserve.jsonl import read_prompts
from gpu import c_library, cpu_decode_step, cpu_q4_kernel, worker_state
from ipc.sampling import SamplingParams
from tests.engine_runs import assert_accounting_empty
from tests.gpu.teacher_forcing import prompt_logits

pytestmark = pytest.mark.skipif(not cpu_q4_kernel.available(),
                                reason="the C kernel is not built here (no C compiler)")


@pytest.fixture(scope="module")
def codes_engine(model_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)
        yield Engine(model=str(model_path), device="cpu", dtype="auto", max_kv_tokens=2048,
                     max_running_requests=3, progress=False)


def greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    out = [c.token_ids for c in engine.generate(prompts, params)]
    assert_accounting_empty(engine)
    return out


def dev_prompts(engine: Engine, n: int) -> list[list[int]]:
    return [engine.encode(p) for p in itertools.islice(read_prompts(str(DEV_PROMPTS)), n)]


def test_it_replaces_the_compiled_step_where_it_applies(codes_engine, tiny_llama):
    step = codes_engine.worker.step
    assert step.native_decode is not None and step.compiled_decode is None
    # Up to the projections' hand-over to their fp16 packs (tests/conftest.py fixes it at 2).
    assert step.native_decode.max_batch == codes_engine.worker.state.model.kernel_max_rows == 2
    assert codes_engine.worker.info().decode_compile == "native"
    assert f"rows in C ({c_library.kernel_isa()} kernels" in codes_engine.worker.fast_paths()
    dense = Engine(model=str(tiny_llama), device="cpu", dtype="fp32", max_kv_tokens=256,
                   max_running_requests=2, progress=False)
    assert dense.worker.step.native_decode is None
    reason = cpu_decode_step.why_not(dense.worker.state.model, dense.worker.state.attn)
    assert "one matrix of codes" in reason
    with pytest.raises(ValueError, match="cannot run this model: .*matrix of codes"):
        cpu_decode_step.NativeDecode(dense.worker.state.model, dense.worker.state.attn)


def test_one_layer_gives_the_torch_decoders_numbers_on_the_same_kernel(codes_engine,
                                                                       monkeypatch):
    """Two requests of different lengths, one decoder layer each way: C against the model's
    own torch code with the same C kernel for its projections. Over all 30 layers the two
    drift apart (the kernel rounds its input to int8, so last-bit differences of a norm can
    move a rounding), which the next test bounds on the tokens."""
    step, model = codes_engine.worker.step, codes_engine.worker.state.model
    native, run_model = step.native_decode, step.run_model
    diffs = []

    def both(batch):
        if not native.can_run(batch):
            return run_model(batch)
        layers = model.layers
        native._decoder.layers = 1
        try:
            ours = native.run(batch)
            step.native_decode, model.layers = None, layers[:1]
            theirs = run_model(batch)
        finally:
            native._decoder.layers, model.layers, step.native_decode = len(layers), layers, native
        diffs.append(((ours - theirs).abs().max() / theirs.abs().max()).item())
        return run_model(batch)

    monkeypatch.setattr(step, "run_model", both)
    greedy(codes_engine, dev_prompts(codes_engine, 2), 4)
    # ~1e-7 of the largest value; ~1e-5 where a last-bit difference moved one int8 rounding.
    # A wrong op (a sign in RoPE, a key of another head or request) is of order 1e-1.
    assert len(diffs) == 3 and max(diffs) < 1e-3, diffs


def test_the_real_model_decodes_in_c_with_its_own_top_choices(codes_engine):
    """Each token of a C step (fp16 keys and values) against one eager forward over the text
    so far (its prefill on the scratch-dequantized weights): ranked first, or within a
    near-tie of first."""
    step, model = codes_engine.worker.step, codes_engine.worker.state.model
    prompts = dev_prompts(codes_engine, 2)
    runs = step.native_decode.runs
    tokens = greedy(codes_engine, prompts, 12)
    assert step.native_decode.runs - runs >= 11  # both prompts decode in one batch
    for prompt, out in zip(prompts, tokens):
        logits = prompt_logits(model, prompt + out)[len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        gaps = logits.max(-1).values - chosen
        assert gaps.max().item() < 0.5, gaps


def test_the_kv_cache_is_fp16_beside_the_codes_unless_the_model_dtype_is_asked(
        codes_engine, model_path):
    pool = codes_engine.worker.state.kv_pool
    assert cpu_decode_step.half_kv_supported() == (pool.dtype == torch.float16)
    if pool.dtype != torch.float16:
        pytest.skip("this CPU has no F16C: the KV cache stays fp32")
    assert codes_engine.worker.step.native_decode._decoder.kv_half == 1
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)
        exact_kv = Engine(model=str(model_path), device="cpu", dtype="auto", max_kv_tokens=2048,
                          max_running_requests=3, progress=False, kv_cache_dtype="model")
    assert exact_kv.worker.state.kv_pool.dtype == torch.float32
    assert exact_kv.worker.step.native_decode._decoder.kv_half == 0
    prompts = dev_prompts(codes_engine, 2)
    half, full = greedy(codes_engine, prompts, 8), greedy(exact_kv, prompts, 8)
    # fp16 keys and values move logits by ~1e-3: the first tokens agree, and every token of
    # the fp16 run is the fp32 model's first choice on its text, or within a near-tie of it.
    assert [h[:2] for h in half] == [f[:2] for f in full]
    model = exact_kv.worker.state.model
    for prompt, out in zip(prompts, half):
        logits = prompt_logits(model, prompt + out)[len(prompt) - 1:-1]
        gaps = logits.max(-1).values - logits.gather(1, torch.tensor(out)[:, None])[:, 0]
        assert gaps.max().item() < 0.5, gaps
    assert pool.k_buffer[0].abs().max().item() > 0  # the C step wrote fp16 keys


def test_captured_layers_are_the_residual_stream_before_them(codes_engine, monkeypatch):
    """An EAGLE-3 head's features from the C step: the final states are those of one whole
    run, bit for bit, and each capture is the residual stream the layer reads (normed, it is
    what a run of only the layers before it gives)."""
    step, model = codes_engine.worker.step, codes_engine.worker.state.model
    native, run_model, checked = step.native_decode, step.run_model, []
    eps = model.config.rms_norm_eps
    capture = (1, 14, 26)

    def check(batch):
        if native.can_run(batch):
            whole = native.run(batch)
            final, captured = native.run_capturing(batch, capture)
            assert torch.equal(final, whole) and len(captured) == len(capture)
            for layer, state in zip(capture, captured):
                native._decoder.layers = layer
                try:
                    upto = native.run(batch)
                finally:
                    native._decoder.layers = model.config.num_layers
                normed = torch.nn.functional.rms_norm(state, state.shape[-1:], model.final_norm,
                                                      eps)
                torch.testing.assert_close(normed, upto, rtol=1e-5, atol=1e-5)
            checked.append(batch.batch_size)
        return run_model(batch)

    monkeypatch.setattr(step, "run_model", check)
    greedy(codes_engine, dev_prompts(codes_engine, 2), 3)
    assert checked == [2, 2]


def test_speculation_kept_off_decodes_the_target_in_c(model_path, codes_engine):
    """With EAGLE-3 on but the batch above spec.disable_above_batch_size, the plain way of
    the EAGLE step runs the target in C too (capturing the head's features), and gives the
    plain step's tokens."""
    from ipc.spec_settings import SpecSettings

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)
        spec = Engine(model=str(model_path), device="cpu", dtype="auto", max_kv_tokens=2048,
                      max_running_requests=3, progress=False,
                      spec=SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                                        disable_above_batch_size=1))
    native = spec.worker.step.native_decode
    assert native is not None
    prompts = dev_prompts(codes_engine, 2)
    assert greedy(spec, prompts, 8) == greedy(codes_engine, prompts, 8)
    assert native.runs >= 7  # every decode step of the pair, none drafting


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_the_verify_runs_in_c_and_gives_the_plain_steps_tokens(model_path, codes_engine,
                                                               monkeypatch, topk):
    """Always drafting, the verify of each request's 4 nodes runs in C as one row per node
    (a chain: cpu_decode_step.causal_rows; a tree: tree_rows, each node over its prefix and
    its ancestors): two requests of different lengths in one batch give the plain step's
    greedy tokens, and no decode step reaches the torch decoder."""
    from ipc.spec_settings import SpecSettings

    monkeypatch.setenv(cpu_decode_step.ENV_CODES_ROWS, "8")  # 2 requests x 4 nodes in C
    monkeypatch.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)
    spec = Engine(model=str(model_path), device="cpu", dtype="auto", max_kv_tokens=2048,
                  max_running_requests=3, progress=False,
                  spec=SpecSettings("eagle3", "", num_steps=3, topk=topk, num_draft_tokens=4,
                                    disable_above_batch_size=0))
    native, model = spec.worker.step.native_decode, spec.worker.state.model
    assert native is not None and native.max_batch == 8
    torch_forwards: list[int] = []
    hidden_states = model.hidden_states

    def record(batch, *args, **kwargs):
        torch_forwards.append(batch.num_tokens)
        return hidden_states(batch, *args, **kwargs)

    monkeypatch.setattr(model, "hidden_states", record)
    prompts = dev_prompts(codes_engine, 2)
    assert greedy(spec, prompts, 12) == greedy(codes_engine, prompts, 12)
    assert native.runs >= 4  # 11 tokens after the first at most 4 a step
    assert all(n > 8 for n in torch_forwards), torch_forwards  # only the prompts' prefills


def test_a_short_prefill_chunk_runs_in_c_and_gives_the_eagle_steps_tokens(model_path,
                                                                          monkeypatch):
    """A prompt of at most the C step's rows prefills there too, one row per token
    (cpu_decode_step.causal_rows), in the plain step as in the EAGLE step's target: both
    give the same tokens (through torch's forward with the same kernel the activations round
    differently, which can flip a near-tie; SmolLM2 has one on dev prompt 3 at 124 tokens),
    close to the fp32 model's, and no forward reaches the torch decoder."""
    from ipc.spec_settings import SpecSettings

    monkeypatch.setenv(cpu_decode_step.ENV_CODES_ROWS, "80")  # both prompts at once
    monkeypatch.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)

    def engine(spec=None) -> Engine:
        return Engine(model=str(model_path), device="cpu", dtype="auto", max_kv_tokens=1024,
                      max_running_requests=2, progress=False, spec=spec)

    plain = engine()
    native, model = plain.worker.step.native_decode, plain.worker.state.model
    torch_forwards: list[int] = []
    hidden_states = model.hidden_states
    monkeypatch.setattr(model, "hidden_states", lambda batch, *a, **k: torch_forwards.append(
        batch.num_tokens) or hidden_states(batch, *a, **k))
    prompts = [p[:36] for p in dev_prompts(plain, 2)]
    runs = native.runs
    tokens = greedy(plain, prompts, 6)
    assert torch_forwards == [] and native.runs - runs >= 6  # two prefills, >= 5 decodes
    spec = engine(SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                               disable_above_batch_size=0))
    assert greedy(spec, prompts, 6) == tokens
    # and each prompt's first token is the fp32 model's (its logits, teacher-forced)
    for prompt, out in zip(prompts, tokens):
        assert prompt_logits(model, prompt)[-1].argmax().item() == out[0]


@pytest.mark.parametrize("family,kind", [("gemma3", "Q4_0"), ("gemma3", "Q5_0"),
                                         ("qwen3", "Q8_0"), ("mistral", "Q4_1")])
def test_other_families_decode_in_c_as_their_torch_decoder_does(family, kind, tmp_path,
                                                               monkeypatch):
    """Gemma 3 (q/k and sandwich norms, GELU, windowed local layers with their own RoPE base;
    Q5_0 as two 4-bit digits over [x, x]), Qwen3 (q/k norms; Q8_0 codes) and Mistral (a
    window on every layer): every decode step in C against the model's torch decoder on the
    same kernels, over prompts past the window (8 tokens)."""
    import gguf

    from tests.gpu import family_models as fm
    path = fm.write_gguf(fm.random_model(family), family, tmp_path / f"{family}.gguf",
                         gguf.GGMLQuantizationType[kind])
    monkeypatch.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)
    engine = Engine(model=str(path), device="cpu", dtype="auto", page_size=4,
                    max_kv_tokens=512, max_running_requests=2, progress=False)
    step, state = engine.worker.step, engine.worker.state
    assert cpu_decode_step.why_not(state.model, state.attn) is None
    native, run_model = step.native_decode, step.run_model
    diffs = []

    def both(batch):
        if not native.can_run(batch):
            return run_model(batch)
        ours = native.run(batch)
        step.native_decode = None
        try:
            theirs = run_model(batch)
        finally:
            step.native_decode = native
        diffs.append(((ours - theirs).abs().max() / theirs.abs().max()).item())
        return run_model(batch)

    monkeypatch.setattr(step, "run_model", both)
    prompts = [[fm.BOS] + [(7 * i * i + 3 * i + j) % 300 for i in range(n)]
               for j, n in ((0, 29), (1, 17))]
    greedy(engine, prompts, 6)
    # The two agree to ~1e-6 of the largest value, up to ~1e-2 where a last-bit difference
    # moved one int8 rounding of a projection's input; a wrong window, RoPE table, norm or
    # activation moves every step by tenths of it.
    assert len(diffs) >= 5 and sorted(diffs)[len(diffs) // 2] < 1e-4 and max(diffs) < 5e-2, diffs


def test_a_greedy_batch_takes_the_lm_heads_argmax_without_its_logits(codes_engine, monkeypatch):
    """Greedy rows asking nothing else: the lm_head's argmax in C (LlamaModel.lm_head_tokens),
    never its [rows, vocab] logits, with the tokens the logits' argmax gives; a row asking
    for logprobs takes the logits. (The fixture's kernels take at most 2 rows.)"""
    model = codes_engine.worker.state.model
    prompts = dev_prompts(codes_engine, 2)
    calls = []
    fused = model.lm_head_tokens
    monkeypatch.setattr(model, "lm_head_tokens",
                        lambda h, draw=None: calls.append(h.shape[0]) or fused(h, draw))
    logits_rows = []
    full = model.logits
    monkeypatch.setattr(model, "logits",
                        lambda h, reuse=False: logits_rows.append(h.shape[0]) or full(h, reuse))
    tokens = greedy(codes_engine, prompts, 10)
    assert len(calls) >= 10 and max(calls) == 2 and not logits_rows
    hidden = torch.randn(2, model.config.hidden_size) * 3
    assert torch.equal(fused(hidden), full(hidden).argmax(-1))
    monkeypatch.setattr(model, "lm_head_tokens", lambda h, draw=None: None)  # the logits' way
    assert greedy(codes_engine, prompts, 10) == tokens and logits_rows
    logits_rows.clear()
    params = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True, logprobs=0)
    monkeypatch.setattr(model, "lm_head_tokens", fused)
    out = codes_engine.generate(prompts[:1], params)[0]
    assert out.token_ids == tokens[0][:4] and len(logits_rows) >= 4


def test_a_temperature_batch_draws_in_the_lm_head_without_its_logits(codes_engine, monkeypatch):
    """Seeded rows sampled at a temperature and nothing else: the 8-bit lm_head draws in C
    (cpu_sampling.lm_head_draw), never writing its logits, and gives the tokens the sampler
    draws from the written logits (cut_draw), also where a row asks for logprobs."""
    model = codes_engine.worker.state.model
    prompts = dev_prompts(codes_engine, 2)
    calls, logits_rows = [], []
    fused, full = model.lm_head_tokens, model.logits
    monkeypatch.setattr(model, "lm_head_tokens",
                        lambda h, draw=None: calls.append(draw is not None) or fused(h, draw))
    monkeypatch.setattr(model, "logits",
                        lambda h, reuse=False: logits_rows.append(h.shape[0]) or full(h, reuse))
    params = SamplingParams(temperature=0.9, seed=7, max_new_tokens=10, ignore_eos=True)
    drawn = [o.token_ids for o in codes_engine.generate(prompts, params)]
    assert sum(calls) >= 10 and not logits_rows
    assert drawn != greedy(codes_engine, prompts, 10)  # sampled, not the argmax
    monkeypatch.setattr(model, "lm_head_tokens", lambda h, draw=None: None)
    assert [o.token_ids for o in codes_engine.generate(prompts, params)] == drawn
    assert logits_rows
    with_logprobs = msgspec.structs.replace(params, logprobs=0)
    assert [o.token_ids for o in codes_engine.generate(prompts, with_logprobs)] == drawn


def test_the_workers_logits_are_written_into_one_buffer_kept_between_steps(codes_engine):
    """logits(reuse=True), what a worker's sampled step takes: the same numbers as a fresh
    product, written into a buffer the model keeps (grown for more rows, never shrunk), so
    a step maps no new [rows, vocab] tensor (gpu/heap.py)."""
    model = codes_engine.worker.state.model
    hidden = torch.randn(2, model.config.hidden_size) * 3
    fresh = model.logits(hidden)
    kept = model.logits(hidden, reuse=True)
    assert torch.equal(kept, fresh) and kept.is_contiguous()
    again = model.logits(hidden[:1] * 2, reuse=True)
    assert again.data_ptr() == kept.data_ptr()  # the same memory, rewritten
    assert torch.equal(again, model.logits(hidden[:1] * 2))
    assert model.logits(hidden).data_ptr() != kept.data_ptr()  # without reuse: a new tensor


def test_a_step_of_headless_requests_runs_as_the_plain_step(model_path, codes_engine,
                                                            monkeypatch):
    """Under "auto", requests admitted where drafting measured far slower run headless; a step
    holding only such requests runs through a plain step on the same state and C step
    (gpu/eagle/headless_steps.py): the plain engine's tokens, the head never runs, and the
    gate still counts those steps toward its probe and times them as the plain way."""
    from gpu.eagle.drafter import Drafter
    from gpu.eagle.spec_gate import TRIALS
    from ipc.spec_settings import SpecSettings

    monkeypatch.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)
    spec = Engine(model=str(model_path), device="cpu", dtype="auto", max_kv_tokens=2048,
                  max_running_requests=4, progress=False,
                  spec=SpecSettings("eagle3", "", num_steps=3, topk=1, num_draft_tokens=4,
                                    disable_above_batch_size="auto"))
    step = spec.worker.step
    assert step.headless is not None and step.headless.plain.native_decode is step.native_decode
    gate = step.gate
    for _ in range(TRIALS):  # 4 requests: drafting 5 ms a token, plain 2.5
        gate.record(4, True, 0.040, 8), gate.record(4, False, 0.010, 4)
    assert gate.admits_headless(4)
    plain_steps, head_runs = [], []
    launch, forward = step.headless.launch, Drafter.forward
    monkeypatch.setattr(step.headless, "launch", lambda *a: plain_steps.append(1) or launch(*a))
    monkeypatch.setattr(Drafter, "forward",
                        lambda self, *a: head_runs.append(1) or forward(self, *a))
    steps_before, probe_before = gate.classes[4].plain.steps, gate.classes[4].since_probe
    prompts = dev_prompts(codes_engine, 4)
    assert greedy(spec, prompts, 6) == greedy(codes_engine, prompts, 6)
    assert len(plain_steps) >= 6 and head_runs == []  # the prefill and every decode step
    assert gate.classes[4].since_probe > probe_before  # counted toward the probe
    assert gate.classes[4].plain.steps > steps_before  # and timed as the plain way
