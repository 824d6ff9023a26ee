"""Shared test set-up. Environment defaults come first, before any test module imports triton."""

import os
from pathlib import Path

import pytest
import torch

# Under pytest-xdist (scripts/test.sh runs two workers on a 2-core machine) each worker, and
# every process it starts, keeps to one thread: two workers of two OpenMP threads each would
# spin against each other at every barrier.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
# Without a GPU, Triton kernels run in Triton's CPU interpreter; it reads this variable when
# triton is first imported, so it must be set before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The WRWR check on the FutureMap output buffer is always on under test (see DESIGN.md, item 6).
os.environ.setdefault("FMSERVE_WRWR_CHECK", "1")
# So is the host-sync check on every launch (gpu/sync_guard.py): every step any test runs, in
# process or in a worker, is checked to wait for nothing on a GPU.
os.environ.setdefault("FMSERVE_SYNC_CHECK", "1")
# runtime.compile = "auto" means off under test: compiling the decode step costs seconds to a
# minute per model. tests/gpu/test_compiled_decode.py asks for it with compile="on".
os.environ.setdefault("FMSERVE_COMPILE", "off")
# On a CPU without native bf16 the fp32 model's hand-over between its 4-bit codes and its fp16
# packs is measured at every worker start while the machine is busy (gpu/cpu_kernels.py): a
# few seconds each under the suite. Fixed here; tests/gpu/test_cpu_kernels.py measures it.
os.environ.setdefault("FMSERVE_CPU_CODES_ROWS", "2")
# On a CPU with native bf16, dtype "auto" for a GGUF is bf16 or fp32 on the C kernel, whichever
# a timing says is faster (gpu/cpu_dtype.py); on a busy machine two workers of one test could
# choose differently. Fixed to bf16, the suite's choice there before; tests/gpu/test_cpu_dtype.py
# measures it, and the fp32 path is what CPUs without native bf16 run.
os.environ.setdefault("FMSERVE_CPU_DTYPE", "bf16")
# The EAGLE "auto" gate starts empty in every test, and keeps nothing: short runs on a busy
# machine must not teach a real service (gpu/eagle/gate_memory.py; tests/gpu/test_spec_gate.py
# gives it a file of its own).
os.environ.setdefault("FMSERVE_GATE_CACHE", "off")


@pytest.fixture(scope="session")
def model_path() -> Path:
    """The model the tests run: $FMSERVE_MODEL if set, else the default model (fetched if needed)."""
    if env := os.environ.get("FMSERVE_MODEL"):
        return Path(env)
    from fmserve.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gguf_path(model_path) -> Path:
    """The test model as a .gguf, for tests that compare with transformers' GGUF loader."""
    if model_path.suffix != ".gguf":
        pytest.skip("these tests compare against transformers' GGUF loader, and "
                    "FMSERVE_MODEL names a model that is not a .gguf")
    return model_path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for the module (small tensors: OpenMP barriers only cost there);
    a module opts in with an autouse fixture that asks for this one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A random 2-layer Llama written by transformers, with the default model's attention
    geometry (9 heads, 3 KV heads of 64) and a 96-token word-level tokenizer (prompts are token
    ids below 96). For engine tests whose cost is per layer, such as Triton's interpreter."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=576, intermediate_size=384,
                         num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=512, rope_theta=100000.0, bos_token_id=1,
                         eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(96)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    return path
