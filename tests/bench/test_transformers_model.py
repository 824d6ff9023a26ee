"""fmserve/bench/transformers_model.py: transformers' reading of a GGUF, converted once and
then loaded from its saved dense copy, gives the same model as transformers' own reading (fp32
and bf16); a changed file is converted again. On a tiny Q8_0 Llama GGUF written here."""

import os

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM

from fmserve.bench import transformers_model as tm
from tests.gpu import family_models as fm


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("FMSERVE_CACHE", str(tmp_path / "cache"))
    return fm.write_gguf(fm.random_model("llama"), "llama", tmp_path / "tiny-q8_0.gguf",
                         gguf.GGMLQuantizationType.Q8_0)


def transformers_own(path, dtype):
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=dtype).eval()


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa)


def test_the_saved_copy_is_transformers_own_reading_in_fp32_and_bf16(tiny_gguf, monkeypatch):
    first = tm.load_transformers(tiny_gguf)
    saved = tm.saved_dir(tiny_gguf, "model")
    assert (saved / "model.safetensors").is_file() and (saved / "config.json").is_file()
    assert [p.name for p in saved.parent.iterdir()] == ["model"]  # no partial copy left
    # the second load must read the saved copy: transformers' GGUF reading is refused now
    import transformers.modeling_gguf_pytorch_utils as reader
    with monkeypatch.context() as mp:  # (the fixture's cache dir stays set)
        mp.setattr(reader, "load_gguf_checkpoint",
                   lambda *a, **k: pytest.fail("the GGUF was read again"))
        again = tm.load_transformers(tiny_gguf)
    reference = transformers_own(tiny_gguf, torch.float32)
    assert same_weights(first, reference) and same_weights(again, reference)
    assert not again.training
    ids = torch.tensor([[fm.BOS, 5, 9, 33, 7]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, reference(ids).logits)
    assert same_weights(tm.load_transformers(tiny_gguf, torch.bfloat16),
                        transformers_own(tiny_gguf, torch.bfloat16))


def test_a_changed_file_is_converted_again(tiny_gguf, tmp_path):
    tm.load_transformers(tiny_gguf)
    before = tm.saved_dir(tiny_gguf, "model")
    st = tiny_gguf.stat()
    os.utime(tiny_gguf, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert tm.saved_dir(tiny_gguf, "model") != before
    tm.load_transformers(tiny_gguf)
    assert (tm.saved_dir(tiny_gguf, "model") / "model.safetensors").is_file()
    assert before.is_relative_to(tmp_path / "cache")  # the fixture's cache dir, not the user's


def test_a_cache_that_cannot_be_written_still_gives_the_model(tiny_gguf, tmp_path, caplog):
    (tmp_path / "cache").write_text("a file where the cache dir should be")
    model = tm.load_transformers(tiny_gguf, torch.bfloat16)
    assert same_weights(model, transformers_own(tiny_gguf, torch.bfloat16))
    assert "could not keep transformers' reading of tiny-q8_0.gguf" in caplog.text


def test_the_conversion_parses_the_file_once(tiny_gguf, monkeypatch):
    """transformers parses a GGUF for its config and again for its weights; the conversion
    shares one parse (~20 s of Gemma 3's vocabulary), and gives gguf its reader back."""
    made = []
    original = gguf.GGUFReader

    def counting_reader(path, mode="r"):
        made.append(str(path))
        return original(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting_reader)
    model = tm.load_transformers(tiny_gguf)
    assert made == [str(tiny_gguf)]
    assert gguf.GGUFReader is counting_reader
    monkeypatch.undo()
    assert same_weights(model, transformers_own(tiny_gguf, torch.float32))
