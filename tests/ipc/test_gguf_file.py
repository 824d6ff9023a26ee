"""ipc.gguf_file against the gguf package's own reader (an independent implementation)."""

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf.quants import quantize

from ipc.gguf_file import GGUFFile, GGUFFormatError


def assert_same_as_gguf_reader(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]  # its pseudo-fields
    assert list(ours.fields) == keys
    for key in keys:
        if key != "t.nested":  # GGUFReader.contents() flattens arrays of arrays; we keep them
            assert ours.fields[key] == theirs.fields[key].contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name
        assert not a.data.flags.writeable  # a view of the file, never written through
    return ours


def test_the_default_model_reads_as_the_gguf_package_reads_it(gguf_path):
    ours = assert_same_as_gguf_reader(gguf_path)
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert ours.fields["general.architecture"] == "llama"


def write_sample(path: Path, endianess=gguf.GGUFEndian.LITTLE, alignment: int | None = None):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama", endianess=endianess)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 250)
    w.add_int8("t.i8", -7)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -2_000_000_000)
    w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo, wörld ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strs", ["a", "", "Ġthe", "<|im_end|>"])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # byte shape (4, 68)
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_type_and_tensor_kind_reads_as_the_gguf_package_reads_it(tmp_path, alignment):
    path = tmp_path / "sample.gguf"
    write_sample(path, alignment=alignment)
    ours = assert_same_as_gguf_reader(path)
    assert ours.fields["t.u64"] == 2**63 + 5 and ours.fields["t.str"] == "héllo, wörld ✓"
    assert ours.fields["t.nested"] == [[1, 2], [3]]
    q8 = next(t for t in ours.tensors if t.name == "q8")
    assert q8.data.shape == (4, 68)  # 2 blocks of 34 bytes a row


def test_bad_files_fail_with_what_is_wrong(tmp_path):
    path = tmp_path / "sample.gguf"
    write_sample(path)
    good = path.read_bytes()
    cases = {
        "empty.gguf": (b"", "empty"),
        "magic.gguf": (b"GGML" + good[4:], "not a GGUF file"),
        "header.gguf": (good[:200], "past the end|unpack"),  # cut inside the metadata
        "data.gguf": (good[:-40], "tensor 'i32' runs past the end"),
    }
    for name, (data, message) in cases.items():
        bad = tmp_path / name
        bad.write_bytes(data)
        with pytest.raises(GGUFFormatError, match=message):
            GGUFFile(bad)

    big = tmp_path / "big.gguf"
    write_sample(big, endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(GGUFFormatError, match="big-endian"):
        GGUFFile(big)
