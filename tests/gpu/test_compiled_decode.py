"""The compiled decode step (gpu/compiled_decode.py): where it applies, that it gives the eager
step's greedy tokens (fp32) through padded buckets and on the real model's dev prompts (built
in the background), that on a CPU without native bf16 it traces the C kernel on the codes,
that inductor writes its cache under the fmserve cache dir, that a sliding-window model
(Gemma 3's local and global layers, one mask each in the graph) decodes as transformers does,
and that runtime.compile = "off" runs eagerly.

The only module of the suite that compiles (tests/conftest.py sets FMSERVE_COMPILE=off, so
"auto" is off elsewhere). Compiling costs seconds a bucket for 2-layer models and ~35 s cold
on 2 cores for the default model, which one test compiles (into the ordinary cache dir, so a
rerun is warm: ~7 s); the others compile tiny ones."""

from __future__ import annotations

import contextlib
import itertools
import logging
from typing import Iterator

import pytest
import torch

from fmserve.bench import DEV_PROMPTS
from fmserve.engine import Engine
from fmserve.jsonl import read_prompts
from gpu.compiled_decode import ENV_COMPILE, compile_applies, compile_mode
from ipc.cache_dirs import compile_cache_dir
from ipc.sampling import SamplingParams
from tests.engine_runs import assert_accounting_empty
from tests.gpu import family_models as fm
from tests.gpu.teacher_forcing import prompt_logits

CPU = torch.device("cpu")
# Budgets differ, so one batch shrinks 4, 3, 2, 1: buckets 4, 4 (one padding row), 2 and 1.
PROMPTS = [[1, 7, 9, 30], [1, 40, 2, 11, 12, 60, 61], [1, 5], [1, 88, 17, 17, 3, 4, 50]]


def test_compile_applies_to_cpu_bf16_and_fp32_with_the_torch_backend():
    assert compile_applies("auto", CPU, torch.bfloat16, "torch", False)
    assert compile_applies("auto", CPU, torch.float32, "torch", False)
    # no all-reduce traced: eager for these
    assert not compile_applies("auto", CPU, torch.float32, "torch", False, tp=2)
    # FBGEMM's packed weights (gpu/cpu_kernels.py) cannot be traced: where one stream's
    # forward reaches them, eager, and "on" refused; where its rows stay on the codes, compiled
    assert not compile_applies("auto", CPU, torch.float32, "torch", False, kernel_max_rows=0)
    with pytest.raises(ValueError, match="cannot trace"):
        compile_applies("on", CPU, torch.float32, "torch", False, kernel_max_rows=0)
    assert compile_applies("auto", CPU, torch.float32, "torch", False, kernel_max_rows=1)
    assert not compile_applies("off", CPU, torch.float32, "torch", False)
    for device, dtype, backend, det in [(torch.device("cuda"), torch.bfloat16, "torch", False),
                                        (CPU, torch.float16, "torch", False),
                                        (CPU, torch.float32, "triton", False),
                                        (CPU, torch.float32, "torch", True)]:
        assert not compile_applies("auto", device, dtype, backend, det)
        with pytest.raises(ValueError, match="cannot apply"):
            compile_applies("on", device, dtype, backend, det)


def test_the_environment_decides_what_auto_means(monkeypatch):
    monkeypatch.setenv(ENV_COMPILE, "off")
    assert (compile_mode("auto"), compile_mode("on"), compile_mode("off")) == ("off", "on", "off")
    monkeypatch.setenv(ENV_COMPILE, "on")
    assert compile_mode("auto") == "on"
    monkeypatch.delenv(ENV_COMPILE)
    assert compile_mode("auto") == "auto"


def test_the_compile_cache_is_under_the_fmserve_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FMSERVE_CACHE", str(tmp_path / "models"))
    assert compile_cache_dir() == tmp_path / "models" / "inductor"


def test_compile_off_and_auto_under_test_run_eagerly(tiny_llama):
    for mode in ("off", "auto"):  # "auto" is off here: FMSERVE_COMPILE=off (conftest)
        engine = Engine(model=str(tiny_llama), device="cpu", dtype="fp32", compile=mode,
                        max_kv_tokens=256, max_running_requests=2, progress=False)
        assert engine.worker.step.compiled_decode is None


def greedy(engine: Engine, prompts, max_new_tokens, overlap: bool = False) -> list[list[int]]:
    engine.overlap = overlap
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
              for n in max_new_tokens]
    out = [c.token_ids for c in engine.generate(prompts, params)]
    assert_accounting_empty(engine)
    return out


@pytest.fixture(scope="module")
def tiny_cache_dir(tmp_path_factory):
    """A fresh fmserve cache dir for the tiny model's compiles (the second test to compile
    it finds the FX graphs cached)."""
    return tmp_path_factory.mktemp("fmserve-cache")


@pytest.fixture
def tiny_cache(tiny_cache_dir, monkeypatch):
    """Compiles in this test go to `tiny_cache_dir` (and no TORCHINDUCTOR_CACHE_DIR). Tests
    of the tiny model only: the cache dir must not reach the real model's test, which
    compiles into the ordinary one."""
    monkeypatch.setenv("FMSERVE_CACHE", str(tiny_cache_dir))
    # torch's own default counts as unset (torch writes it into the variable itself)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    return tiny_cache_dir


@pytest.fixture
def tiny_compiled(tiny_llama, tiny_cache):
    """An engine compiling into the tiny model's cache dir, every bucket in its step."""
    engine = Engine(model=str(tiny_llama), device="cpu", dtype="fp32", compile="on",
                    max_kv_tokens=1024, max_running_requests=4, progress=False)
    return engine, tiny_cache


def test_padded_buckets_give_the_eager_tokens_and_fill_the_cache(tiny_compiled):
    engine, cache = tiny_compiled
    step = engine.worker.step
    compiled = step.compiled_decode
    assert compiled is not None and compiled.sizes == [1, 2, 4]
    assert compiled.ready == {1} and not compiled.failed  # bucket 1 at start-up
    budgets = [2 + 3 * i for i in range(len(PROMPTS))]
    step.compiled_decode = None
    eager = greedy(engine, PROMPTS, budgets)
    assert len({tuple(t) for t in eager}) > 1  # the prompts lead to different outputs
    step.compiled_decode = compiled
    from torch._dynamo.utils import counters  # dynamo is imported by now (the compile)
    graphs = counters["stats"]["unique_graphs"]
    assert greedy(engine, PROMPTS, budgets) == eager
    assert compiled.ready == {1, 2, 4} and not compiled.failed
    # buckets 2 and 4 share one graph, its batch size dynamic (bucket 1's is its own)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    runs = compiled.runs
    assert runs >= sum(budgets) // 4  # most decode steps ran compiled
    assert greedy(engine, PROMPTS, budgets, overlap=True) == eager
    assert compiled.runs >= 2 * runs
    # inductor's caches (FX graphs, AOT autograd) went under the fmserve cache dir
    cached = {p.name for p in (cache / "inductor").iterdir()}
    assert {"fxgraph", "aotautograd"} <= cached, sorted(cached)


def test_auto_builds_a_larger_batchs_bucket_on_a_thread_while_steps_run_eagerly(
        tiny_llama, tiny_cache, monkeypatch):
    """runtime.compile = "auto": bucket 1 at start-up; the first batch of 3-4 rows starts
    bucket 4's build on a thread and every decode step runs eagerly until it is built (the
    step does not wait for the compile); once built, batches of that bucket run compiled.
    The tokens are the eager step's throughout. While a build runs, the steps take one torch
    thread fewer (the build holds a core), and get them back once it is done."""
    monkeypatch.setenv(ENV_COMPILE, "auto")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # a pytest-xdist worker runs on one
    try:
        auto_builds_a_larger_batchs_bucket(tiny_llama)
    finally:
        torch.set_num_threads(threads)


def auto_builds_a_larger_batchs_bucket(tiny_llama) -> None:
    engine = Engine(model=str(tiny_llama), device="cpu", dtype="fp32", compile="auto",
                    max_kv_tokens=1024, max_running_requests=4, progress=False)
    step = engine.worker.step
    compiled = step.compiled_decode
    assert compiled.background_buckets and compiled.sizes == [1, 2, 4]
    assert compiled.ready == {1} and compiled.background is None
    budgets = [2 + 3 * i for i in range(len(PROMPTS))]
    step.compiled_decode = None
    eager = greedy(engine, PROMPTS, budgets)
    step.compiled_decode = compiled
    states = []  # each step's decode_compile, read from the worker's results
    threads = {"building": set(), "on": set()}  # torch's threads by decode_compile
    finish = engine.worker.finish

    def finish_and_record(pending):
        result = finish(pending)
        states.append(result.decode_compile)
        threads[result.decode_compile].add(torch.get_num_threads())
        return result

    engine.worker.finish = finish_and_record
    runs = compiled.runs
    assert greedy(engine, PROMPTS, budgets) == eager
    # the first decode step of four rows started bucket 4's build and ran eagerly
    assert compiled.background is not None and "building" in states, states
    assert compiled.runs == runs or 4 in compiled.ready
    for _ in range(3):  # each run's largest new bucket is built on a thread meanwhile
        engine.worker.finish_background_compile()  # as an offline engine waits at exit
        assert not compiled.building, "the bucket's build did not end"
        assert greedy(engine, PROMPTS, budgets) == eager
    assert compiled.ready == {1, 2, 4} and not compiled.failed
    assert compiled.background.join(timeout_s=600) and not compiled.building
    runs, states[:] = compiled.runs, []
    assert greedy(engine, PROMPTS, budgets) == eager
    assert compiled.runs - runs >= sum(budgets) // 4 and set(states) == {"on"}, states
    assert threads == {"building": {1}, "on": {2}}, threads


def test_the_real_model_serves_eagerly_while_compiling_then_gives_the_same_tokens(model_path):
    """fp32, one request at a time (bucket 1 only: the compile is the expensive part), built in
    the background as in the worker process: ready before the compiled step is, a request
    answered eagerly meanwhile, and the compiled step's greedy tokens equal to those."""
    engine = Engine(model=str(model_path), device="cpu", dtype="fp32", compile="on",
                    max_kv_tokens=2048, max_running_requests=2, progress=False,
                    background_compile=True)
    step = engine.worker.step
    compiled = step.compiled_decode
    assert engine.info.decode_compile == "building"  # what WorkerReady carries
    prompts = [engine.encode(p) for p in itertools.islice(read_prompts(str(DEV_PROMPTS)), 2)]
    results = []  # every step's StepResult, read from the worker
    finish = engine.worker.finish
    engine.worker.finish = lambda pending: results.append(finish(pending)) or results[-1]
    first = greedy(engine, [prompts[0]], [10])[0]  # while the compile may still run
    # the prefill and the first decode step ran (eagerly) while the compile was being built
    assert [r.decode_compile for r in results[:2]] == ["building", "building"]
    assert compiled.background.join(timeout_s=600), "the background compile did not end"
    assert compiled.state == "on" and compiled.ready == {1}, compiled.failed
    step.compiled_decode = None
    eager = [greedy(engine, [p], [10])[0] for p in prompts]
    assert eager[0] == first
    step.compiled_decode, runs, results[:] = compiled, compiled.runs, []
    assert [greedy(engine, [p], [10])[0] for p in prompts] == eager
    assert compiled.runs - runs >= 2 * 8  # the decode steps ran compiled
    assert {r.decode_compile for r in results} == {"on"}


@contextlib.contextmanager
def reused_layer_traces() -> Iterator[list[str]]:
    """The messages in which dynamo reuses a nested compile region's trace for another call
    (torch's "hierarchical_compile" log, read at DEBUG without changing torch's handlers)."""
    hits: list[str] = []

    class Hits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "cache hit" in (message := record.getMessage()):
                hits.append(message)

    log = logging.getLogger("torch._dynamo.variables.invoke_subgraph.__hierarchical_compile")
    handler, level = Hits(), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    try:
        yield hits
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def test_a_windowed_model_decodes_compiled_as_transformers_tracing_one_layer(tmp_path):
    """A tiny Gemma 3 (window 8 on five layers, the sixth global), one request decoding past
    the window: bucket 1 only. Dynamo traces the layer twice (the first layer has no MLP
    output to add) and reuses that trace for the four others, the global one included (its
    mask and RoPE tables are inputs like the windowed layers')."""
    model = fm.random_model("gemma3")
    with reused_layer_traces() as hits:
        engine = Engine(model=str(fm.save_hf_dir(model, tmp_path)), device="cpu", dtype="fp32",
                        compile="on", page_size=4, max_kv_tokens=256, max_running_requests=1,
                        progress=False)
    compiled = engine.worker.step.compiled_decode
    assert compiled is not None and compiled.ready == {1}, compiled.failed
    assert len(hits) == len(engine.worker.state.model.layers) - 2 == 4, hits
    prompt = [fm.BOS] + [(7 * i * i + 3 * i) % 300 for i in range(13)]
    assert greedy(engine, [prompt], [10]) == [fm.reference_greedy(model, prompt, 10)]
    assert compiled.runs >= 9


def test_a_cpu_without_native_bf16_compiles_one_streams_step_on_the_c_kernel(tmp_path,
                                                                            monkeypatch):
    """dtype "auto" where it means fp32 (an AVX2-only CPU, as resolve_dtype says there), on a
    tiny Llama GGUF in Q4_0: the projections keep the file's codes for a decode step's rows
    (gpu/cpu_q4_kernel.py) and FBGEMM fp16 packs above; the compiled step (compile = "on"
    keeps it over the C decode step) traces the C kernel. Its tokens are not always the eager
    step's: the kernel rounds its input to int8, so the fused norms' last-bit differences can
    move a near-tie. So each compiled token is checked against the model's own logits for the
    text so far (one eager forward), which must rank it first or within a near-tie of first."""
    import gguf

    from gpu import cpu_q4_kernel, worker_state
    if not cpu_q4_kernel.available():
        pytest.skip("the C kernel is not built here")
    monkeypatch.setattr(worker_state, "resolve_dtype", lambda setting, device: torch.float32)
    path = fm.write_gguf(fm.random_model("llama"), "llama", tmp_path / "llama-q4_0.gguf",
                         gguf.GGMLQuantizationType.Q4_0)
    engine = Engine(model=str(path), device="cpu", dtype="auto", compile="on",
                    max_kv_tokens=256, max_running_requests=2, progress=False)
    model, compiled = engine.worker.state.model, engine.worker.step.compiled_decode
    assert model.wide_paths > 0 and model.kernel_max_rows >= 1
    assert compiled is not None and compiled.ready == {1}, compiled and compiled.failed
    assert compiled.max_batch <= model.kernel_max_rows  # no bucket reaches a pack
    prompts = [[fm.BOS] + [(7 * i * i + 3 * i + k) % 300 for i in range(13)] for k in (0, 5)]
    runs = compiled.runs
    on = [greedy(engine, [p], [10])[0] for p in prompts]
    assert compiled.runs - runs >= 2 * 8
    engine.worker.step.compiled_decode = None
    eager = [greedy(engine, [p], [10])[0] for p in prompts]
    assert [t[:3] for t in eager] == [t[:3] for t in on]
    for prompt, tokens in zip(prompts, on):
        logits = prompt_logits(model, prompt + tokens)[len(prompt) - 1:-1]
        chosen = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        gaps = logits.max(-1).values - chosen
        assert gaps.max().item() < 0.3, gaps
