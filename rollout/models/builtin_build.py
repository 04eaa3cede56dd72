"""Materialize a builtin tiny model (rollout.models.builtin) as a Hugging Face model directory.

The weights are random but deterministic (a fixed seed on a private generator), and the tokenizer is
a byte-level BPE trained on a small corpus written here, so every process on every machine builds
the same bytes without downloading anything. `builtin_model_dir` caches one build per spec and
recipe, and is safe to call from several torchrun workers at once.

torch and transformers are imported by the functions that need them, so that the planner can
call `tiny_tokenizer` (the `tokenizers` library alone) and stay torch-free.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rollout.models import builtin
from rollout.models.cache import built_once

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

SEED = 0
"""Seeds the weights."""

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A language model predicts the next token from the
tokens before it. Reinforcement learning rewards the answers that are right, and the model learns to
give them more often. You are a helpful assistant. Answer the question, then stop. Think step by
step and show your work. What is the capital of France? Paris is the capital of France. How many
days are in a week? There are seven days in a week. The user asks a question and the assistant
answers it; the system prompt says how the assistant should behave.
"""


def _arithmetic() -> str:
    lines = []
    for a in range(0, 40, 3):
        for b in range(0, 40, 7):
            lines.append(f"What is {a} + {b}? {a} + {b} = {a + b}. The answer is {a + b}.\n")
            lines.append(f"Compute {a} * {b} - {b}: {a * b - b}\n")
    return "".join(lines)


CORPUS = _ENGLISH + _arithmetic()
"""What the tokenizer's merges are trained on: English, ChatML role names and arithmetic."""


def build_tiny(name: str, directory: Path) -> Path:
    """Write the builtin model `name` into `directory` (created if needed) and return it.

    Writes config.json (builtin.hf_config verbatim), model.safetensors and the tokenizer files
    (tokenizer.json, tokenizer_config.json, chat_template.jinja). Two builds give identical bytes.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = builtin.hf_config(name)
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    _save_weights(config, directory / "model.safetensors")
    build_tokenizer(model_max_length=config["max_position_embeddings"]).save_pretrained(directory)
    return directory


def builtin_model_dir(name: str) -> Path:
    """The cached directory of the builtin model `name`, built on first use (see
    rollout.models.cache)."""
    return built_once(
        f"models/{name}-{_build_key(name)}", lambda directory: build_tiny(name, directory)
    )


def build_tokenizer(*, model_max_length: int) -> PreTrainedTokenizerFast:
    """The tiny byte-level BPE tokenizer (`tiny_tokenizer`), wrapped for transformers."""
    from transformers import PreTrainedTokenizerFast

    endoftext, im_start, im_end = builtin.SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(),
        bos_token=im_start,
        eos_token=im_end,
        pad_token=endoftext,
        chat_template=builtin.CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # byte-level decoding must return the text exactly
        model_max_length=model_max_length,
    )


def tiny_tokenizer() -> Tokenizer:
    """The tiny byte-level BPE tokenizer, as the `tokenizers` library's object.

    Ids 0-2 are the special tokens of builtin.SPECIAL_TOKENS, then the 256 byte tokens (so any text
    encodes), then merges learned from CORPUS up to exactly builtin.VOCAB_SIZE ids.
    """
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=builtin.VOCAB_SIZE,
        special_tokens=list(builtin.SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # The trainer orders equally frequent pairs by their token ids, never by hash order, so the
    # merges and tokenizer.json are the same in every process (a test builds in two).
    bpe.train_from_iterator([CORPUS], trainer=trainer)
    if bpe.get_vocab_size() != builtin.VOCAB_SIZE:
        raise RuntimeError(
            f"the tiny tokenizer has {bpe.get_vocab_size()} ids, not {builtin.VOCAB_SIZE}: "
            "CORPUS is too small to learn enough merges"
        )
    return bpe


def _save_weights(config: dict, path: Path) -> None:
    """Random weights for `config`, drawn in a fixed order from a generator seeded with SEED.

    Matrices ~ N(0, 1/fan_in), norm weights 1, biases 0. Not transformers' N(0, initializer_range):
    with that and tied embeddings, the input token's embedding dominates the residual stream and a
    random model only repeats its last token; scaled to the fan-in, its layers carry the context,
    so sampled and greedy outputs vary with the prompt as a test needs. A tied head is not saved
    (transformers ties it to the embeddings on load).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # names and shapes only
        skeleton = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))
    generator = torch.Generator("cpu").manual_seed(SEED)
    tensors = {}
    for name, param in sorted(skeleton.named_parameters()):  # named_parameters drops tied copies
        if param.dim() >= 2:
            tensor = torch.randn(param.shape, generator=generator, device="cpu") / math.sqrt(
                param.shape[1]
            )
        elif "norm" in name:
            tensor = torch.ones(param.shape, device="cpu")
        else:
            tensor = torch.zeros(param.shape, device="cpu")
        tensors[name] = tensor.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _build_key(name: str) -> str:
    """A short hash of what decides the built bytes: the spec, and this module's source (the
    corpus, the seed, the initialization), so editing any of them builds afresh."""
    spec = json.dumps(builtin.spec(name), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    digest = hashlib.sha256(spec.encode())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]
