"""What `rollout serve` serves: a model named by a config, a path or a checkpoint, loaded as a
training worker loads it (rollout.models.loading.load_model), behind an EngineService.

Sources, exactly one:
- a config file: its [model] section (with its tokenizer and chat template overrides) and its
  [generation] section as the request defaults;
- a model: a Hugging Face directory, a .gguf file, `builtin:NAME` or `package:NAME`;
- a checkpoint: a step directory (runs/<id>/checkpoints/step-000010), a run directory or its
  checkpoints directory (the latest complete step), or a run id from the run store. Completions
  then carry the checkpoint's step as their policy version.
"""

from __future__ import annotations

import functools
import json
import os
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from rollout.config.model import ModelSection
from rollout.config.secrets import check_secret_ref
from rollout.errors import Issue, RolloutError
from rollout.serve.protocol import MAX_TOKEN_CHARS, Defaults, ModelInfo


@dataclass(frozen=True)
class ServeSource:
    """The model to serve and how, as the command line gave it."""

    section: ModelSection
    base_dir: Path
    name: str
    defaults: Defaults
    max_batch_size: int | None = None
    policy_version: int = 0
    option: str = "--model"
    """The option that named the model, where its problems are reported."""


def resolve_source(
    *, config: Path | None, model: str | None, checkpoint: str | None, name: str | None
) -> ServeSource:
    """The one source among --config, --model and --checkpoint (a RolloutError otherwise)."""
    given = [
        flag
        for flag, value in (("--config", config), ("--model", model), ("--checkpoint", checkpoint))
        if value is not None
    ]
    if len(given) != 1:
        raise RolloutError(
            Issue(
                "rollout serve",
                "give exactly one of --config, --model or --checkpoint"
                + (f" (got {', '.join(given)})" if given else ""),
                hint="e.g. rollout serve --model builtin:tiny-llama",
            )
        )
    if config is not None:
        return _from_config(config, name)
    if model is not None:
        section = _model_section(model)
        # A URL's name is the last part of its path: its query may hold a signature or a token.
        where = urlsplit(model).path if "://" in model else model
        default_name = section.builtin or section.package or Path(where).name
        return ServeSource(section, Path.cwd(), name or default_name, Defaults())
    assert checkpoint is not None
    step_dir = _checkpoint_dir(checkpoint)
    section = ModelSection(path=str(step_dir / "model"))
    default_name = f"{step_dir.parent.parent.name}/{step_dir.name}"
    return ServeSource(
        section,
        Path.cwd(),
        name or default_name,
        Defaults(),
        policy_version=_step(step_dir),
        option="--checkpoint",
    )


def resolve_api_key(reference: str | None, host: str) -> str | None:
    """The API key a secret reference (env:NAME or file:/path) names; required unless `host` is
    a loopback address. The reference is never echoed: it might be the key itself."""
    if reference is None:
        if not is_loopback(host):
            raise RolloutError(
                Issue(
                    "--host",
                    f"binding {host} exposes the model beyond this machine, and needs an API key",
                    hint="add --api-key env:NAME with the key in that environment variable, "
                    "or bind 127.0.0.1",
                )
            )
        return None
    try:
        check_secret_ref(reference)
    except ValueError:
        raise RolloutError(
            Issue(
                "--api-key",
                "takes a reference to the key, never the key itself",
                hint="export ROLLOUT_API_KEY=... and pass --api-key env:ROLLOUT_API_KEY "
                "(or --api-key file:/path/to/key)",
            )
        ) from None
    if reference.startswith("env:"):
        variable = reference.removeprefix("env:")
        key = os.environ.get(variable, "")
        where = f"the environment variable {variable}"
    else:
        path = Path(reference.removeprefix("file:")).expanduser()
        try:
            key = path.read_text(encoding="utf-8").strip()
        except OSError as error:
            raise RolloutError(
                Issue("--api-key", f"cannot read {path}: {error.strerror}")
            ) from None
        where = str(path)
    if not key:
        raise RolloutError(Issue("--api-key", f"{where} is not set or empty"))
    return key


def tls_context(cert: Path | None, key: Path | None) -> ssl.SSLContext | None:
    """The server's TLS context from --tls-cert and --tls-key (PEM files, both or neither;
    TLS 1.2 or later), None without them. Every problem is a RolloutError naming the flag."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
        raise RolloutError(
            Issue(
                missing,
                f"{given} needs {missing} too",
                hint="give both: the certificate (chain) and its private key, as PEM files",
            )
        )
    if b"-----BEGIN CERTIFICATE-----" not in _read("--tls-cert", cert):
        raise RolloutError(Issue("--tls-cert", f"{cert} holds no PEM certificate"))
    if b"PRIVATE KEY-----" not in _read("--tls-key", key):
        raise RolloutError(Issue("--tls-key", f"{key} holds no PEM private key"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # Without a password callback OpenSSL would prompt for an encrypted key's passphrase on
        # the terminal; the callback refuses instead.
        context.load_cert_chain(cert, key, password=_refuse_passphrase)
    except _EncryptedKey:
        raise RolloutError(
            Issue(
                "--tls-key",
                f"{key} is encrypted with a passphrase",
                hint=f"serve an unencrypted copy: openssl pkey -in {key} -out key.pem "
                "(readable only by you)",
            )
        ) from None
    except ssl.SSLError as error:
        if error.reason == "KEY_VALUES_MISMATCH":
            message = f"{key} is not the private key of the certificate {cert}"
        else:
            message = f"cannot load the certificate {cert} with the key {key}: {error.reason}"
        raise RolloutError(Issue("--tls-key", message)) from None
    return context


class _EncryptedKey(Exception):
    pass


def _refuse_passphrase() -> str:
    raise _EncryptedKey


def _read(flag: str, path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as error:
        raise RolloutError(Issue(flag, f"cannot read {path}: {error.strerror}")) from None


def is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def load_served(
    source: ServeSource, *, device: str, dtype: str, seed: int | None, max_batch_size: int | None
) -> Any:
    """Load the model and start an EngineService: (ServedModel, the service)."""
    from rollout.engines.build import build_engine
    from rollout.inference.model_choice import inspect_model_at
    from rollout.models.loading import load_model

    facts = inspect_model_at(source.section, source.base_dir, source.option)
    if dtype == "auto":
        dtype = source.section.dtype
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    loaded = load_model(facts, source.section, dtype=dtype, device=device, base_dir=source.base_dir)
    engine = build_engine(
        "hf",  # EngineService drives the hf engine's decode batch
        model=loaded.model,
        tokenizer=loaded.tokenizer,
        eos_token_ids=loaded.eos_token_ids,
        pad_token_id=loaded.pad_token_id,
        device=device,
        max_batch_size=max_batch_size or source.max_batch_size,
        seed=seed,
    )
    engine.load_weights(None, version=source.policy_version)
    return served_engine(
        engine,
        loaded.tokenizer,
        loaded.chat_template,
        name=source.name,
        defaults=source.defaults,
    )


def served_engine(
    engine: Any,
    tokenizer: Any,
    template: str | None,
    *,
    name: str,
    defaults: Any = None,
    max_requests: int | None = None,
) -> Any:
    """A ServedModel over an hf engine that is already built (`rollout serve`'s, or a training
    run's own, which the agent harness serves to its agents): its EngineService started."""
    from rollout.engines.service import DEFAULT_MAX_REQUESTS, EngineService
    from rollout.serve.protocol import Defaults
    from rollout.serve.server import ServedModel

    def chat_encode(messages: list[dict[str, Any]]) -> list[int]:
        return list(
            tokenizer.apply_chat_template(
                messages,
                chat_template=template,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
        )

    context = engine.context_length

    def encode(text: str) -> list[int]:
        # Past context + 1 tokens the count no longer matters: the prompt is refused either way.
        limit = {"truncation": True, "max_length": context + 1} if context else {}
        return list(tokenizer.encode(text, add_special_tokens=True, **limit))

    info = ModelInfo(
        name=name,
        context_length=context,
        vocab_size=engine.model.config.vocab_size,
        encode=encode,
        chat_encode=chat_encode if template else None,
        defaults=defaults if defaults is not None else Defaults(),
        max_token_chars=max_token_chars(tokenizer),
    )
    service = EngineService(engine, max_requests=max_requests or DEFAULT_MAX_REQUESTS)

    # Alternatives (top_logprobs) ask for up to 20 token texts per sampled token: cache them.
    @functools.lru_cache(maxsize=1 << 16)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return ServedModel(info, service, token_text, created=int(time.time()))


def max_token_chars(tokenizer: Any) -> int:
    """Characters one token covers at most: its longest vocabulary entry (a byte-level BPE entry
    has a character per byte, a SentencePiece one a character per character), and never under
    MAX_TOKEN_CHARS, whose margin covers normalizers that merge characters."""
    try:
        longest = max((len(entry) for entry in tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        longest = 0
    return max(MAX_TOKEN_CHARS, longest)


def _from_config(path: Path, name: str | None) -> ServeSource:
    from rollout.config import load_config

    config = load_config(path)
    generation = config.generation
    defaults = Defaults(
        max_tokens=generation.max_new_tokens,
        temperature=generation.temperature,
        top_p=generation.top_p,
        top_k=generation.top_k,
        stop=tuple(generation.stop),
    )
    section = config.model
    default_name = section.builtin or section.package or section.hub or config.run.name
    return ServeSource(
        section,
        path.resolve().parent,
        name or default_name,
        defaults,
        max_batch_size=generation.max_batch_size,
        option="model",
    )


def _model_section(model: str) -> ModelSection:
    """--model read as `rollout generate` reads it."""
    from rollout.inference.model_choice import model_source

    chosen = {k: v for k, v in model_source(model).items() if v is not None and k != "format"}
    return _section("--model", **chosen)


def _section(flag: str, **fields: Any) -> ModelSection:
    from pydantic import ValidationError

    try:
        return ModelSection(**fields)
    except ValidationError as error:
        message = "; ".join(e["msg"] for e in error.errors())
        raise RolloutError(Issue(flag, message, value=next(iter(fields.values())))) from None


def _checkpoint_dir(checkpoint: str) -> Path:
    """The step directory --checkpoint names (a step, run or checkpoints directory, or a run
    id), found as `rollout generate --checkpoint` finds it."""
    from rollout.inference.model_choice import find_checkpoint

    return find_checkpoint(checkpoint).model_dir.parent


def _step(step_dir: Path) -> int:
    """The checkpoint's training step: the policy version of what it samples."""
    try:
        return int(json.loads((step_dir / "trainer.json").read_text(encoding="utf-8"))["step"])
    except (OSError, ValueError, KeyError, TypeError):
        digits = "".join(c for c in step_dir.name if c.isdigit())
        return int(digits) if digits else 0
