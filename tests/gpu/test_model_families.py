"""Every family against transformers on tiny random-weight models built here (family_models):
from its HF directory and from GGUF files in F16 and Q8_0, through the offline engine: logits
at every prompt position within 1e-4 in fp32 and greedy tokens identical. Sliding windows
(Mistral's on every layer, Gemma 3's on its local layers) with both attention backends."""

from __future__ import annotations

import gguf
import pytest
import torch

from fmserve.engine import Engine
from gpu.loader.errors import ModelLoadError
from gpu.loader.hf_loader import hf_model_config
from gpu.loader.load import load_model
from ipc.sampling import SamplingParams
from tests.gpu import family_models as fm
from tests.engine_runs import prompt_logits

PROMPT = [fm.BOS] + [(7 * i * i + 3 * i) % 300 for i in range(29)]  # 30 tokens: past the window
NEW_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
F16, Q8_0 = gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0


@pytest.fixture(scope="module", params=sorted(fm.FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="module")
def model(family):
    return fm.random_model(family)


def engine_for(path, **settings) -> Engine:
    return Engine(model=str(path), dtype="fp32", page_size=4, max_kv_tokens=512,
                  max_running_requests=4, progress=False, **settings)


def check_against(engine: Engine, reference) -> None:
    ours = prompt_logits(engine, PROMPT)
    with torch.inference_mode():
        ref = reference(torch.tensor([PROMPT])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    [completion] = engine.generate([PROMPT], GREEDY)
    assert completion.token_ids == fm.reference_greedy(reference, PROMPT, NEW_TOKENS)


def test_hf_directory(family, model, tmp_path):
    engine = engine_for(fm.save_hf_dir(model, tmp_path))
    assert engine.worker.state.model_config.architecture == family
    check_against(engine, model)


@pytest.mark.parametrize("kind", [F16, Q8_0], ids=["F16", "Q8_0"])
def test_gguf(family, model, tmp_path, kind):
    engine = engine_for(fm.write_gguf(model, family, tmp_path / f"{family}.gguf", kind))
    config = engine.worker.state.model_config
    assert config.architecture == fm.FAMILIES[family][2]
    assert config.sliding_window == getattr(model.config, "sliding_window", None)
    check_against(engine, fm.as_stored(model, kind))


def test_the_reference_honours_the_window():
    """Else the sliding-window comparisons above could not fail."""
    windowed = fm.random_model("mistral")
    full = fm.random_model("mistral", sliding_window=None)
    with torch.inference_mode():
        a, b = (m(torch.tensor([PROMPT])).logits[0] for m in (windowed, full))
    window = windowed.config.sliding_window
    torch.testing.assert_close(a[:window], b[:window])
    assert (a[window:] - b[window:]).abs().max() > 1e-2


def test_gemma3_windows_and_rope_bases_count():
    """Else the Gemma 3 comparisons could not fail on its local layers: without the window, or
    with the global RoPE base on them, transformers' logits move."""
    model = fm.random_model("gemma3")
    others = [fm.random_model("gemma3", sliding_window=64),
              fm.random_model("gemma3", rope_local_base_freq=10000.0)]
    with torch.inference_mode():
        ref = model(torch.tensor([PROMPT])).logits[0]
        for other in others:
            assert (other(torch.tensor([PROMPT])).logits[0] - ref).abs().max() > 1e-2


def test_gemma3_attention_scalar_and_logit_softcap(tmp_path):
    """query_pre_attn_scalar other than head_dim and a final logit softcap, from config.json."""
    model = fm.random_model("gemma3", query_pre_attn_scalar=40, final_logit_softcapping=3.0)
    check_against(engine_for(fm.save_hf_dir(model, tmp_path)), model)


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sliding_window_chunked_prefill_and_decode(tmp_path, backend, family):
    """A 30-token prompt over a window of 8, prefilled in chunks of 8 on the cached prefix, then
    decoded past it; three requests in one batch, with overlap on. Gemma 3 mixes windowed and
    full layers."""
    model = fm.random_model(family)
    engine = engine_for(fm.save_hf_dir(model, tmp_path), attention_backend=backend,
                        max_tokens_per_step=8, overlap=True)
    prompts = [PROMPT, PROMPT[:13], PROMPT[5:]]
    for prompt, completion in zip(prompts, engine.generate(prompts, GREEDY)):
        assert completion.token_ids == fm.reference_greedy(model, prompt, NEW_TOKENS)


@pytest.mark.parametrize("changes, window", [
    (dict(), (None, None)),  # Qwen's sliding_window is off unless use_sliding_window says so
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=0), (8, None)),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=2), (None, None)),
    (dict(use_sliding_window=True, sliding_window=8, max_window_layers=1), (8, (1,))),
])
def test_qwen_sliding_window_settings(tmp_path, changes, window):
    config = hf_model_config(fm.hf_config("qwen2", **changes).to_dict(), tmp_path / "config.json")
    assert (config.sliding_window, config.window_layers) == window


@pytest.mark.parametrize("changes, layers", [
    (dict(), (0, 1, 2, 3, 4)),  # transformers' default pattern: every 6th layer is global
    (dict(sliding_window_pattern=2), (0, 2, 4)),
    (dict(layer_types=["full_attention", "sliding_attention"] * 3), (1, 3, 5)),
])
def test_gemma3_window_layers(tmp_path, changes, layers):
    raw = fm.hf_config("gemma3", **changes).to_dict()
    assert hf_model_config(raw, tmp_path / "config.json").window_layers == layers
    if "layer_types" not in changes:  # a config.json of transformers 4, without layer_types
        del raw["layer_types"]
        assert hf_model_config(raw, tmp_path / "config.json").window_layers == layers


def test_gemma3_settings_we_do_not_run_are_refused(tmp_path):
    for changes, match in [(dict(attn_logit_softcapping=50.0), "softcapping"),
                           (dict(hidden_activation="gelu"), "activation 'gelu'")]:
        raw = fm.hf_config("gemma3", **changes).to_dict()
        with pytest.raises(ModelLoadError, match=match):
            hf_model_config(raw, tmp_path / "config.json")


def test_a_tensor_of_another_family_is_refused(tmp_path):
    """A Qwen2 GGUF relabelled Qwen3 carries q/k/v biases a Qwen3 has no place for: named,
    not silently dropped."""
    path = fm.write_gguf(fm.random_model("qwen2"), "qwen2", tmp_path / "x.gguf", F16)
    path.write_bytes(path.read_bytes().replace(b"qwen2", b"qwen3"))  # the same length
    with pytest.raises(ModelLoadError, match=r"x.gguf: weights .*q_bias.* have no place in a "
                                             r"qwen3 model"):
        load_model(path, progress=False)
