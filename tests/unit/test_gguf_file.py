"""shared.gguf_file reads what gguf.GGUFReader reads, without decoding arrays up front, and
refuses malformed files with a ValueError naming what is wrong."""

import struct

import gguf
import numpy as np
import pytest

from shared.gguf_file import GGUFFile
from shared.model_source import default_model_path, read_gguf_scalars


def _write_sample(path: str, alignment: int | None = None) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_block_count(2)
    writer.add_uint8("test.u8", 250)
    writer.add_int8("test.i8", -7)
    writer.add_uint16("test.u16", 65000)
    writer.add_int16("test.i16", -30000)
    writer.add_int32("test.i32", -2_000_000_000)
    writer.add_uint64("test.u64", 2**63 + 5)
    writer.add_int64("test.i64", -(2**62))
    writer.add_float32("test.f32", 0.25)
    writer.add_float64("test.f64", 1e-300)
    writer.add_bool("test.bool", True)
    writer.add_string("test.str", "héllo ✓")
    writer.add_string("test.empty", "")
    writer.add_array("test.strings", ["a", "", "ü" * 70, "<|end|>"])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.5])
    rng = np.random.default_rng(0)
    writer.add_tensor("plain.f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("plain.f16", rng.standard_normal((2, 4, 6)).astype(np.float16))
    writer.add_tensor("plain.i32", np.arange(7, dtype=np.int32))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                              gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blocks.q8_0", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def sample(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "sample.gguf")
    _write_sample(path)
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_fields_and_tensors_are_gguf_readers(tmp_path, alignment):
    path = str(tmp_path / "sample.gguf")
    _write_sample(path, alignment)
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    # GGUFReader adds the header's counts as GGUF.* pseudo-fields.
    stored = {k: f for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.fields) == list(stored)
    for key, field in stored.items():
        assert ours.get_field(key).contents() == field.contents(), key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.tensor_type == ref.tensor_type
        assert mine.shape.tolist() == ref.shape.tolist()
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (
            ref.n_elements, ref.n_bytes, ref.data_offset)
        assert mine.data.dtype == ref.data.dtype and mine.data.shape == ref.data.shape
        assert np.array_equal(mine.data, ref.data)
        if mine.tensor_type != gguf.GGMLQuantizationType.I32:
            assert np.array_equal(gguf.quants.dequantize(mine.data, mine.tensor_type),
                                  gguf.quants.dequantize(ref.data, ref.tensor_type))


def test_values_keep_their_types(sample):
    fields = GGUFFile(sample).fields
    assert fields["test.u64"].contents() == 2**63 + 5
    assert fields["test.bool"].contents() is True
    assert fields["test.str"].contents() == "héllo ✓"
    assert fields["test.strings"].contents() == ["a", "", "ü" * 70, "<|end|>"]
    assert GGUFFile(sample).get_field("absent") is None


def test_the_default_model_opens_without_decoding_its_vocabulary():
    path = default_model_path()
    model = GGUFFile(path)
    assert model.fields["tokenizer.ggml.tokens"].count == 49152
    assert model.fields["general.architecture"].contents() == "llama"
    embedding = next(t for t in model.tensors if t.name == "token_embd.weight")
    assert embedding.shape.tolist() == [576, 49152]  # ggml's order: innermost first
    scalars, arrays = read_gguf_scalars(path)
    assert scalars["llama.vocab_size"] == 49152
    assert arrays["tokenizer.ggml.merges"] == model.fields["tokenizer.ggml.merges"].count


def _expect_refused(path, match: str, tensors: bool = False) -> None:
    with pytest.raises(ValueError, match=match):
        reader = GGUFFile(str(path))
        if tensors:
            reader.tensors  # noqa: B018 - the table is parsed on first use


def test_malformed_files_are_refused_naming_the_problem(sample, tmp_path):
    data = open(sample, "rb").read()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + data[4:])
    _expect_refused(bad, "not a GGUF file")
    bad.write_bytes(b"")
    _expect_refused(bad, "not a GGUF file")
    bad.write_bytes(data[:4] + struct.pack(">I", 3) + data[8:])
    _expect_refused(bad, "big-endian")
    bad.write_bytes(data[:4] + struct.pack("<I", 1) + data[8:])
    _expect_refused(bad, "version 1")
    # Cut inside the metadata (the string array's bytes), then inside the tensor data.
    cut = data.index("ü".encode()) + 10
    bad.write_bytes(data[:cut])
    _expect_refused(bad, "not a well-formed GGUF")
    bad.write_bytes(data[:-100])
    _expect_refused(bad, "'blocks.q8_0' runs past the end", tensors=True)
    # A string whose length runs past the end of the file.
    key = data.index(b"test.str") + len(b"test.str") + 4
    bad.write_bytes(data[:key] + struct.pack("<Q", 2**40) + data[key + 8:])
    _expect_refused(bad, "not a well-formed GGUF")


def test_an_unknown_tensor_type_or_alignment_is_refused(sample, tmp_path):
    data = bytearray(open(sample, "rb").read())
    name = data.index(b"plain.i32")
    # The tensor info after the name: n_dims (1), one dim (7), then the type.
    type_at = name + len(b"plain.i32") + 4 + 8
    assert struct.unpack_from("<I", data, type_at)[0] == gguf.GGMLQuantizationType.I32
    struct.pack_into("<I", data, type_at, 999)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    _expect_refused(bad, "'plain.i32' has unknown ggml type 999", tensors=True)

    aligned = tmp_path / "aligned.gguf"
    _write_sample(str(aligned), alignment=64)
    data = bytearray(aligned.read_bytes())
    value_at = data.index(b"general.alignment") + len(b"general.alignment") + 4
    assert struct.unpack_from("<I", data, value_at)[0] == 64
    struct.pack_into("<I", data, value_at, 48)
    aligned.write_bytes(bytes(data))
    _expect_refused(aligned, "alignment 48 is not a power of two", tensors=True)
