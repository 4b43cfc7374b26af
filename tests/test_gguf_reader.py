"""kvserve's GGUF reader against ggml's own ``gguf.GGUFReader``: the same fields, tensors and bytes, and a clear
error for a damaged file."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from kvserve.errors import ModelLoadError
from kvserve.models.catalog import default_model_path, gemma3_270m_path
from kvserve.models.gguf_reader import GGUFFile, torch_view

Q = GGMLQuantizationType


def assert_same_as_gguf_reader(path: Path) -> None:
    ours, theirs = GGUFFile(path), GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for key, expected in theirs.fields.items():
        field = ours.fields[key]
        assert field.types == expected.types, key
        value, reference = field.contents(), expected.contents()
        if isinstance(value, np.ndarray):  # numeric arrays: one array, where GGUFReader gives a list
            assert value.dtype == GGUFReader.gguf_scalar_to_np[expected.types[-1]], key
            assert value.tolist() == reference, key
        else:
            assert type(value) is type(reference) and value == reference, key
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for tensor, expected in zip(ours.tensors, theirs.tensors, strict=True):
        assert tensor.tensor_type == expected.tensor_type, tensor.name
        assert tensor.shape.dtype == expected.shape.dtype and tensor.shape.tolist() == expected.shape.tolist()
        assert (tensor.n_elements, tensor.n_bytes) == (expected.n_elements, expected.n_bytes), tensor.name
        assert tensor.data_offset == expected.data_offset, tensor.name
        assert tensor.data.dtype == expected.data.dtype and tensor.data.shape == expected.data.shape, tensor.name
        assert np.array_equal(tensor.data.reshape(-1).view(np.uint8), expected.data.reshape(-1).view(np.uint8))
        assert not tensor.data.flags.writeable  # a view of the read-only map, not a copy


@pytest.mark.real_model
@pytest.mark.parametrize("find", [default_model_path, gemma3_270m_path], ids=["smollm2", "gemma3"])
def test_real_files_read_as_gguf_reader_reads_them(find) -> None:
    assert_same_as_gguf_reader(find())


def write_every_kind(path: Path, alignment: int | None = None) -> Path:
    """Every metadata value type, and tensors of plain and quantised types."""
    writer = GGUFWriter(path, "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for kind, value in [
        (GGUFValueType.UINT8, 200),
        (GGUFValueType.INT8, -100),
        (GGUFValueType.UINT16, 60000),
        (GGUFValueType.INT16, -30000),
        (GGUFValueType.UINT32, 4_000_000_000),
        (GGUFValueType.INT32, -2_000_000_000),
        (GGUFValueType.FLOAT32, 1e-6),
        (GGUFValueType.BOOL, True),
        (GGUFValueType.UINT64, 2**63 + 5),
        (GGUFValueType.INT64, -(2**62)),
        (GGUFValueType.FLOAT64, 0.1),
        (GGUFValueType.STRING, "héllo ▁ 🎉"),
    ]:
        writer.add_key_value(f"test.{kind.name.lower()}", value, kind)
    writer.add_key_value("test.empty_string", "", GGUFValueType.STRING)
    writer.add_array("test.strings", ["", "a", "\x00b", "日本語", "<0x0A>", " "])
    writer.add_array("test.ints", [1, -2, 3])
    writer.add_array("test.floats", [0.5, -1.25])
    writer.add_array("test.bools", [True, False])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 4)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((2, 8)).astype(np.float16))
    writer.add_tensor("i32", np.arange(5, dtype=np.int32))
    for kind in (Q.BF16, Q.Q8_0, Q.Q4_K):
        block, size = GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (2, 256 // block * size), dtype=np.uint8)  # two rows of 256 values
        writer.add_tensor(kind.name.lower(), raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_every_value_and_tensor_kind_reads_as_gguf_reader_reads_it(alignment, tmp_path) -> None:
    assert_same_as_gguf_reader(write_every_kind(tmp_path / "every.gguf", alignment))


def test_numeric_arrays_are_numpy_arrays_and_string_arrays_lists(tmp_path) -> None:
    fields = GGUFFile(write_every_kind(tmp_path / "every.gguf")).fields
    assert fields["test.strings"].contents() == ["", "a", "\x00b", "日本語", "<0x0A>", " "]
    floats = fields["test.floats"].contents()
    assert isinstance(floats, np.ndarray) and floats.dtype == np.float32 and floats.tolist() == [0.5, -1.25]


def test_torch_view_shares_the_mapped_bytes_without_a_warning(tmp_path) -> None:
    tensor = next(t for t in GGUFFile(write_every_kind(tmp_path / "every.gguf")).tensors if t.name == "q4_k")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        view = torch_view(tensor.data)
    assert view.data_ptr() == tensor.data.ctypes.data and tuple(view.shape) == tensor.data.shape


@pytest.mark.parametrize("cut", [3, 10, 30, 200, -1])
def test_a_truncated_file_is_named_truncated_or_corrupt(cut, tmp_path) -> None:
    data = write_every_kind(tmp_path / "every.gguf").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(ModelLoadError, match="is not a GGUF file" if 0 <= cut < 4 else "truncated or corrupt") as info:
        GGUFFile(path)
    assert str(path) in str(info.value)


def test_the_problem_is_named(tmp_path) -> None:
    data = bytearray(write_every_kind(tmp_path / "every.gguf").read_bytes())
    cases = {
        "version": (slice(4, 8), struct.pack("<I", 1), "GGUF version 1"),
        "big-endian": (slice(4, 8), struct.pack(">I", 3), "big-endian"),
        "empty": (slice(0, None), b"", "truncated or corrupt"),
    }
    for name, (where, value, message) in cases.items():
        path = tmp_path / f"{name}.gguf"
        damaged = bytearray(data)
        damaged[where] = value
        path.write_bytes(bytes(damaged))
        with pytest.raises(ModelLoadError, match=message):
            GGUFFile(path)
    # The first key's value type (after magic, version, counts, and the key "general.architecture").
    kind_at = 24 + 8 + len("general.architecture")
    damaged = bytearray(data)
    damaged[kind_at : kind_at + 4] = struct.pack("<I", 99)
    (tmp_path / "kind.gguf").write_bytes(bytes(damaged))
    with pytest.raises(ModelLoadError, match="'general.architecture' has unknown value type 99"):
        GGUFFile(tmp_path / "kind.gguf")


def test_tensor_data_past_the_end_is_named(tmp_path) -> None:
    path = write_every_kind(tmp_path / "every.gguf")
    last = GGUFFile(path).tensors[-1]
    path.write_bytes(path.read_bytes()[: last.data_offset + last.n_bytes - 1])
    with pytest.raises(ModelLoadError, match=f"tensor '{last.name}' lies past the end of the file"):
        GGUFFile(path)
