"""The pieces of `rollout serve` below the model sources (rollout.inference.serve_source):
the API key and TLS settings, and a ServedModel over an engine that is already built (what the
agent harness serves a training run's own engine with)."""

from __future__ import annotations

import functools
import os
import ssl
import time
from pathlib import Path
from typing import Any

from rollout.config.secrets import check_secret_ref
from rollout.errors import Issue, RolloutError
from rollout.serve.protocol import MAX_TOKEN_CHARS, Defaults, ModelInfo


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


def engine_service(
    engine: Any,
    tokenizer: Any,
    *,
    max_requests: int | None = None,
    max_batch_size: int | None = None,
) -> Any:
    """The service that runs `engine` for concurrent requests: the built-in hf engine's
    EngineService (continuous batching, token streaming), or for any other engine (a plugin,
    which has only the Protocol's generate) a BatchService of whole generate calls."""
    from rollout.engines.batch_service import BatchService
    from rollout.engines.hf.engine import HfEngine
    from rollout.engines.service import DEFAULT_MAX_REQUESTS, EngineService

    requests = max_requests or DEFAULT_MAX_REQUESTS
    # Exactly the built-in: a subclass may change generate, which the decode batch never calls.
    if type(engine) is HfEngine:
        return EngineService(engine, max_requests=requests)
    return BatchService(engine, tokenizer, max_requests=requests, max_batch_size=max_batch_size)


def served_engine(
    engine: Any,
    tokenizer: Any,
    template: str | None,
    *,
    name: str,
    defaults: Any = None,
    max_requests: int | None = None,
    model_config: Any = None,
    max_batch_size: int | None = None,
    reloadable: bool = False,
) -> Any:
    """A ServedModel over an engine that is already built (`rollout serve`'s, or a training
    run's own, which the agent harness serves to its agents): its service started.
    `model_config` (the transformers config) tells an engine plugin's context length and
    vocabulary, which the hf engine knows itself. `reloadable`: behind a ReloadableService
    (`rollout serve --dev`)."""
    from rollout.serve.reloading import ReloadableService
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

    config = model_config if model_config is not None else engine.model.config
    context = getattr(config, "max_position_embeddings", None)

    def encode(text: str) -> list[int]:
        # Past context + 1 tokens the count no longer matters: the prompt is refused either way.
        limit = {"truncation": True, "max_length": context + 1} if context else {}
        return list(tokenizer.encode(text, add_special_tokens=True, **limit))

    info = ModelInfo(
        name=name,
        context_length=context,
        vocab_size=config.vocab_size,
        encode=encode,
        chat_encode=chat_encode if template else None,
        defaults=defaults if defaults is not None else Defaults(),
        max_token_chars=max_token_chars(tokenizer),
    )
    service = engine_service(
        engine, tokenizer, max_requests=max_requests, max_batch_size=max_batch_size
    )
    if reloadable:
        service = ReloadableService(service)

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
